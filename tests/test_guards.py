"""The update's guards (ajet/algorithm/guards.py): out-of-vocabulary sampled ids, NaN/inf engine logprobs,
samples without a loss token and stale policies are left out (or counted) by name, never trained silently."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from ajet.algorithm.guards import (NON_FINITE_LOGPROB, OUT_OF_VOCAB, STALE_POLICY, empty_loss_samples, policy_lag,
                                   sampled_token_reason, stale_policy_reason)
from ajet.config import AjetConfig
from ajet.episode import Episode
from ajet.llm_call import LLMCall, SamplingParams
from ajet.rollout import Rollout, RunMode
from ajet.task import Task
from ajet.trainer import run
from ajet.tracker import merge_calls
from ajet.trajectory_store import TrajectoryStore


def _call(completion, logprobs=None, version=0, temperature=1.0, episode="ep"):
    return LLMCall(call_id=f"{episode}-c", episode_id=episode, agent_tag="default", index=0, messages=[], tools=None,
                   prompt_ids=[5, 6, 7], completion_ids=completion,
                   completion_logprobs=logprobs if logprobs is not None else [-0.5] * len(completion),
                   finish_reason="stop", response_message={"role": "assistant", "content": ""},
                   sampling=SamplingParams(temperature=temperature), policy_version=version)


def test_sampled_token_reason_names_the_first_failure():
    assert sampled_token_reason([_call([10, 11])], vocab_size=100) is None
    assert sampled_token_reason([_call([10, 100])], vocab_size=100) == OUT_OF_VOCAB      # ids are 0..99
    assert sampled_token_reason([_call([10, -1])], vocab_size=100) == OUT_OF_VOCAB
    for bad in (math.nan, math.inf, -math.inf):
        assert sampled_token_reason([_call([10, 11], [-0.1, bad])], vocab_size=100) == NON_FINITE_LOGPROB


def test_staleness_is_the_lag_of_the_oldest_call():
    calls = [_call([1], version=3), _call([1], version=5)]
    assert policy_lag(calls, 5) == 2 and policy_lag([], 5) == 0
    assert stale_policy_reason(calls, 5, max_staleness=2) is None
    assert stale_policy_reason(calls, 5, max_staleness=1) == STALE_POLICY
    assert stale_policy_reason(calls, 5, max_staleness=None) is None


def test_empty_loss_samples_counts_samples_without_a_loss_token():
    (greedy,) = merge_calls([_call([10, 11], temperature=0.0)], "g")    # greedy, not trained: all masked
    (sampled,) = merge_calls([_call([10, 11])], "g")
    assert empty_loss_samples([greedy, sampled]) == 1


class _Source:
    """Hand-made episodes of one step: a good group, one episode with an id outside the vocabulary, one
    with a NaN engine logprob, one whose only call was greedy (a sample with no loss token)."""

    def __init__(self, ctx, vocab_size):
        self.ctx, self.vocab_size = ctx, vocab_size

    def collect(self, step):
        specs = [("good0", [20, 21], None, 1.0, 1.0), ("good1", [22, 23], None, 0.0, 1.0),
                 ("oov", [24, self.vocab_size + 3], None, 1.0, 1.0), ("nan", [25, 26], [-0.3, math.nan], 0.0, 1.0),
                 ("greedy", [27, 28], None, 0.5, 0.0)]
        out = []
        for i, (name, ids, lps, reward, temperature) in enumerate(specs):
            ep = Episode(episode_id=name, task=Task(task_id="t", query="q"), group_id=f"{step}:t", repeat_index=i,
                         calls=[_call(ids, lps, temperature=temperature, episode=name)], reward=reward)
            self.ctx.record(step, ep)
            out.append(ep)
        return out

    def bind(self, proxy): pass
    def step_done(self, step): pass
    def state_dict(self, step): return {}
    def load_state_dict(self, state): pass
    def metrics(self): return {}
    def close(self): pass


def test_the_trainer_leaves_out_guarded_episodes_by_name_and_still_updates(tiny_model_dir, tokenizer, tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "q"}\n')
    cfg = AjetConfig(workflow="x:y", data={"train_path": str(tmp_path / "tasks.jsonl")}, model={"path": tiny_model_dir, "max_model_len": 128},
                     rollout={"num_repeat": 5}, algorithm={"lr": 1e-2},
                     trainer={"total_steps": 1, "tasks_per_step": 1, "tensorboard": False,
                              "exp_dir": str(tmp_path / "exp")})
    exp = run(cfg, RunMode(lambda ctx: Rollout(_Source(ctx, len(tokenizer)))))
    (m,) = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert m["guards/out_of_vocab_token_episodes"] == 1 and m["guards/non_finite_logprob_episodes"] == 1
    assert m["guards/empty_loss_samples"] == 1 and m["guards/stale_policy_episodes"] == 0
    assert m["rollout/trained_episodes"] == 3 and m["policy_version"] == 1
    store = TrajectoryStore(exp / "trajectories.sqlite")
    fates = {e["episode_id"]: (bool(e["trained_in"]), e["not_trained"]) for e in store.ledger()}
    store.close()
    assert fates == {"good0": (True, None), "good1": (True, None), "greedy": (True, None),
                     "oov": (False, OUT_OF_VOCAB), "nan": (False, NON_FINITE_LOGPROB)}
    weights = load_file(str(next((exp / "checkpoints").glob("step_*")) / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())   # a NaN logprob never reached the loss


class _StaleSource(_Source):
    """Three steps of one group of three episodes: two served by the weights of the step (version step - 1)
    and, at step 3, "old" served by version 0: two updates behind, over `max_staleness: 1`."""

    def collect(self, step):
        out = []
        for i, (name, reward) in enumerate((("fresh0", 1.0), ("fresh1", 0.0), ("old", 0.5))):
            version = 0 if name == "old" else step - 1
            ep = Episode(episode_id=f"{name}@{step}", task=Task(task_id="t", query="q"), group_id=f"{step}:t",
                         repeat_index=i, reward=reward,
                         calls=[_call([20 + i, 30 + i], version=version, episode=f"{name}@{step}")])
            self.ctx.record(step, ep)
            out.append(ep)
        return out


@pytest.mark.parametrize("policy", ["drop", "flag"])
def test_stale_policy_drop_leaves_the_stale_sample_out_and_flag_trains_it(tiny_model_dir, tokenizer, tmp_path, policy):
    """`algorithm.guards.stale_policy`, the same step 3 either way (its episode "old" was served by version 0, the
    update starts from version 2, max_staleness 1): both count the episode in guards/stale_policy_episodes and
    keep its reward in the group's baseline; "drop" trains the two fresh samples only (async/stale_samples 1),
    "flag" trains all three (importance-corrected), so the step's staleness reaches 2."""
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "q"}\n')
    cfg = AjetConfig(workflow="x:y", data={"train_path": str(tmp_path / "tasks.jsonl")},
                     model={"path": tiny_model_dir, "max_model_len": 128}, rollout={"num_repeat": 3},
                     algorithm={"lr": 1e-2, "guards": {"stale_policy": policy}},
                     trainer={"total_steps": 3, "tasks_per_step": 1, "tensorboard": False,
                              "exp_dir": str(tmp_path / "exp"), "async": {"max_staleness": 1}})
    exp = run(cfg, RunMode(lambda ctx: Rollout(_StaleSource(ctx, len(tokenizer)))))
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
    assert [m["guards/stale_policy_episodes"] for m in metrics] == [0, 0, 1]
    m = metrics[2]
    assert m["rollout/trained_episodes"] == 3 and "rollout/not_trained/stale_policy" not in m
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        trained = {name: [json.loads(r[0])["trained"] for r in store._db.execute(
            "SELECT record FROM samples WHERE episode_id = ?", (f"{name}@3",))] for name in ("fresh0", "fresh1", "old")}
    finally:
        store.close()
    if policy == "drop":
        assert m["async/stale_samples"] == 1 and m["tracker/trained_samples"] == 2 and m["async/staleness_max"] == 0
        assert trained == {"fresh0": [True], "fresh1": [True], "old": [False]}
    else:
        assert m["async/stale_samples"] == 0 and m["tracker/trained_samples"] == 3 and m["async/staleness_max"] == 2
        assert trained == {"fresh0": [True], "fresh1": [True], "old": [True]}
        assert "train/is_weight_mean" in m
