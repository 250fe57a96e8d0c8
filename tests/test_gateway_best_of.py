"""`ajet gateway` best-of-N (`gateway.n`): each request sampled N times in one batch, the judge's pick answered
(streams too), every candidate recorded, and a session with its unchosen candidates trained as one GRPO group.

The gateway app is served by uvicorn on 127.0.0.1 over a scripted engine whose replies are known, and the judge
prefers one of them, so the answer it must pick is known before the request is sent."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from ajet.gateway.app import GatewayApp
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import GatewaySource, attach
from ajet.gateway.store import GatewayStore
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.local_servers import serving
from tests.scripted_engine import ScriptedEngine

REPLIES = ["The answer is 7.", "It is 12.", "Hello!"]   # candidate i of a request gets REPLIES[i] (in order)


def prefers_twelve(task, output) -> float:
    """The judge: 1 for an answer saying 12, else 0 (so of REPLIES it must pick "It is 12.", candidate 1)."""
    return 1.0 if "12" in output.final_answer else 0.0


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def best_of(tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, REPLIES)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=32), seed=7)
    store = GatewayStore(tmp_path / "gateway.sqlite")
    clock = Clock()
    book = SessionBook(proxy, store, idle_s=60, deadline_s=600, on_no_feedback="drop", judge=prefers_twelve,
                       clock=clock, n=3)
    attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: engine.policy_version))
    with serving(proxy.app) as url:
        yield url, book, engine, tmp_path
    store.close()


def test_one_request_is_n_candidates_the_judge_picks_and_one_group(best_of):
    url, book, engine, tmp_path = best_of
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    turn1 = [{"role": "user", "content": "What is 3 times 4?"}]
    raw = client.chat.completions.with_raw_response.create(model="ajet-policy", messages=turn1)
    r1, sid = raw.parse(), raw.headers["x-ajet-session"]
    assert [c.message.content for c in r1.choices] == ["It is 12."]          # the judge's pick, as choice 0
    assert len(engine.prompts) == 3 and engine.prompts[0] == engine.prompts[1] == engine.prompts[2]
    state = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert state["picks"] == {r1.id: {"chosen": 1, "scores": [0.0, 1.0, 0.0]}}
    assert [(c["text"], c["score"], c["index"]) for c in state["candidates"]] == \
        [("The answer is 7.", 0.0, 0), ("Hello!", 0.0, 2)]
    # the chosen candidate continues the conversation: the next turn (no header) joins the session and its
    # prompt extends the chosen call's prompt + completion
    turn2 = turn1 + [{"role": "assistant", "content": "It is 12."}, {"role": "user", "content": "Sure?"}]
    raw2 = client.chat.completions.with_raw_response.create(model="ajet-policy", messages=turn2)
    assert raw2.headers["x-ajet-session"] == sid and raw2.parse().choices[0].message.content == "It is 12."
    # a stream gets the pick too, once all candidates are sampled
    with client.chat.completions.with_streaming_response.create(
            model="ajet-policy", messages=[{"role": "user", "content": "Stream it."}], stream=True) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == "It is 12."
    assert {c["index"] for e in events for c in e["choices"]} == {0}
    # a client asking for several choices is told to ask for one
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": turn1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text

    assert httpx.post(f"{url}/v1/feedback", json={"session_id": sid, "reward": 0.5}).status_code == 200
    book.close(sid)
    s = book._sessions[sid]
    first, second = s.calls                              # only the chosen calls are the session's
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids
    assert len(s.candidates) == 4                        # two per request

    before = book.get(sid)
    cand_ids = [c.call.completion_ids for c in s.candidates]
    # the trainer's view: one group = the session + its 4 candidates, rewards = feedback, judge scores
    recorded = []
    cfg = SimpleNamespace(rollout=SimpleNamespace(num_repeat=4), trainer=SimpleNamespace(tasks_per_step=1, resume=False))
    ctx = SimpleNamespace(cfg=cfg, attempt=0, record=lambda step, ep: recorded.append(ep.episode_id), console=None)
    source = GatewaySource(ctx, None, None)
    source.book = book
    episodes = source.collect(1)
    assert [e.episode_id for e in episodes] == [sid] + [f"{sid}~{k}" for k in (1, 2, 3, 4)] == recorded
    assert len({e.group_id for e in episodes}) == 1
    assert [e.reward for e in episodes] == [0.5, 0.0, 0.0, 0.0, 0.0]
    assert [len(e.calls) for e in episodes] == [2, 1, 1, 1, 1]
    cand = episodes[1].calls[0]
    assert (cand.episode_id, cand.index, cand.prompt_ids) == (f"{sid}~1", 0, first.prompt_ids)
    assert episodes[1].calls[0].response_message["content"] == "The answer is 7."

    # durable: a restarted book has the same candidates and picks
    stored = GatewayStore(tmp_path / "gateway.sqlite")
    again = SessionBook(None, stored, 60, 600, "drop", judge=prefers_twelve, n=3)
    again.load(stored.sessions(), set())
    assert again.get(sid)["candidates"] == before["candidates"]
    assert again.get(sid)["picks"] == before["picks"] and len(before["picks"]) == 2
    assert [c.call.completion_ids for c in again._sessions[sid].candidates] == cand_ids
    assert book.get(sid)["candidates"] == [] and book._sessions[sid].calls == []   # trained: released from memory
    stored.close()


def test_a_failed_judge_call_is_never_picked_nor_trained(tokenizer, tmp_path):
    def judge(task, output):
        if "7" in output.final_answer:
            raise RuntimeError("judge down")
        return 0.0                              # the others tie: the first of them (candidate 1) is answered

    engine = ScriptedEngine(tokenizer, REPLIES)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=32))
    store = GatewayStore(tmp_path / "gateway.sqlite")
    book = SessionBook(proxy, store, 60, 600, "drop", judge=judge, n=3)
    attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: 0))
    with serving(proxy.app) as url:
        r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content == "It is 12."
        sid = next(iter(book._sessions))
        assert [c["score"] for c in book.get(sid)["candidates"]] == [None, 0.0]
    store.close()
