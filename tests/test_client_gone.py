"""A client that closes its connection before its answer is complete has its decoding stopped: its row leaves the
debug engine's batch instead of decoding to its `max_tokens`, and nothing is recorded. The same on the bare
proxy, on `ajet gateway`'s front and on `ajet serve`'s app (episode API beside the proxy, behind its guard), for a
non-streamed call (the client leaves while the row decodes) and a streamed one (it leaves after the first content
token). Real tiny model in the real engine (no end-of-turn id, so that only `max_tokens` ends a row), real
servers on 127.0.0.1, raw sockets that send a whole request and close.

Token counts, not times: a row that kept decoding would add about `LONG` tokens to the engine's count; a stopped
one adds at most the steps that ran while the disconnect travelled (`SLACK`: seconds of a loaded machine, each
step slowed to at least `STEP_S`)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.engines.in_process import HFEngine
from ajet.gateway.app import GatewayApp
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.guard import Guard, allowed_hosts
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episode_queue import EpisodeQueue
from ajet.serve.api import build_api, compose
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler
from tests.test_stream_disconnects import _read_to_first_token, _request

LONG = 1800        # tokens each call asks for (max_model_len 2048)
STEP_S = 0.005     # every forward pass takes at least this much longer: a call runs >= 9 s in full
SLACK = 400        # tokens a row may still produce while its client's disconnect arrives (2 s of steps)
SECRET = "test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.register_forward_hook(lambda *_: time.sleep(STEP_S))
    eng = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=2, max_model_len=2048,
                   prefix_cache_bytes=0)
    eng.tok = tok
    try:
        yield eng
    finally:
        eng.close()


def _proxy(engine) -> ProxyServer:
    return ProxyServer(engine, engine.tok, SamplingParams(temperature=1.0, max_tokens=LONG), max_model_len=2048,
                       seed=0)


def _bare(engine, tmp_path):
    """The proxy alone: an episode's own URL."""
    proxy = _proxy(engine).start()
    ep = proxy.open_episode("ep")
    return proxy, ep.base_url + "/chat/completions", {}, lambda: proxy.close_episode(ep)


def _gateway(engine, tmp_path):
    """`ajet gateway`'s front (no gate) over the proxy, as `ajet.commands.gateway.gateway` assembles it."""
    proxy = _proxy(engine)
    store = GatewayStore(tmp_path / "gateway.sqlite")
    book = SessionBook(proxy, store, idle_s=600, deadline_s=600, on_no_feedback="drop")
    attach(proxy, book, lambda p, b: GatewayApp(p, b, SECRET, lambda: 0, max_queued=4, decoding=2))
    proxy.start()
    return proxy, proxy.url + "/v1/chat/completions", {"Authorization": f"Bearer {SECRET}"}, store.close


def _serve(engine, tmp_path):
    """`ajet serve`'s app (as `ServeSource.bind` composes it): begin an episode, call its base_url."""
    proxy = _proxy(engine)
    queue = EpisodeQueue(MultiTaskSampler({"train": [Task("t0", "Count.", "1")]}), num_repeat=2, tasks_per_step=1,
                         total_steps=1, first_step=1, attempt=0, record=lambda step, ep: None, idle_timeout_s=600.0)
    queue.bind(proxy)
    proxy.app = Guard(compose(proxy.app, build_api(queue, SECRET), queue.activity), allowed_hosts("127.0.0.1"))
    proxy.start()
    begun = httpx.post(proxy.url + "/ajet/v1/episodes", json={"client_id": "c"}, timeout=60,
                       headers={"Authorization": f"Bearer {SECRET}"})
    assert begun.status_code == 200, begun.text[:300]
    b = begun.json()
    return proxy, b["base_url"] + "/chat/completions", {"Authorization": f"Bearer {b['api_key']}"}, lambda: None


def _call_and_leave(url: str, headers: dict[str, str], stream: bool, engine) -> int:
    """POST a call of `LONG` tokens, leave once it decodes (a stream: after its first content token), and return
    the engine's generated-token count at that moment."""
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "count"}]}).encode()
    u = urlsplit(url)
    start = engine.generated_tokens
    with socket.create_connection((u.hostname, u.port), timeout=120) as sock:
        sock.sendall(_request(url, body, headers))
        if stream:
            _read_to_first_token(sock)
        else:
            deadline = time.monotonic() + 120
            while engine.generated_tokens < start + 3:   # its row decodes
                assert time.monotonic() < deadline, "the call never started decoding"
                time.sleep(0.01)
            assert engine.active_rows == 1
        return engine.generated_tokens


SERVERS = {"proxy": _bare, "gateway": _gateway, "serve": _serve}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("where", list(SERVERS))
def test_a_client_gone_stops_its_decoding(engine, tmp_path, where, stream):
    proxy, url, headers, cleanup = SERVERS[where](engine, tmp_path)
    try:
        left_at = _call_and_leave(url, headers, stream, engine)
        deadline = time.monotonic() + 120
        while engine.active_rows:                        # the row leaves the batch
            assert time.monotonic() < deadline, engine.active_rows
            assert engine.generated_tokens - left_at <= SLACK, "the row kept decoding after its client left"
            time.sleep(0.01)
        assert engine.generated_tokens - left_at <= SLACK, (engine.generated_tokens, left_at)
        # the server still answers a call that stays
        r = httpx.post(url, headers=headers, timeout=120,
                       json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        cleanup()
        proxy.stop()
