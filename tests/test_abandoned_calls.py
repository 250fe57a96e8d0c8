"""A call nobody waits for any more frees its row of the debug engine: its caller cancelled it (an episode closed
at its timeout, a proxy stopping), so the row leaves the batch at the next step instead of decoding to its
`max_tokens`, and the call queued behind it is served. The real tiny model in the real engine (one row, so that a
row kept by a cancelled call would hold up every other call; no end-of-turn id, so that only `max_tokens` ends a
row), directly and behind the real proxy on 127.0.0.1 with a real streaming client.

Token counts, not times: a cancelled call whose row kept decoding would add about `LONG` tokens to the engine's
count before the queued call is answered; a freed row adds at most the few steps that ran while the cancellation
travelled (`SLACK` allows seconds of a loaded machine, each step being slowed to at least `STEP_S`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer

LONG = 1800        # tokens the abandoned call asks for (max_model_len 2048)
SHORT = 5          # tokens of the call queued behind it
STEP_S = 0.005     # every forward pass takes at least this much longer: the long call runs >= 9 s in full
SLACK = 400        # tokens the cancelled row may still produce while its cancellation arrives (2 s of steps)


@pytest.fixture(scope="module")
def slow_model(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.register_forward_hook(lambda *_: time.sleep(STEP_S))
    return model, tok


@pytest.fixture
def engine(slow_model):
    model, tok = slow_model
    eng = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=1, max_model_len=2048,
                   prefix_cache_bytes=0)
    try:
        yield eng
    finally:
        eng.close()


def _prompt(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


async def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_cancelled_call_frees_its_row_and_the_queued_call_is_served(engine, slow_model):
    _, tok = slow_model
    seen: list[int] = []        # the long call's tokens as the engine streams them

    async def scenario():
        long = asyncio.ensure_future(engine.generate(_prompt(tok, "a long answer"),
                                                     SamplingParams(temperature=1.0, max_tokens=LONG, seed=1),
                                                     lambda d: seen.extend(d.token_ids)))
        await _until(lambda: len(seen) >= 3, "the long call's first tokens")
        assert engine.active_rows == 1
        queued = asyncio.ensure_future(engine.generate(_prompt(tok, "a short one"),
                                                       SamplingParams(temperature=1.0, max_tokens=SHORT, seed=2)))
        await asyncio.sleep(0)                          # queued behind the long call's row
        before = engine.generated_tokens
        long.cancel()
        short = await asyncio.wait_for(queued, 120)
        await _until(lambda: engine.active_rows == 0, "the batch to empty")
        with pytest.raises(asyncio.CancelledError):
            await long
        return before, short

    before, short = asyncio.run(scenario())
    assert len(short.token_ids) == SHORT and short.finish_reason == "length"
    # the cancelled row stopped: what the engine sampled since is the queued call's and a few more steps at most
    assert engine.generated_tokens - before <= SHORT + SLACK, (engine.generated_tokens, before)
    assert len(seen) <= before + SLACK < LONG
    # and the engine still serves
    again = asyncio.run(asyncio.wait_for(engine.generate(_prompt(tok, "again"), SamplingParams(max_tokens=3, seed=3)),
                                         120))
    assert len(again.token_ids) == 3


def test_closing_an_episode_mid_stream_frees_the_row_for_another_episodes_call(engine, slow_model):
    """What an evaluation does at an episode's timeout: close the episode while its agent's streamed call still
    generates. The call queued behind it (another episode's) is answered, and the closed call's client gets the
    `episode_closed` error event."""
    _, tok = slow_model
    proxy = ProxyServer(engine, tok, SamplingParams(temperature=1.0, max_tokens=LONG), max_model_len=2048,
                        seed=0).start()
    try:
        slow_ep, other_ep = proxy.open_episode("slow"), proxy.open_episode("other")
        events: list[str] = []
        first_token = threading.Event()

        def stream_long():
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "a long answer"}]}
            with httpx.stream("POST", slow_ep.base_url + "/chat/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if '"content"' in line and '"content":""' not in line:
                            first_token.set()

        streamer = threading.Thread(target=stream_long, daemon=True)
        streamer.start()
        assert first_token.wait(120), events[:3]
        answer: list[httpx.Response] = []
        other = threading.Thread(target=lambda: answer.append(httpx.post(
            other_ep.base_url + "/chat/completions", timeout=300,
            json={"model": "m", "max_tokens": SHORT, "messages": [{"role": "user", "content": "short"}]})), daemon=True)
        other.start()
        deadline = time.monotonic() + 120
        while other_ep.engine_wait.queued_calls == 0:   # queued behind the long call's row
            assert time.monotonic() < deadline and not answer, answer
            time.sleep(0.01)
        before = engine.generated_tokens
        assert proxy.close_episode(slow_ep) == []       # nothing recorded for the closed call
        other.join(120)
        streamer.join(120)
        assert answer and answer[0].status_code == 200, answer[0].text[:300] if answer else "no answer"
        assert answer[0].json()["usage"]["completion_tokens"] == SHORT
        assert engine.generated_tokens - before <= SHORT + SLACK, (engine.generated_tokens, before)
        assert json.loads(events[-1])["error"]["code"] == "episode_closed", events[-3:]
        assert len(proxy.close_episode(other_ep)) == 1
    finally:
        proxy.stop()
