"""A lone request through the debug engine costs one forward pass per token and nothing else: the worker never
sleeps, and never blocks on its queue (waiting for company) while the request's row is in flight. The real tiny
model in the real engine; counts, not times (a per-step poll or sleep, or a batching window held open while a row
decodes, would slow one user of the gateway at every token without changing what is sampled)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams

TOKENS = 24           # the lone request's max_tokens (no end-of-turn id: only max_tokens ends it)
WORKER = "ajet-engine"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, tok


def test_a_lone_request_takes_one_forward_per_token_and_the_worker_never_waits_while_it_decodes(tiny, monkeypatch):
    model, tok = tiny
    events: list[tuple] = []            # what the worker thread did, in order
    engine_box: list[HFEngine] = []

    def rows_now() -> int:
        return len(engine_box[0]._rows) if engine_box else 0

    class RecordingQueue(queue.Queue):
        def get(self, block=True, timeout=None):
            if threading.current_thread().name == WORKER:
                events.append(("get", block, timeout, rows_now()))
            return super().get(block, timeout)

    real_sleep = time.sleep

    def recording_sleep(seconds):
        if threading.current_thread().name == WORKER:
            events.append(("sleep", seconds, rows_now()))
        real_sleep(seconds)

    forwards = []
    handle = model.register_forward_hook(lambda *_: forwards.append(1))
    monkeypatch.setattr(queue, "Queue", RecordingQueue)      # the engine's queue is made in its constructor
    monkeypatch.setattr(time, "sleep", recording_sleep)
    engine = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=8,
                      max_model_len=512, prefix_cache_bytes=0)
    engine_box.append(engine)
    try:
        assert isinstance(engine._queue, RecordingQueue)
        prompt = tok.encode("a lone user asks one question", add_special_tokens=False)
        completion = asyncio.run(engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=TOKENS, seed=3)))
    finally:
        engine.close()
        handle.remove()

    assert len(completion.token_ids) == TOKENS and completion.finish_reason == "length"
    # one prefill, then one decode step per further token: no extra or repeated forward passes
    assert len(forwards) == TOKENS
    assert [e for e in events if e[0] == "sleep"] == []
    # while the row decodes the worker only looks at its queue (never blocks on it, never waits with a timeout)
    busy = [e for e in events if e[0] == "get" and e[3] > 0]
    assert busy, "the worker never looked at its queue between two decode steps"
    assert all(block is False for _, block, _, _ in busy), busy
