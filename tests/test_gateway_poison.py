"""Updates that cannot be poisoned and a gate that cannot be fooled, with real components: a 1e300 or NaN reward
is a 400 naming `gateway.reward_range` at the gateway's real HTTP front; a reward of 1e30 still gives the
advantages arithmetic says (float64 statistics); a NaN advantage never reaches the tiny model's weights (the
debug backbone skips the step, counts it, says so on stderr) and such an update, or one with a zero gradient, is
never a new version; a candidate whose greedy answers are degenerate is refused at a floor of 0 although its
pass@1 (0) is no drop from the serving policy's (0)."""

from __future__ import annotations

import json
import math
import textwrap

import httpx
import pytest
import torch

from ajet.algorithm.advantage import compute_advantages
from ajet.backbones.debug.backbone import DebugBackbone
from ajet.config import AjetConfig
from ajet.gateway.app import GatewayApp
from ajet.gateway.gate import LiveHold, VersionGate
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.tracker.sample import Sample
from tests.local_servers import serving
from tests.scripted_engine import ScriptedEngine
from tests.test_gateway_gate import WORKFLOW   # one greedy call, reward 1 on an exact answer


def test_rewards_outside_the_range_are_a_400_naming_it(tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, ["The answer is 7."])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=16))
    store = GatewayStore(tmp_path / "gateway.sqlite")
    book = SessionBook(proxy, store, idle_s=60, deadline_s=600, on_no_feedback="drop", reward_range=(-10.0, 10.0))
    attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: 0))
    with serving(proxy.app) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "m", "messages": [{"role": "user", "content": "What is 3 plus 4?"}]})
        sid = r.headers["x-ajet-session"]
        as_json = {"Content-Type": "application/json"}
        for raw in (b"1e300", b"NaN", b"Infinity", b"-11", b"1" + b"0" * 400):
            body = b'{"session_id": "' + sid.encode() + b'", "reward": ' + raw + b"}"
            r = httpx.post(url + "/v1/feedback", content=body, headers=as_json, timeout=30)
            assert r.status_code == 400, (raw, r.text)
            err = r.json()["error"]
            assert err["param"] == "reward" and "gateway.reward_range [-10, 10]" in err["message"], (raw, err)
        assert httpx.post(url + "/v1/feedback", json={"session_id": sid, "reward": 10}, timeout=30).status_code == 200
    stored = [f["reward"] for f in GatewayStore(tmp_path / "gateway.sqlite").sessions()[sid].feedback]
    store.close()
    assert stored == [10.0]                     # nothing out of range was recorded


def test_a_reward_of_1e30_gives_the_advantages_arithmetic_says():
    rewards = torch.tensor([1e30, 0.0, 1.0, 0.0], dtype=torch.float64)
    # grpo, groups of two: (r - mean) / std = +-(1/2) / (1/sqrt 2) = +-1/sqrt 2 (eps negligible at 1e30 and 1)
    grpo = compute_advantages("grpo", rewards, ["a", "a", "b", "b"]).tolist()
    assert grpo == pytest.approx([2 ** -0.5, -2 ** -0.5, 2 ** -0.5, -2 ** -0.5], rel=1e-5)
    # REINFORCE++ over the batch of [x, 0, 0, 0]: mean x/4, unbiased var x^2/4 -> [1.5, -0.5, -0.5, -0.5]
    rpp = compute_advantages("reinforce_plus_plus", torch.tensor([1e30, 0.0, 0.0, 0.0], dtype=torch.float64),
                             ["a", "b", "c", "d"]).tolist()
    assert rpp == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-6)


def _cfg(tiny_model_dir, tmp_path, **gate) -> AjetConfig:
    return AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu"},
                      algorithm={"micro_batch_tokens": 64, "lr": 1e-3}, trainer={"exp_dir": str(tmp_path / "exp")},
                      gateway={"gate": {"mode": "off", **gate}})


def _samples(advantage: float) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    prompt, response = torch.randint(3, 200, (10,), generator=g).tolist(), torch.randint(3, 200, (6,), generator=g).tolist()
    return [Sample(episode_id=f"e{i}", group_id="g", agent_tag="default", call_ids=["c"], prompt_ids=prompt,
                   response_ids=response, loss_mask=[1] * 6, old_logprobs=[-1.0] * 6, policy_versions=[0] * 6,
                   advantage=advantage) for i in range(2)]


def _weights(bb) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in bb.model.parameters()])


def test_a_nan_update_is_not_applied_and_never_a_new_version(tiny_model_dir, tmp_path, capfd):
    cfg = _cfg(tiny_model_dir, tmp_path)
    bb = DebugBackbone(cfg)
    store = GatewayStore(tmp_path / "gateway.sqlite")
    try:
        gate = VersionGate(cfg, store, LiveHold())
        gate.attach(bb)
        before = _weights(bb)
        out = gate.update(_samples(float("nan")), step=1)
        assert out["nonfinite_skipped"] == 1.0 and out["gate/served"] == 0.0
        assert "NON-FINITE" in capfd.readouterr().err
        assert torch.equal(_weights(bb), before)                 # not one weight moved
        assert bb.engine.policy_version == 0 and [v["version"] for v in store.versions()] == [0]
        # a zero gradient (every advantage 0) is not a new version either
        out = gate.update(_samples(0.0), step=2)
        assert bb.engine.policy_version == 0 and torch.equal(_weights(bb), before)
        assert [g["served"] for g in store.gate_results()] == [False, False]
        assert "non-finite" in store.gate_results()[0]["reason"] and "zero" in store.gate_results()[1]["reason"]
        # the optimizer state was not poisoned: a finite update moves the weights, finitely, and is served
        out = gate.update(_samples(1.0), step=3)
        after = _weights(bb)
        assert out["nonfinite_skipped"] == 0.0 and not torch.equal(after, before) and torch.isfinite(after).all()
        assert bb.engine.policy_version == 1 and [v["version"] for v in store.versions()] == [0, 1]
    finally:
        store.close()
        bb.close()


class _Poisoned:
    """The tiny model's backbone whose update ends with every weight NaN (a poisoned policy that got past the
    update's own guard): its greedy answers carry NaN logprobs."""

    def __init__(self, bb):
        self.bb = bb

    def __getattr__(self, name):
        return getattr(self.bb, name)

    def update(self, samples):
        out = self.bb.update(samples)
        with torch.no_grad(), self.bb.engine.weights_lock:
            for p in self.bb.model.parameters():
                p.fill_(float("nan"))
        return out


def test_a_degenerate_candidate_is_refused_at_a_floor_of_0(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"task_id": f"v{i}", "query": q, "answer": "no such"})
                                                + "\n" for i, q in enumerate(["What is 2 plus 2?", "Name a colour."])))
    monkeypatch.chdir(tmp_path)
    cfg = AjetConfig(workflow="wf.py:Exact", data={"train_path": "x", "val_path": str(tmp_path / "val.jsonl")},
                     model={"path": tiny_model_dir, "device": "cpu", "max_model_len": 256},
                     rollout={"max_tokens": 4}, algorithm={"micro_batch_tokens": 64, "lr": 1e-3},
                     trainer={"exp_dir": str(tmp_path / "exp")},
                     gateway={"gate": {"mode": "eval", "metric": "pass@1", "max_drop": 0.05, "min_score": 0.0}})
    bb = DebugBackbone(cfg)
    store = GatewayStore(tmp_path / "gateway.sqlite")
    try:
        gate = VersionGate(cfg, store, LiveHold())
        gate.attach(_Poisoned(bb))
        out = gate.update(_samples(1.0), step=1)
        decision = store.gate_results()[-1]
        # pass@1 0 against 0 (no answer is "no such") is no drop, and 0 is at the floor: only the answers refuse it
        assert decision["serving_figure"] == 0.0 and decision["candidate_figure"] == 0.0, decision
        assert not decision["served"] and "degenerate answers" in decision["reason"], decision
        assert out["gate/served"] == 0.0 and bb.engine.policy_version == 0
        assert all(math.isfinite(x) for x in _weights(bb).tolist()[:1000])   # the serving weights are back
    finally:
        store.close()
        bb.close()
