"""`ajet gateway` serves while it trains, on the debug backbone's in-process engine: the update trains the trainer's
copy of the weights while the served copy keeps answering, and the new weights are switched in only once the rows
in flight have finished.

Real components: the tiny model's `DebugBackbone`, the gateway's HTTP front served by uvicorn on 127.0.0.1, its
session book and gateway.sqlite, and the gate (`VersionGate.update`, what the trainer calls for each step).
Concurrency is shown by order, never by time: hooks block the update (inside its backward pass), the gate's
evaluation, or the served stream's decoding until the event the test waits for has happened; each wait is bounded
(a hook that gives up records it, and the test fails)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from contextlib import contextmanager

import httpx
import torch

from ajet.backbones.debug.backbone import DebugBackbone
from ajet.engines.in_process import engine_for
from ajet.config import AjetConfig
from ajet.gateway.app import GatewayApp
from ajet.gateway.gate import LiveHold, VersionGate
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.local_servers import serving
from tests.test_gateway_gate import WORKFLOW   # one greedy call, reward 1 on an exact answer
from tests.test_gateway_poison import _samples

BOUND_S = 120.0       # the longest any hook or the test waits for an event (a failure, never a pass condition)
STREAM_TOKENS = 24


def _cfg(tiny_model_dir, tmp_path, **over) -> AjetConfig:
    fields = {"workflow": "x:y", "data": {"train_path": "x"}, "rollout": {"max_tokens": 8},
              "algorithm": {"micro_batch_tokens": 64, "lr": 0.1}, "trainer": {"exp_dir": str(tmp_path / "exp")},
              "gateway": {"gate": over.pop("gate", {"mode": "off"})},
              "model": {"path": tiny_model_dir, "device": "cpu", "max_model_len": 256, **over.pop("model", {})}}
    return AjetConfig(**{**fields, **over})


@contextmanager
def live_gateway(cfg: AjetConfig, tmp_path):
    """The gateway's front over the backbone's engine, with the gate attached (serving while training on)."""
    bb = DebugBackbone(cfg)
    store = GatewayStore(tmp_path / "gateway.sqlite")
    try:
        gate = VersionGate(cfg, store, LiveHold())
        gate.attach(bb)
        proxy = ProxyServer(bb.engine, bb.tokenizer, SamplingParams(temperature=0.0, max_tokens=64),
                            sampling_policy="client")   # the requests' own greedy sampling and lengths
        book = SessionBook(proxy, store, idle_s=600, deadline_s=600, on_no_feedback="drop")
        attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: gate.served_version(p.engine), gate=gate))
        with serving(proxy.app) as url:
            yield url, bb, gate
    finally:
        store.close()
        bb.close()


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(BOUND_S), f"still waiting for {what} after {BOUND_S:g}s"


def _chat(url: str, text: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=BOUND_S,
                      json={"model": "ajet-policy", "temperature": 0, "max_tokens": 8,
                            "messages": [{"role": "user", "content": text}], **kw})


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _greedy(model, tokenizer, cfg, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy ids of `model` for `prompt_ids`, up to `n` tokens, from a fresh in-process engine of its own (no
    switch, nothing shared with the gateway's)."""
    engine = engine_for(model.eval(), tokenizer, cfg)
    try:
        return asyncio.run(engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=n))).token_ids
    finally:
        engine.close()


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _calls(tmp_path) -> list[dict]:
    with sqlite3.connect(tmp_path / "gateway.sqlite") as db:
        return [json.loads(r[0]) for r in db.execute("SELECT record FROM calls")]


def test_a_stream_across_a_switch_finishes_on_the_version_it_started_with(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path)
    with live_gateway(cfg, tmp_path) as (url, bb, gate):
        # the served copy's decode steps: after 3 streamed tokens, wait until the update asks for a switch
        steps, paused, gave_up = [0], threading.Event(), []

        def hold_decoding(module, args, kwargs):
            ids = kwargs.get("input_ids")
            if ids is None or ids.shape[1] != 1:          # a prefill
                return
            steps[0] += 1
            if steps[0] == 3:
                paused.set()
                deadline = time.monotonic() + BOUND_S
                while bb.engine.pending_switches == 0:
                    if time.monotonic() > deadline:
                        gave_up.append("no switch was asked for")
                        return
                    time.sleep(0.005)
        handle = bb.engine.model.register_forward_pre_hook(hold_decoding, with_kwargs=True)

        def stream():
            body = {"model": "ajet-policy", "temperature": 0, "max_tokens": STREAM_TOKENS, "stream": True,
                    "messages": [{"role": "user", "content": "Count the sheep, one by one."}]}
            text = []
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=BOUND_S) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            text.append(c["delta"].get("content") or "")
            return "".join(text)
        streamer, streamed = _in_thread(stream)
        _wait(paused, "the stream's third token")
        updater, updated = _in_thread(gate.update, _samples(1.0), 1)
        streamer.join(BOUND_S)
        updater.join(BOUND_S)
        handle.remove()
        assert not streamer.is_alive() and not updater.is_alive()
        for out in (streamed, updated):
            if "error" in out:
                raise out["error"]
        assert not gave_up, gave_up
        assert bb.engine.policy_version == 1 and updated["value"]["weight_switch_s"] > 0
        after = _chat(url, "Count the sheep, one by one.", max_tokens=STREAM_TOKENS)
        assert after.status_code == 200

    calls = _calls(tmp_path)
    assert len(calls) == 2
    stream_call, after_call = calls
    prompt = stream_call["prompt_ids"]
    assert after_call["prompt_ids"] == prompt
    v0 = _greedy(_load(tiny_model_dir), bb.tokenizer, cfg, prompt, STREAM_TOKENS)
    v1 = _greedy(_load(tmp_path / "exp" / "checkpoints" / "step_1"), bb.tokenizer, cfg, prompt, STREAM_TOKENS)
    assert len(v0) > 3 and v0[3:] != v1[3:len(v0)], "the update did not change the greedy answer: nothing to tell"
    # the stream started on version 0 and finished on it: every token is version 0's greedy choice
    assert stream_call["completion_ids"] == v0, (stream_call["completion_ids"], v0, v1)
    assert streamed["value"] == bb.tokenizer.decode(v0, skip_special_tokens=True)
    assert stream_call["policy_version"] == 0 and not stream_call.get("token_versions")
    # and the next request is answered by version 1 alone
    assert after_call["completion_ids"] == v1 and after_call["policy_version"] == 1


def _answered_while_update_held(url, gate, held, answered, handle, what):
    """Start an update of one sample in a thread, wait until `held` says it is held (in `what`), send one chat
    request, then let the update go on (`answered`) and remove the hook `handle`; returns (response, updated)."""
    updater, updated = _in_thread(gate.update, _samples(1.0), 1)
    _wait(held, what)
    r = _chat(url, "What is 2 plus 2?")
    answered.set()
    updater.join(BOUND_S)
    handle.remove()
    assert r.status_code == 200 and r.headers["x-ajet-policy-version"] == "0", r.text
    assert not updater.is_alive() and "error" not in updated, updated
    return r, updated


def answered_while_update_in_backward(url, gate, param: torch.nn.Parameter):
    """`_answered_while_update_held` with the update held inside its backward pass, at the gradient of `param`
    (a trained parameter); asserts the request was answered while it was held. Returns (response, updated)."""
    in_backward, answered, seen = threading.Event(), threading.Event(), []

    def hold_backward(grad):
        if not in_backward.is_set():
            in_backward.set()
            seen.append(answered.wait(BOUND_S))       # the update stays inside backward until then
        return grad
    handle = param.register_hook(hold_backward)
    out = _answered_while_update_held(url, gate, in_backward, answered, handle, "the update's backward pass")
    assert seen == [True], "the request was answered only after the update left its backward pass"
    return out


def test_requests_are_answered_while_the_update_is_inside_backward(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path)
    with live_gateway(cfg, tmp_path) as (url, bb, gate):
        answered_while_update_in_backward(url, gate, bb.model.get_output_embeddings().weight)
        assert bb.engine.policy_version == 1          # the update was then served


def test_the_gate_evaluates_beside_serving(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"task_id": f"v{i}", "query": q, "answer": "?"}) + "\n"
                                                for i, q in enumerate(["What is 7 plus 9?", "Name a colour."])))
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tiny_model_dir, tmp_path, workflow="wf.py:Exact",
               data={"train_path": "x", "val_path": str(tmp_path / "val.jsonl")},
               gate={"mode": "eval", "metric": "pass@1", "max_drop": 1.0})
    with live_gateway(cfg, tmp_path) as (url, bb, gate):
        evaluating, answered, seen = threading.Event(), threading.Event(), []

        def hold_evaluation(module, args, kwargs):     # the trainer copy decoding: an evaluation's engine
            if torch.is_inference_mode_enabled() and not evaluating.is_set():
                evaluating.set()
                seen.append(answered.wait(BOUND_S))
        handle = bb.model.register_forward_pre_hook(hold_evaluation, with_kwargs=True)
        _, updated = _answered_while_update_held(url, gate, evaluating, answered, handle, "the gate's evaluation")
        assert seen == [True], "the live request waited for the gate's evaluation"
        assert updated["value"]["gate/served"] == 1.0 and bb.engine.policy_version == 1
        assert gate.store.gate_results()[-1]["served"]


def test_lora_serves_a_copy_of_the_adapters_only(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, model={"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    with live_gateway(cfg, tmp_path) as (url, bb, gate):
        served, trained = dict(bb.served_model.named_parameters()), dict(bb.model.named_parameters())
        lora = [n for n in trained if "lora_" in n]
        assert lora and all(served[n] is not trained[n] for n in lora)
        assert all(served[n] is trained[n] for n in trained if "lora_" not in n)   # the base weights are shared
        before = {n: served[n].detach().clone() for n in lora}
        gate.update(_samples(1.0), 1)
        assert bb.engine.policy_version == 1
        assert any(not torch.equal(before[n], served[n]) for n in lora)
        assert all(torch.equal(served[n], trained[n]) for n in lora)
        assert _chat(url, "What is 2 plus 2?").headers["x-ajet-policy-version"] == "1"
