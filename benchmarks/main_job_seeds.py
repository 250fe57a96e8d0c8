"""The main job's held-out gain in several seeds at once, and SFT on a stronger run's traces, then GRPO, against
GRPO alone.

(a) One `ajet --conf CONF --backbone=debug --seed S --exp-dir OUT/seed_S --quiet` per seed, all started together
    (on one GPU when there is one: the debug backbone puts the policy on cuda when torch sees it, `model.device:
    auto`). Per seed: held-out `val/pass@1` at step 0 and after the last step, and the gain in points.
(b) Once the run of `--sft-from-seed` K has finished (the stronger run: a trained policy's rollouts on the training
    tasks), rejection-sampling fine-tuning on its rewarded episodes (Yuan et al. 2023, arXiv:2308.01825):
    `ajet sft --from OUT/seed_K --min-reward R --conf CONF --backbone=debug --steps N --seed S0 --exp-dir OUT/sft`,
    then GRPO from its last checkpoint with CONF's settings, steps and seed S0 (`OUT/sft_grpo`, config
    `OUT/sft_grpo.yaml`: CONF with `model.path` set to the checkpoint and its file paths made absolute), against
    seed S0's run of (a) (GRPO alone). Held-out `val/pass@1` of each, and of the SFT model alone.

Every run is a plain `ajet` command (the table's figures are read from each run's `metrics.jsonl`); their output
goes to `OUT/<run>.log`. The table is printed and written to `OUT/summary.json`. Runs still going at
`--deadline-s` are stopped and reported as not finished.

    python benchmarks/main_job_seeds.py                                   # seeds 0-4, then SFT from seed 1's run
    python benchmarks/main_job_seeds.py --seeds 0,1,2 --no-sft --out experiments/seeds
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ROOT / "tutorial" / "example_math_agent" / "math_agent.yaml"


class Run:
    """One `python -m ajet ...` child: its name, command, log file, start and end (seconds since the benchmark
    started) and exit status (None while it runs)."""

    def __init__(self, name: str, argv: list[str], out: Path, env: dict[str, str], t0: float):
        self.name, self.argv, self.exp_dir = name, argv, out / name
        self.log = open(out / f"{name}.log", "w")
        self.started = time.monotonic() - t0
        self.ended: float | None = None
        self.rc: int | None = None
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def poll(self, t0: float) -> bool:
        """True once the child has exited (its status and end time are then set)."""
        if self.rc is None and self.proc.poll() is not None:
            self.rc, self.ended = self.proc.returncode, time.monotonic() - t0
            self.log.close()
        return self.rc is not None

    def stop(self) -> None:
        """SIGTERM to the child's process group, SIGKILL 10 s later if it is still there."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def held_out(exp_dir: Path) -> dict:
    """A run's figures from its `metrics.jsonl`: `val/pass@1` (fraction of the held-out tasks answered right,
    greedy) at its first and last evaluation with their steps, the gain in points, the held-out valid and grounded
    tool calls per episode after, the mean training reward over its steps (`reward/mean`), the last step logged,
    the sum of `time/step_s` (s) and, for an SFT run, `sft/kept_episodes`; {} when it logged no evaluation."""
    path = exp_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    vals = [r for r in rows if "val/pass@1" in r]
    if not vals:
        return {}
    first, last = vals[0], vals[-1]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    kept = [r["sft/kept_episodes"] for r in rows if "sft/kept_episodes" in r]
    return {"before": first["val/pass@1"], "after": last["val/pass@1"], "val_tasks": last.get("val/tasks"),
            "before_step": first.get("step"), "after_step": last.get("step"),
            "gain_points": 100 * (last["val/pass@1"] - first["val/pass@1"]),
            "valid_calls_after": last.get("val/workflow/valid_tool_calls"),
            "grounded_calls_after": last.get("val/workflow/grounded_tool_calls"),
            "last_step": max((r.get("step", 0) for r in rows), default=0),
            "train_reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "steps_time_s": sum(r.get("time/step_s", 0) for r in rows),
            **({"sft_kept_episodes": kept[-1]} if kept else {})}


def absolute_paths(conf: Path, data: dict) -> dict:
    """CONF's `workflow`, `judge`, `data.train_path` and `data.val_path` as absolute paths where they name a file
    in CONF's folder (a derived config written elsewhere then finds the same files)."""
    def fix(value: str) -> str:
        file, sep, attr = value.rpartition(":") if ".py:" in value else (value, "", "")
        return str((conf.parent / file).resolve()) + sep + attr if (conf.parent / file).exists() else value

    for key in ("workflow", "judge"):
        if isinstance(data.get(key), str):
            data[key] = fix(data[key])
    for key in ("train_path", "val_path"):
        if isinstance((data.get("data") or {}).get(key), str):
            data["data"][key] = fix(data["data"][key])
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conf", type=Path, default=MAIN_JOB, help="the job's config (default: the main job)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds, one run each, all at once")
    p.add_argument("--out", type=Path, default=Path("experiments/main_job_seeds"), help="runs' folders and logs")
    p.add_argument("--steps", type=int, help="override trainer.total_steps of every GRPO run")
    p.add_argument("--no-sft", action="store_true", help="only (a)")
    p.add_argument("--sft-from-seed", type=int, default=1, help="the stronger run whose rewarded episodes SFT trains on")
    p.add_argument("--sft-seed", type=int, default=0, help="seed of the SFT and of the GRPO run after it (compared "
                   "with this seed's run of GRPO alone)")
    p.add_argument("--sft-steps", type=int, default=3, help="SFT updates (each one pass over the kept episodes)")
    p.add_argument("--min-reward", type=float, default=1.0, help="keep episodes with reward >= this (main job: "
                   "1 = the right answer)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each run (default: CPU cores / runs at once)")
    p.add_argument("--deadline-s", type=float, default=0, help="stop the runs still going after this many seconds "
                   "(0: none)")
    args = p.parse_args(argv)

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    sft = not args.no_sft
    if sft and args.sft_from_seed not in seeds or sft and args.sft_seed not in seeds:
        p.error("--sft-from-seed and --sft-seed must be among --seeds (or pass --no-sft)")
    conf = args.conf.resolve()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // (len(seeds) + int(sft)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    steps = ["--steps", str(args.steps)] if args.steps else []
    ajet = [sys.executable, "-m", "ajet"]
    t0 = time.monotonic()

    def grpo(name: str, conf_path: Path, seed: int) -> Run:
        return Run(name, ajet + ["--conf", str(conf_path), "--backbone=debug", "--seed", str(seed), "--exp-dir",
                                 str(out / name), "--quiet"] + steps, out, env, t0)

    runs = {f"seed_{s}": grpo(f"seed_{s}", conf, s) for s in seeds}
    print(f"[{time.monotonic() - t0:6.0f} s] started {len(runs)} runs (OMP_NUM_THREADS={threads}) -> {out}", flush=True)
    stopped: list[str] = []
    try:
        while True:
            for name, run in list(runs.items()):
                if run.rc is None and run.poll(t0):
                    print(f"[{run.ended:6.0f} s] {name} exited {run.rc}", flush=True)
                    if not sft or run.rc != 0:
                        continue
                    if name == f"seed_{args.sft_from_seed}":
                        runs["sft"] = Run("sft", ajet + [
                            "sft", "--from", str(run.exp_dir), "--min-reward", str(args.min_reward), "--conf",
                            str(conf), "--backbone=debug", "--steps", str(args.sft_steps), "--seed",
                            str(args.sft_seed), "--exp-dir", str(out / "sft"), "--quiet"], out, env, t0)
                    elif name == "sft":
                        data = absolute_paths(conf, yaml.safe_load(conf.read_text()))
                        data["experiment_name"] = "sft_grpo"
                        data.setdefault("model", {})["path"] = str(out / "sft" / "checkpoints" /
                                                                   f"step_{args.sft_steps}")
                        derived = out / "sft_grpo.yaml"
                        derived.write_text(yaml.safe_dump(data, sort_keys=False))
                        runs["sft_grpo"] = grpo("sft_grpo", derived, args.sft_seed)
            if all(r.rc is not None for r in runs.values()):
                break
            if args.deadline_s and time.monotonic() - t0 > args.deadline_s:
                stopped = [n for n, r in runs.items() if r.rc is None]
                print(f"[{time.monotonic() - t0:6.0f} s] deadline: stopping {stopped}", flush=True)
                for n in stopped:
                    runs[n].stop()
                    runs[n].poll(t0)
                break
            time.sleep(1)
    finally:
        for r in runs.values():
            r.stop()

    summary = {"conf": str(conf), "seeds": seeds, "steps": args.steps, "wall_s": time.monotonic() - t0,
               "stopped_at_deadline": stopped, "runs": {}}
    for name, r in runs.items():
        summary["runs"][name] = {"rc": r.rc, "started_s": round(r.started, 1),
                                 "wall_s": round(r.ended - r.started, 1) if r.ended is not None else None,
                                 **held_out(r.exp_dir)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    print("\n| run | exit | held-out val/pass@1 before -> after | gain (points) | steps | wall time |")
    print("|---|---|---|---|---|---|")
    for name, s in summary["runs"].items():
        gain = f"{s['gain_points']:+.1f}" if "gain_points" in s else "-"
        wall = f"{s['wall_s']:.0f} s" if s["wall_s"] is not None else "not finished"
        print(f"| {name} | {s['rc']} | {pct(s.get('before'))} -> {pct(s.get('after'))} | {gain} | "
              f"{s.get('last_step', '-')} | {wall} |")
    if sft and "sft_grpo" in summary["runs"] and f"seed_{args.sft_seed}" in summary["runs"]:
        a, b = summary["runs"][f"seed_{args.sft_seed}"], summary["runs"]["sft_grpo"]
        print(f"\nSFT (from seed_{args.sft_from_seed}, reward >= {args.min_reward:g}, {args.sft_steps} steps) then GRPO: "
              f"{pct(b.get('after'))}; GRPO alone (seed {args.sft_seed}): {pct(a.get('after'))}; both from "
              f"{pct(a.get('before'))} before any training")
    print(f"\ntotal wall time {summary['wall_s']:.0f} s; {out / 'summary.json'}")
    return 0 if all(r.rc == 0 for r in runs.values()) and not stopped else 1


if __name__ == "__main__":
    sys.exit(main())
