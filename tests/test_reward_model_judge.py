"""The reward-model judge (`ajet.judges.reward_model:RewardModelJudge`) choosing the gateway's best-of-N answer.

A stand-in reward model is served by uvicorn on 127.0.0.1 and answers `POST /pooling` in vLLM's pooling response
shape; it scores an answer by whether it says 12, per token (`[[r_1], ..., [r_T]]`, the last token's row the
sequence's score) or as one number, and records every body it gets. The gateway app over a scripted engine
(tests/test_gateway_best_of.py's replies) must answer the candidate the reward model scores highest, and the
reward model must have seen the request's messages followed by each candidate's answer."""

from __future__ import annotations

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ajet.config import AjetConfig
from ajet.errors import ConfigError
from ajet.gateway.app import GatewayApp
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.judges.reward_model import RewardModelJudge, score_of
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.workflow import WorkflowOutput
from tests.local_servers import serving
from tests.scripted_engine import ScriptedEngine

REPLIES = ["The answer is 7.", "It is 12.", "Hello!"]


def reward_model(seen: list, per_token: bool = True, status: int = 200):
    async def pooling(request: Request):
        body = await request.json()
        seen.append({**body, "authorization": request.headers.get("authorization")})
        if status != 200:
            return JSONResponse({"error": "overloaded"}, status_code=status)
        score = 2.5 if "12" in (body["messages"][-1].get("content") or "") else -1.0
        data = [[0.0], [0.1], [score]] if per_token else [score]
        return JSONResponse({"id": "pool-1", "object": "list", "data": [{"index": 0, "object": "pooling", "data": data}]})
    return Starlette(routes=[Route("/pooling", pooling, methods=["POST"])])


def _cfg(url: str | None) -> AjetConfig:
    return AjetConfig.model_validate({"model": {"path": "m"}, "data": {"train_path": "t.jsonl"},
                                      "reward_model": {"base_url": url, "model": "rm", "api_key": "rm-key"}})


@pytest.mark.parametrize("per_token", [True, False])
def test_best_of_n_answers_the_reward_models_pick(tokenizer, tmp_path, per_token):
    seen: list = []
    with serving(reward_model(seen, per_token)) as rm_url:
        judge = RewardModelJudge(_cfg(rm_url + "/"))
        engine = ScriptedEngine(tokenizer, REPLIES)
        proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=32), seed=7)
        store = GatewayStore(tmp_path / "gateway.sqlite")
        book = SessionBook(proxy, store, idle_s=60, deadline_s=600, on_no_feedback="drop", judge=judge, n=3)
        attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: 0))
        try:
            with serving(proxy.app) as url:
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 times 4?"}]
                raw = client.chat.completions.with_raw_response.create(model="ajet-policy", messages=messages)
                answer, sid = raw.parse(), raw.headers["x-ajet-session"]
                state = book.get(sid)
        finally:
            store.close()
            judge.close()
    assert answer.choices[0].message.content == "It is 12."                 # the reward model's pick
    assert state["picks"][answer.id] == {"chosen": 1, "scores": [-1.0, 2.5, -1.0]}
    # the reward model saw the request's messages, then each candidate as the assistant's turn, with its key
    assert sorted(s["messages"][-1]["content"] for s in seen) == sorted(REPLIES)
    assert all(s["messages"][:-1] == messages and s["messages"][-1]["role"] == "assistant" for s in seen)
    assert {(s["model"], s["authorization"]) for s in seen} == {("rm", "Bearer rm-key")}


def test_a_failing_reward_model_scores_nothing_and_bad_answers_raise(tmp_path):
    seen: list = []
    task, output = Task("t", "What is 3 times 4?"), WorkflowOutput(final_answer="It is 12.")
    with serving(reward_model(seen, status=503)) as rm_url:
        judge = RewardModelJudge(_cfg(rm_url))
        with pytest.raises(RuntimeError, match="answered 503"):
            judge(task, output)
        judge.close()
    assert seen[0]["messages"] == [{"role": "user", "content": "What is 3 times 4?"},
                                   {"role": "assistant", "content": "It is 12."}]
    with pytest.raises(ConfigError, match="reward_model.base_url"):
        RewardModelJudge(_cfg(None))
    assert score_of({"data": [{"data": 0.5}]}) == 0.5
    for bad in ({"data": []}, {"data": [{"data": [0.2, 0.8]}]}, {"data": [{"data": [[0.1], [0.2, 0.3]]}]},
                {"data": [{"data": "high"}]}, {"data": [{"data": [float("nan")]}]}, {"data": [{"data": True}]}):
        with pytest.raises(ValueError):
            score_of(bad)
