"""ajet's main job vs TRL's GRPOTrainer doing the same work, run interleaved on this machine; ratios ajet / TRL.

    bash benchmarks/setup_trl_env.sh            # once: TRL 1.16.0 in .trl-venv (optional; skipped without it)
    python benchmarks/vs_trl.py [--pairs 2] [--warmup 1] [--steps 4] [--trl-micro-batch 4]

Each pair runs the main job (`ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug`) and
`benchmarks/trl_grpo_job.py` (TRL, configured as described there: same weights, template, tasks in ajet's order,
group 4, 48 tokens per turn, the main job's temperature and lr, fp32, loss "grpo", no KL; the step's 16 sequences
trained in micro-batches of `--trl-micro-batch` with gradient accumulation, one optimizer step per step: TRL's own
advice on memory is a lower per_device_train_batch_size; benchmarks/trl_profile.py shows where its step goes), one
after the other, alternating which
goes first; each does `--warmup` untimed steps then `--steps` timed ones. Before each run the load average is
printed (the machine may be shared: the ratios of paired steps are what to read). Per step: wall, rollout and
update seconds, generated tokens, forwarded tokens (prompt + completion in the update) and trained tokens (under
the loss mask); per run: peak RSS of the process (`wait4`). Printed: steps/min, generation tokens/s, forwarded
and trained tokens/s, peak memory, as ajet/TRL ratios with min / median / max over the paired timed steps.

Equal work: TRL cannot force a tool call and makes at most two generations per episode (one tool round), so ajet
runs the main job's agent with TRL's turns (`benchmarks/vs_trl_workflow.py`: first turn free, at most two model
calls) and without dynamic sampling (TRL rolls out 4 tasks x 4 per step). Both sample from the same weights at the
same temperature (TRL's top_k 0, top_p 1), so the work is equal in expectation; the per-episode model calls and
generated tokens of both sides are printed, with a flag where they differ by more than 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "tutorial" / "example_math_agent" / "math_agent.yaml"
EQUAL_WORK = f"{ROOT / 'benchmarks' / 'vs_trl_workflow.py'}:TRLTurnsMathAgentWorkflow"
TRL_MICRO_BATCH = 4            # one GRPO group per forward/backward: a quarter of 16-at-once's activations
WORK_TOLERANCE = 0.10          # per-episode calls and generated tokens within 10% of TRL's, or the run says so
GROUP, TASKS_PER_STEP = 4, 4   # TRL's step (num_generations 4, 16 sequences): ajet runs it too (the main job: 8 x 2)


def trl_python(venv: Path) -> tuple[Path | None, str]:
    """The TRL environment's python, or None and why it cannot be used."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"no TRL environment at {venv} (make it with: bash benchmarks/setup_trl_env.sh)"
    probe = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"{python} cannot import trl: {probe.stderr.strip().splitlines()[-1:]}"
    return python, probe.stdout.strip()


def run_measured(cmd: list[str], log: Path) -> float:
    """Run `cmd` to the end (output to `log`); its peak RSS in MB. Raises RuntimeError on failure."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:3]} failed (exit {os.waitstatus_to_exitcode(status)}); see {log}")
    return usage.ru_maxrss / 1024


def ajet_steps(exp: Path) -> list[dict]:
    """Per-step figures from the main job's metrics.jsonl."""
    steps = []
    for line in (exp / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        steps.append({"step_s": m["time/step_s"], "rollout_s": m["time/rollout_s"],
                      "update_s": m["time/step_s"] - m["time/rollout_s"],
                      "generated_tokens": m["rollout/generated_tokens"],
                      "forwarded_tokens": m["tracker/tokens_merged"], "trained_tokens": m["tracker/loss_tokens"],
                      "episodes": m["rollout/episodes"], "calls": m["rollout/calls"],
                      "failed_episodes": m["rollout/failed"]})
    return steps


def ordered_tasks(n_steps: int, out: Path) -> Path:
    """The tasks ajet's main job trains on, in its order (seeded shuffle, TASKS_PER_STEP per step), as a jsonl for
    TRL."""
    sys.path.insert(0, str(ROOT))
    from ajet.config import load_config, resolve_path
    from ajet.tasks.jsonl import read_jsonl_tasks
    from ajet.task_sampler import TaskSampler
    cfg = load_config(str(CONF))
    tasks = read_jsonl_tasks(resolve_path(cfg, cfg.data.train_path), cfg.data.max_tasks)
    sampler = TaskSampler(tasks, cfg.data.shuffle, cfg.trainer.seed)          # as ajet/trainer.py does
    chosen = [t for _ in range(n_steps) for t in sampler.next_batch(TASKS_PER_STEP)]
    out.write_text("".join(json.dumps({"task_id": t.task_id, "query": t.query, "answer": t.answer}) + "\n"
                           for t in chosen))
    return out


def ratio_line(name: str, ajet: list[float], trl: list[float]) -> str:
    r = [a / t for a, t in zip(ajet, trl) if t > 0]
    if not r:
        return f"{name:<28} n/a"
    return (f"{name:<28} ajet/TRL median {statistics.median(r):5.2f}  (min {min(r):.2f}, max {max(r):.2f}, "
            f"{len(r)} paired)   ajet median {statistics.median(ajet):8.1f}   TRL median {statistics.median(trl):8.1f}")


def equal_work(ajet: list[dict], trl: list[dict]) -> bool:
    """Print both sides' work per episode over all timed steps: model calls (turns) and generated tokens.

    Both sample from the same weights at the same temperature, so their work is equal in expectation, not token for
    token; a side whose per-episode figure is off by more than WORK_TOLERANCE is flagged. Returns True when equal.
    """
    ok = True
    for name, key in (("model calls / episode", "calls"), ("generated tokens / episode", "generated_tokens")):
        per_ajet = sum(s[key] for s in ajet) / max(1, sum(s["episodes"] for s in ajet))
        per_trl = sum(s[key] for s in trl) / max(1, sum(s["episodes"] for s in trl))
        ratio = per_ajet / per_trl if per_trl else float("nan")
        same = abs(ratio - 1) <= WORK_TOLERANCE
        ok &= same
        verdict = (f"equal work (within {WORK_TOLERANCE:.0%})" if same
                   else "NOT EQUAL WORK: the ratios below compare different work")
        print(f"{name:<28} ajet {per_ajet:6.2f}   TRL {per_trl:6.2f}   ajet/TRL {ratio:.2f}   {verdict}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2, help="ajet/TRL run pairs, interleaved")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--trl-venv", default=str(ROOT / ".trl-venv"))
    ap.add_argument("--trl-micro-batch", type=int, default=TRL_MICRO_BATCH,
                    help="TRL's per_device_train_batch_size (the step's 16 sequences accumulated over 16/N of them)")
    args = ap.parse_args()
    if args.trl_micro_batch < 1 or 16 % args.trl_micro_batch:
        ap.error(f"--trl-micro-batch {args.trl_micro_batch} must divide the step's 16 sequences (1, 2, 4, 8 or 16)")

    python, info = trl_python(Path(args.trl_venv))
    if python is None:
        print(f"vs_trl: skipped: {info}")
        return
    from ajet.config import load_config
    from ajet.model import resolve_model_path
    cfg = load_config(str(CONF))
    model_dir = resolve_model_path(cfg.model.path)
    total = args.warmup + args.steps
    work = Path(tempfile.mkdtemp(prefix="ajet_vs_trl_"))
    tasks = ordered_tasks(total, work / "tasks.jsonl")
    print(f"vs_trl: TRL {info} (micro-batch {args.trl_micro_batch}); model {model_dir}; {args.pairs} pairs x "
          f"({args.warmup} warm-up + {args.steps} timed steps); work dir {work}")

    per = {"ajet": [], "trl": []}          # timed steps of every run, in pair order
    peaks = {"ajet": [], "trl": []}
    for pair in range(args.pairs):
        order = ["ajet", "trl"] if pair % 2 == 0 else ["trl", "ajet"]
        for side in order:
            load = os.getloadavg()[0]
            print(f"pair {pair + 1} {side:>4}: load average {load:.1f} on {os.cpu_count()} cpus"
                  + ("  (busy machine: figures are noisy)" if load > 1.5 * (os.cpu_count() or 1) else ""), flush=True)
            t0 = time.perf_counter()
            run_dir = work / f"{side}_{pair}"
            if side == "ajet":
                # the main job as the CLI runs it, doing TRL's work: no held-out evaluation (TRL's run has none),
                # no dynamic sampling (TRL rolls out each step's 4 tasks only), TRL's groups and turns (EQUAL_WORK)
                overrides = {"backbone": "debug", "trainer.total_steps": total, "trainer.exp_dir": str(run_dir),
                             "trainer.val_freq": 0, "data.test_path": None, "algorithm.dynamic_sampling.enabled": False,
                             "rollout.num_repeat": GROUP, "trainer.tasks_per_step": TASKS_PER_STEP,
                             "workflow": EQUAL_WORK}
                peak = run_measured([sys.executable, "-c", "import sys, json; from ajet.config import load_config; "
                                     "from ajet.trainer import run; run(load_config(sys.argv[1], json.loads(sys.argv[2])))",
                                     str(CONF), json.dumps(overrides)], work / f"{side}_{pair}.log")
                steps = ajet_steps(run_dir)
            else:
                run_dir.mkdir()
                out = run_dir / "metrics.jsonl"
                peak = run_measured([str(python), str(ROOT / "benchmarks" / "trl_grpo_job.py"), "--model", model_dir,
                                     "--tasks", str(tasks), "--steps", str(total), "--out", str(out),
                                     "--temperature", str(cfg.rollout.temperature), "--lr", str(cfg.algorithm.lr),
                                     "--micro-batch", str(args.trl_micro_batch)],
                                    work / f"{side}_{pair}.log")
                steps = [json.loads(line) for line in out.read_text().splitlines()]
            timed = steps[args.warmup:]
            failed = sum(s.get("failed_episodes", 0) for s in timed)
            if failed:
                print(f"            WARNING: {failed} episodes failed in the timed steps (e.g. the episode timeout on a "
                      f"loaded machine); the figures below do not describe the same work", flush=True)
            per[side] += timed
            peaks[side].append(peak)
            print(f"            {len(timed)} timed steps, step_s {[round(s['step_s'], 1) for s in timed]}, "
                  f"rollout_s {[round(s['rollout_s'], 1) for s in timed]}, generated "
                  f"{[s['generated_tokens'] for s in timed]}, peak {peak:.0f} MB ({time.perf_counter() - t0:.0f} s)",
                  flush=True)

    a, t = per["ajet"], per["trl"]
    n = min(len(a), len(t))
    a, t = a[:n], t[:n]
    print(f"\nvs_trl: {n} paired timed steps (ajet step k of pair p with TRL step k of pair p)")
    equal_work(a, t)
    print(ratio_line("steps/min", [60 / s["step_s"] for s in a], [60 / s["step_s"] for s in t]))
    print(ratio_line("generation tokens/s", [s["generated_tokens"] / s["rollout_s"] for s in a],
                     [s["generated_tokens"] / s["rollout_s"] for s in t]))
    print(ratio_line("forwarded tokens/s (update)", [s["forwarded_tokens"] / s["update_s"] for s in a],
                     [s["forwarded_tokens"] / s["update_s"] for s in t]))
    print(ratio_line("trained tokens/s (update)", [s["trained_tokens"] / s["update_s"] for s in a],
                     [s["trained_tokens"] / s["update_s"] for s in t]))
    print(ratio_line("rollout s/step", [s["rollout_s"] for s in a], [s["rollout_s"] for s in t]))
    print(ratio_line("update s/step", [s["update_s"] for s in a], [s["update_s"] for s in t]))
    print(ratio_line("peak memory MB (per run)", peaks["ajet"], peaks["trl"]))


if __name__ == "__main__":
    main()
