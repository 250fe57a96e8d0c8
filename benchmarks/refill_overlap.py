"""Dynamic sampling's extra tasks started as soon as the group they replace has finished, against started once
the step's whole batch has finished: rollout seconds per step, the same run otherwise.

The workflow: the policy answers, a "tool" sleeps (each task its own delay, uniform in [`--min-s`, `--max-s`],
seeded: an environment or tool whose latency dominates an episode, as with a sandbox, a browser or a remote
API), the policy answers again. Tasks marked flat score 1 in every episode (a group without GRPO signal, which
dynamic sampling replaces: one task in `--flat-every`); the others score the episode's repeat index. Each mode
runs the same config and seed (`--steps` steps, `tasks_per_step` 4, 4 repeats, `max_oversample` 4); the run
after the whole batch is the in-process source with `refills_while_running` turned off (what the other sources
do). Both must draw the same tasks and sample the same tokens (checked: the script exits 1 otherwise). An
untimed one-step run first takes the process's first-run costs (the first calls are slower).

Printed: per step the extra tasks and both modes' `time/rollout_s`; the totals over the steps with extra tasks,
and their ratio.

    python benchmarks/refill_overlap.py              # tiny random model, about 3 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests.tiny_model

WORKFLOW = '''
import asyncio

from ajet.workflow import Workflow, WorkflowOutput


class ToolLatency(Workflow):
    async def execute(self, task, tuner):
        messages = [{"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        await asyncio.sleep(task.metadata["delay_s"])                 # the tool
        messages.append({"role": "user", "content": "The tool is done. Answer."})
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        repeat = int(tuner.episode_id.rsplit("-r", 1)[1])
        return WorkflowOutput(reward=1.0 if task.metadata["flat"] else float(repeat),
                              final_answer=r.choices[0].message.content or "")
'''


def write_tasks(path: Path, n: int, args) -> None:
    rng = random.Random(args.seed)
    path.write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"Task {i}: what is {i} plus 1?",
                                        "delay_s": round(rng.uniform(args.min_s, args.max_s), 2),
                                        "flat": i % args.flat_every == 0}) + "\n" for i in range(n)))


def train(root: Path, model: str, name: str, early: bool, args) -> tuple[list[dict], dict]:
    from ajet.config import load_config
    from ajet.rollout.in_process import InProcessRollout
    from ajet.trainer import run
    from ajet.trajectory_store import TrajectoryStore

    (root / f"{name}.yaml").write_text(textwrap.dedent(f"""
        experiment_name: {name}
        workflow: wf.py:ToolLatency
        model: {{path: "{model}", max_model_len: 512}}
        data: {{train_path: train.jsonl, shuffle: false}}
        rollout: {{num_repeat: 4, max_tokens: 8, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3, dynamic_sampling: {{enabled: true, max_oversample: 4}}}}
        trainer: {{total_steps: {args.steps}, tasks_per_step: 4, seed: {args.seed}, tensorboard: false,
                   loggers: [jsonl], exp_dir: "{root / name}"}}
    """))
    prop = InProcessRollout.refills_while_running
    if not early:
        InProcessRollout.refills_while_running = property(lambda self: False)
    try:
        exp = run(load_config(root / f"{name}.yaml"))
    finally:
        InProcessRollout.refills_while_running = prop
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        sampled = {r["episode_id"]: (r["task"]["task_id"], r["reward"], [c["completion_ids"] for c in r["calls"]])
                   for r in store.episodes()}
    finally:
        store.close()
    return [r for r in rows if r.get("step", 0) > 0 and "time/rollout_s" in r], sampled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--flat-every", type=int, default=3, help="one task in this many scores 1 in every episode")
    ap.add_argument("--min-s", type=float, default=0.5, help="the shortest tool delay, seconds")
    ap.add_argument("--max-s", type=float, default=3.0, help="the longest tool delay, seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        from tests.tiny_model import build_tiny_model

        model = build_tiny_model(str(root / "tiny_model"))
        (root / "wf.py").write_text(WORKFLOW)
        write_tasks(root / "train.jsonl", args.steps * 8, args)
        train(root, model, "warmup", True, argparse.Namespace(**{**vars(args), "steps": 1}))   # first-run costs
        early, early_sampled = train(root, model, "early", True, args)
        late, late_sampled = train(root, model, "late", False, args)
    print(f"\nrefill_overlap: tiny model, {args.steps} steps of 4 tasks x 4 episodes, max_oversample 4, one task in "
          f"{args.flat_every} without signal, tool delays {args.min_s}-{args.max_s} s, seed {args.seed}")
    print(f"{'step':>4} {'extra tasks':>11} {'rollout s, at once':>18} {'after the batch':>15}")
    at_once = after = 0.0
    for e, l in zip(early, late):
        print(f"{e['step']:>4} {e['rollout/oversampled_tasks']:>11} {e['time/rollout_s']:>18.2f} "
              f"{l['time/rollout_s']:>15.2f}")
        if e["rollout/oversampled_tasks"]:
            at_once, after = at_once + e["time/rollout_s"], after + l["time/rollout_s"]
    same = early_sampled == late_sampled and [e["rollout/oversampled_tasks"] for e in early] == \
        [l["rollout/oversampled_tasks"] for l in late]
    print(f"steps with extra tasks: rollout {at_once:.1f} s at once vs {after:.1f} s after the batch: "
          f"{after / at_once:.2f}x faster" if at_once else "no step drew extra tasks")
    print(f"the same draws, sampled tokens and rewards in both runs ({len(early_sampled)} episodes): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
