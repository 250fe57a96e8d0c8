"""Clients that go away mid-stream, then their episode is closed (an agent killed at its timeout): no traceback
and no "Task exception was never retrieved", also when one episode sent the same body twice (both requests share
one retry key, and each generation is still cancelled when the episode closes); the engine's rows are all freed.
The warning a disconnect mid-upload writes does not show the episode's token (its api key). The real proxy on
127.0.0.1 over the real debug engine and tiny model, driven by raw sockets that read the first chunk and close."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer

EPISODES = 8
TOKENS = 300         # what each streamed call asks for: far more than is generated before the client leaves
STEP_S = 0.002       # every forward pass takes at least this much longer (a stream outlives its client's read)


@pytest.fixture(scope="module")
def proxy(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.register_forward_hook(lambda *_: time.sleep(STEP_S))
    engine = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=2 * EPISODES,
                      max_model_len=1024, prefix_cache_bytes=0)
    server = ProxyServer(engine, tok, SamplingParams(temperature=1.0, max_tokens=TOKENS), max_model_len=1024,
                         seed=0).start()
    try:
        yield server
    finally:
        server.stop()
        engine.close()


def _request(url: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A raw HTTP/1.1 POST of JSON `body` to `url` (bytes to send on a socket), with extra `headers`."""
    u = urlsplit(url)
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _read_to_first_token(sock: socket.socket) -> None:
    """Read a streamed answer until its first non-empty content token; fails on a closed socket or a non-200."""
    got = b""
    while b'"content":"' not in got.replace(b'"content":""', b""):
        part = sock.recv(65536)
        assert part, got[-300:]
        got += part
    assert got.startswith(b"HTTP/1.1 200"), got[:300]


def _stream_and_vanish(url: str, body: bytes) -> None:
    """POST a streamed call, read until its first content token arrives, close the connection."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=120) as sock:
        sock.sendall(_request(url, body))
        _read_to_first_token(sock)


def _problems(caplog, err: str) -> list[str]:
    lines = [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    return lines + [line for line in err.splitlines() if "Traceback" in line or "never retrieved" in line]


def test_streams_left_mid_way_then_closed_leave_no_traceback_and_free_every_row(proxy, caplog, capfd):
    caplog.set_level(logging.WARNING)
    engine = proxy.engine
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "count"}]}).encode()
    for i in range(EPISODES):
        ep = proxy.open_episode(f"ep{i}")
        _stream_and_vanish(ep.base_url + "/chat/completions", body)
        _stream_and_vanish(ep.base_url + "/chat/completions", body)   # the same body: the same retry key
        assert proxy.close_episode(ep) == []          # both generations cancelled: nothing recorded
    deadline = time.monotonic() + 300
    while engine.active_rows or engine.generated_tokens < 2 * EPISODES:
        assert time.monotonic() < deadline, engine.active_rows
        time.sleep(0.05)
    # every row left once its call was cancelled: far fewer tokens than the calls asked for
    assert engine.generated_tokens < EPISODES * TOKENS, engine.generated_tokens
    # a finished task nobody retrieved reports itself when it is collected
    gc.collect()
    ep = proxy.open_episode("after")          # the proxy still answers, and its loop has run the collection's reports
    r = httpx.post(ep.base_url + "/chat/completions", timeout=120,
                   json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text[:300]
    assert len(proxy.close_episode(ep)) == 1
    gc.collect()
    _, err = capfd.readouterr()
    assert not _problems(caplog, err), _problems(caplog, err)[:3]


def test_a_disconnect_warning_does_not_show_the_episode_token(proxy, caplog, capfd):
    caplog.set_level(logging.INFO)
    ep = proxy.open_episode("leaky")
    u = urlsplit(ep.base_url + "/chat/completions")
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:   # headers, 10 of 1000 bytes, gone
        sock.sendall(_request(ep.base_url + "/chat/completions", b"x" * 1000)[:-990])
    deadline = time.monotonic() + 120
    while not [r for r in caplog.records if "closed the connection" in r.getMessage()]:
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    proxy.close_episode(ep)
    lines = [r.getMessage() for r in caplog.records]
    out, err = capfd.readouterr()
    assert any("POST /ep/<token>/v1/chat/completions" in line for line in lines), lines
    assert ep.api_key not in "\n".join(lines) + out + err


class _FailsWhenCancelled(HFEngine):
    """An engine whose call, cancelled, fails instead (as a remote engine whose connection is cut may)."""

    async def generate(self, *args, **kwargs):
        try:
            return await super().generate(*args, **kwargs)
        except asyncio.CancelledError:
            raise RuntimeError("engine is shut down") from None


def test_a_generation_failing_after_its_client_left_leaves_no_unretrieved_task(proxy, caplog, capfd):
    """The engine fails under a stream whose client has gone (the proxy cancels the generation of a client that
    left; this engine turns that into a failure): the generation's 503 has nobody to go to, and is still
    retrieved (one warning line, no "Task exception was never retrieved" when the task is collected)."""
    caplog.set_level(logging.WARNING)
    tok = proxy.tokenizer
    engine = _FailsWhenCancelled(proxy.engine.model, eos_token_ids=[], pad_token_id=tok.pad_token_id,
                                 max_model_len=1024, prefix_cache_bytes=0)
    own = ProxyServer(engine, tok, SamplingParams(temperature=1.0, max_tokens=TOKENS), max_model_len=1024).start()
    try:
        ep = own.open_episode("doomed")
        body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]}).encode()
        _stream_and_vanish(ep.base_url + "/chat/completions", body)   # the generation fails: a 503 nobody hears
        deadline = time.monotonic() + 120
        while not [r for r in caplog.records if "engine failed" in r.getMessage()]:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        assert own.close_episode(ep) == []
    finally:
        own.stop()
        engine.close()
    gc.collect()                            # a finished task nobody retrieved reports itself when it is collected
    _, err = capfd.readouterr()
    assert not _problems(caplog, err), _problems(caplog, err)[:3]


def test_stopping_the_proxy_answers_a_stream_in_flight_and_frees_its_row(proxy):
    """`ProxyServer.stop` with a streamed call generating: the stream ends with the `server_stopping` error event
    (not a dropped connection), and the engine's row is freed at once."""
    engine = proxy.engine
    own = ProxyServer(engine, proxy.tokenizer, SamplingParams(temperature=1.0, max_tokens=TOKENS),
                      max_model_len=1024).start()
    ep = own.open_episode("stopped")
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go on"}]}
    events: list[str] = []
    with httpx.stream("POST", ep.base_url + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:           # generating
                    before = engine.generated_tokens
                    own.stop()
    assert json.loads(events[-1])["error"]["code"] == "server_stopping", events[-3:]
    deadline = time.monotonic() + 120
    while engine.active_rows:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert engine.generated_tokens - before < TOKENS // 2, (engine.generated_tokens, before)


def test_a_dead_server_s_failures_are_one_warning_a_minute(caplog):
    """32 calls failing with the same error (a dead server under a full batch) are one warning; a different error
    is warned at once; after the window the same error is warned again, saying how many were not shown."""
    from ajet.proxy.server import FailureLog

    caplog.set_level(logging.WARNING)
    now = [0.0]
    failures = FailureLog(window_s=60, clock=lambda: now[0])
    dead = ConnectionRefusedError("http://127.0.0.1:8000/v1/completions: connection refused")
    logged = [failures.warn(dead) for _ in range(32)]
    other = failures.warn(RuntimeError("CUDA out of memory"))
    now[0] = 61.0
    again = failures.warn(dead)
    lines = [r.getMessage() for r in caplog.records if "engine failed" in r.getMessage()]
    assert logged == [True] + [False] * 31 and other and again
    assert len(lines) == 3 and "connection refused" in lines[0] and "CUDA out of memory" in lines[1]
    assert lines[2].endswith("(31 more like it since the last one shown)"), lines[2]
