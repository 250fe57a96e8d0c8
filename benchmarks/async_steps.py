"""Asynchronous training with bounded staleness: steps per minute and held-out accuracy for
`trainer.async.max_staleness` K = 0, 1, 2 on a workflow whose episodes have long-tail durations.

The workflow (the same for every K, same seed): the policy answers an addition, a "tool" sleeps (most tasks
`--fast-s`, one in `--slow-every` sleeps `--slow-s`: the long tail), the policy answers again; reward 1 when the
second answer holds the sum, 0.2 when it holds some digit, else 0. Synchronously (K = 0) every step waits for its
slowest episode and the update waits for the step; with K >= 1 the next steps' episodes run during the update
and during a slow episode's sleep.

Figures per K: steps/min over the training steps (the sum of `time/step_s`: rollout wait + update, without the
model load and the held-out evaluations), held-out `val/pass@1` and `val/reward_mean` (greedy, at step 0 and at
the last step), the most stale trained sample and the samples dropped as too stale; then each K's steps/min
as a ratio to K = 0.

    python benchmarks/async_steps.py                    # tiny random model, a few minutes on 2 CPU cores
    python benchmarks/async_steps.py --model smollm2    # the real SmolLM2-135M-Instruct (slower)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests.tiny_model

WORKFLOW = '''
import asyncio, re

from ajet.workflow import Workflow, WorkflowOutput


class SlowTool(Workflow):
    async def execute(self, task, tuner):
        messages = [{"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        await asyncio.sleep(task.metadata["delay_s"])                 # the tool: long-tail durations
        messages.append({"role": "user", "content": "The calculator is done. Reply with the number only."})
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        text = r.choices[0].message.content or ""
        reward = 1.0 if task.answer in re.findall(r"\\d+", text) else 0.2 if re.search(r"\\d", text) else 0.0
        return WorkflowOutput(reward=reward, final_answer=text)
'''


def write_tasks(path: Path, n: int, first: int, slow_every: int, slow_s: float, fast_s: float) -> None:
    rows = []
    for i in range(first, first + n):
        a, b = i % 7 + 1, (3 * i) % 9 + 1
        rows.append({"task_id": f"add{i}", "query": f"What is {a} plus {b}?", "answer": str(a + b),
                     "delay_s": slow_s if i % slow_every == 0 else fast_s})   # other fields: task.metadata
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train(root: Path, model: str, k: int, args) -> dict[str, float]:
    from ajet.config import load_config
    from ajet.trainer import run

    name = f"k{k}"
    (root / f"{name}.yaml").write_text(textwrap.dedent(f"""
        experiment_name: {name}
        workflow: wf.py:SlowTool
        model: {{path: "{model}", max_model_len: 1024}}
        data: {{train_path: train.jsonl, val_path: val.jsonl}}
        rollout: {{num_repeat: {args.num_repeat}, max_tokens: {args.max_tokens}, temperature: 1.0}}
        algorithm: {{lr: {args.lr}}}
        eval: {{temperature: 0.0, pass_threshold: 1.0}}
        trainer: {{total_steps: {args.steps}, tasks_per_step: {args.tasks_per_step}, seed: {args.seed},
                   val_freq: {args.steps}, tensorboard: false, loggers: [jsonl], exp_dir: "{root / name}",
                   async: {{max_staleness: {k}}}}}
    """))
    exp = run(load_config(root / f"{name}.yaml"))
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    val0 = next(r for r in rows if r["step"] == 0)
    train_s = sum(r["time/step_s"] for r in steps)
    return {"K": k, "steps_per_min": 60 * len(steps) / train_s, "train_s": train_s,
            "val_pass@1_0": val0["val/pass@1"], "val_pass@1": steps[-1]["val/pass@1"],
            "val_reward_0": val0["val/reward_mean"], "val_reward": steps[-1]["val/reward_mean"],
            "reward_mean": statistics.fmean(r["reward/mean"] for r in steps),
            "staleness_max": max(r["async/staleness_max"] for r in steps),
            "stale_dropped": sum(r["async/stale_samples"] for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (a random 2-layer Llama, built here) or smollm2")
    ap.add_argument("--ks", default="0,1,2", help="max_staleness values, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tasks-per-step", type=int, default=4)
    ap.add_argument("--num-repeat", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="default 1e-3 (tiny), 2e-6 (smollm2)")
    ap.add_argument("--slow-every", type=int, default=4, help="one task in this many has the slow tool")
    ap.add_argument("--slow-s", type=float, default=3.0, help="the slow tool's sleep, seconds")
    ap.add_argument("--fast-s", type=float, default=0.1, help="the other tools' sleep, seconds")
    ap.add_argument("--val-tasks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.lr is None:
        args.lr = 1e-3 if args.model == "tiny" else 2e-6
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        if args.model == "tiny":
            from tests.tiny_model import build_tiny_model

            model = build_tiny_model(str(root / "tiny_model"))
        else:
            model = "smollm2-135m-instruct" if args.model == "smollm2" else args.model
        (root / "wf.py").write_text(WORKFLOW)
        write_tasks(root / "train.jsonl", args.steps * args.tasks_per_step, 0, args.slow_every, args.slow_s, args.fast_s)
        write_tasks(root / "val.jsonl", args.val_tasks, 1000, args.slow_every, 0.0, 0.0)
        results = [train(root, model, int(k), args) for k in args.ks.split(",")]
    base = results[0]
    print(f"\nasync_steps: model={args.model} steps={args.steps} tasks_per_step={args.tasks_per_step} "
          f"num_repeat={args.num_repeat} slow tool {args.slow_s}s in 1 of {args.slow_every} tasks, seed {args.seed}")
    print(f"{'K':>2} {'steps/min':>10} {'x K=' + str(base['K']):>8} {'train s':>8} {'val pass@1 0 -> end':>20} "
          f"{'val reward 0 -> end':>20} {'stale max':>9} {'dropped':>7}")
    for r in results:
        print(f"{r['K']:>2} {r['steps_per_min']:>10.2f} {r['steps_per_min'] / base['steps_per_min']:>8.2f} "
              f"{r['train_s']:>8.1f} {r['val_pass@1_0']:>9.3f} -> {r['val_pass@1']:.3f} "
              f"{r['val_reward_0']:>9.3f} -> {r['val_reward']:.3f} {r['staleness_max']:>9} {r['stale_dropped']:>7}")


if __name__ == "__main__":
    main()
