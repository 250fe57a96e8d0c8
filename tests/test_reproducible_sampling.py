"""Item 6 of issue 21: the same config and seed give the same sampled tokens, rewards and update however
the engine batches requests and however episodes interleave (each call's sampler is seeded from the run
seed, the episode and the call's index in it: `ajet.llm_call.call_seed`)."""

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ajet.config import load_config
from ajet.llm_call import call_seed
from ajet.trainer import run

WORKFLOW = '''
import asyncio, os

from ajet.workflow import Workflow, WorkflowOutput


class Jittered(Workflow):
    """Two calls around a tool result; with JITTER set, each episode sleeps a random time (from the OS, not
    the seeded generators) before each call, so requests reach the engine in a different order every run."""

    async def execute(self, task, tuner):
        async def nap():
            if os.environ.get("JITTER"):
                await asyncio.sleep(os.urandom(1)[0] / 255 * 0.05)
        messages = [{"role": "user", "content": task.query}]
        await nap()
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "and again?"})
        await nap()
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text)
'''

# figures that measure time, not what was sampled or learned
TIMING = ("time/", "rollout/tokens_per_s", "train/update_s")


def _train(root: Path, model_dir: str, name: str, max_batch_size: int, max_concurrency: int, jitter: bool):
    root.mkdir(parents=True, exist_ok=True)
    (root / "wf.py").write_text(WORKFLOW)
    (root / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"say {i}"}) + "\n"
                                             for i in range(6)))
    (root / f"{name}.yaml").write_text(textwrap.dedent(f"""
        experiment_name: {name}
        workflow: wf.py:Jittered
        model: {{path: "{model_dir}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 3, max_tokens: 10, temperature: 1.0, max_batch_size: {max_batch_size},
                   max_concurrency: {max_concurrency}}}
        algorithm: {{lr: 1.0e-2}}
        trainer: {{total_steps: 2, tasks_per_step: 3, seed: 7, tensorboard: false, loggers: [jsonl],
                   exp_dir: "{root / name}"}}
    """))
    old = os.environ.pop("JITTER", None)
    if jitter:
        os.environ["JITTER"] = "1"
    try:
        exp = run(load_config(root / f"{name}.yaml"))
    finally:
        os.environ.pop("JITTER", None)
        if old is not None:
            os.environ["JITTER"] = old
    episodes = {}
    for line in (exp / "trajectories.jsonl").read_text().splitlines():
        e = json.loads(line)
        episodes[e["episode_id"]] = (e["reward"], [c["completion_ids"] for c in e["calls"]],
                                     [c["completion_logprobs"] for c in e["calls"]])
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
               for line in (exp / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(next((exp / "checkpoints").glob("*/model.safetensors")))
    return episodes, metrics, weights


def test_same_seed_same_tokens_rewards_and_update_whatever_the_batching(tiny_model_dir, tmp_path):
    """One row at a time and one episode at a time, vs 16 rows and every episode at once with random delays:
    the same sampled ids (exactly), rewards (exactly), metrics and final weights (to float tolerance: batching
    changes the order of float sums in the forward passes, so engine logprobs, hence the PPO ratios and the
    update, differ in the last bits; they never change which token a row's own generator draws here). The
    weight tolerance is 1% of one AdamW step (lr 1e-2): Adam divides by sqrt(v), so a gradient entry near 0
    turns a last-bit difference into a visible fraction of its step.)"""
    a_eps, a_metrics, a_weights = _train(tmp_path, tiny_model_dir, "serial", 1, 1, jitter=False)
    b_eps, b_metrics, b_weights = _train(tmp_path, tiny_model_dir, "batched", 16, 9, jitter=True)

    assert len(a_eps) == 18 and a_eps.keys() == b_eps.keys()
    for eid in a_eps:
        (ra, ids_a, lp_a), (rb, ids_b, lp_b) = a_eps[eid], b_eps[eid]
        assert ids_a == ids_b, eid
        assert ra == rb, eid
        for x, y in zip(lp_a, lp_b):
            assert x == pytest.approx(y, abs=1e-4), eid
    # the sampled text differs between episodes: the seeds are per call, not one seed for all
    assert len({json.dumps(ids) for _, ids, _ in a_eps.values()}) > 10
    assert len(a_metrics) == len(b_metrics) == 2
    for ma, mb in zip(a_metrics, b_metrics):
        assert ma.keys() == mb.keys()
        for k in ma:
            if isinstance(ma[k], float):
                assert ma[k] == pytest.approx(mb[k], rel=1e-3, abs=1e-5), k
            else:
                assert ma[k] == mb[k], k
    assert a_weights.keys() == b_weights.keys()
    initial = load_file(next(Path(tiny_model_dir).glob("*.safetensors")))
    assert any(not torch.equal(a_weights[n], initial[n]) for n in a_weights)      # the update moved them
    for name in a_weights:
        torch.testing.assert_close(a_weights[name], b_weights[name], rtol=0, atol=1e-4)
    assert a_metrics[-1]["policy_version"] == 2


def test_call_seed_depends_on_run_episode_and_call():
    seeds = {call_seed(s, e, i) for s in (0, 1) for e in ("1:t0/r0", "1:t0/r1", "2:t0/r0") for i in (0, 1, 2)}
    assert len(seeds) == 18                                      # every input changes the seed
    assert call_seed(0, "1:t0/r0", 0) == call_seed(0, "1:t0/r0", 0)
    assert all(0 <= s < 2**63 for s in seeds)
