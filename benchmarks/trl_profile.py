"""Where TRL's GRPO step spends its time and memory on the main job's work (the job of benchmarks/vs_trl.py).

    .trl-venv/bin/python benchmarks/trl_profile.py [--warmup 1] [--steps 2] [--micro-batch 16] [--bf16]
        [--gradient-checkpointing] [--torch-profile]

Runs `benchmarks/trl_grpo_job.py`'s trainer (same model, tasks in ajet's order, group 4, 48 tokens per turn, fp32,
beta 0) and splits each timed step's wall seconds into phases, by wrapping TRL's own methods:

    generate    TRL's `_generate` (sampling with transformers' `generate`, the tool loop)
    score       the rest of `_generate_and_score_completions` (reward, padding, advantages)
    forward     `_compute_loss` less its LM-head part: the transformer body over prompt + completion, padded
    lm_head     TRL's fused LM head (`ChunkedLogProbFunction`), forward and backward: the vocabulary projection,
                log-probabilities and entropy; off CUDA/XPU it scores every position of the padded batch (prompt and
                padding included), not only the completion tokens
    backward    `accelerator.backward` less its LM-head part
    optimizer   `optimizer.step()` (AdamW)
    other       the rest (gradient clipping, logging, the dataloader)

Memory: a thread samples the process's resident set every 10 ms and keeps the largest value seen in each phase
(peak RSS, MB). `--torch-profile` adds torch.profiler's top operators (self CPU time) over one timed update.
Printed per timed step, then the median over timed steps. Needs the TRL environment (benchmarks/setup_trl_env.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
PHASES = ("generate", "score", "forward", "lm_head", "backward", "optimizer", "other")
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_mb() -> float:
    """This process's resident set, MB (from /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_MB


class PhaseClock:
    """Wall seconds, CPU seconds (the process's, all threads) and peak RSS per named phase; phases nest (the inner
    one's time is not the outer one's). CPU seconds depend less on the machine's load than wall seconds."""

    def __init__(self) -> None:
        self.stack = ["other"]
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.peak = dict.fromkeys(PHASES, 0.0)
        self.t, self.c = time.perf_counter(), time.process_time()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            name = self.stack[-1]
            self.peak[name] = max(self.peak[name], rss_mb())

    def _switch(self, push: str | None) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.seconds[self.stack[-1]] += now - self.t
        self.cpu[self.stack[-1]] += cpu - self.c
        self.t, self.c = now, cpu
        if push is None:
            self.stack.pop()
        else:
            self.stack.append(push)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._switch(name)
        try:
            yield
        finally:
            self._switch(None)

    def wrap(self, name: str, fn):
        """`fn` with its calls counted as phase `name`."""
        def timed(*a, **k):
            with self.phase(name):
                return fn(*a, **k)
        return timed

    def reset(self) -> None:
        self._switch("other")
        self.stack = ["other"]
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.peak = dict.fromkeys(PHASES, 0.0)


def main() -> None:
    import trl_grpo_job
    ap = trl_grpo_job.parser()
    for action in ap._actions:                       # the tasks, model and output are made here
        if action.dest in ("model", "tasks", "steps", "out"):
            action.required = False
    ap.description = __doc__.splitlines()[0]
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--torch-profile", action="store_true", help="torch.profiler's top operators over one update")
    args = trl_grpo_job.parse_args(ap)

    import torch
    from transformers import TrainerCallback
    import trl.trainer.utils as trl_utils
    from vs_trl import CONF, ordered_tasks
    from ajet.config import load_config
    from ajet.model import resolve_model_path

    cfg = load_config(str(CONF))
    work = Path(tempfile.mkdtemp(prefix="ajet_trl_profile_"))
    total = args.warmup + args.steps
    args.steps = total
    args.model = args.model or resolve_model_path(cfg.model.path)
    args.tasks = args.tasks or str(ordered_tasks(total, work / "tasks.jsonl"))
    args.out = args.out or str(work / "metrics.jsonl")
    args.temperature, args.lr = cfg.rollout.temperature, cfg.algorithm.lr
    print(f"trl_profile: micro-batch {args.micro_batch}, bf16 {args.bf16}, gradient checkpointing "
          f"{args.gradient_checkpointing}, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus", flush=True)
    rss_before = rss_mb()
    trainer, timing = trl_grpo_job.build_trainer(args)
    rss_model = rss_mb()

    clock = PhaseClock()
    head = trl_utils._ChunkedLogProbFunction         # TRL's fused LM head (an autograd Function)
    head.forward = staticmethod(clock.wrap("lm_head", head.forward))
    head.backward = staticmethod(clock.wrap("lm_head", head.backward))
    trainer._generate = clock.wrap("generate", trainer._generate)
    trainer._generate_and_score_completions = clock.wrap("score", trainer._generate_and_score_completions)
    trainer._compute_loss = clock.wrap("forward", trainer._compute_loss)
    trainer.accelerator.backward = clock.wrap("backward", trainer.accelerator.backward)

    rows = []
    profiler = None

    class Steps(TrainerCallback):
        def on_step_begin(self, _args, state, *_a, **_k):
            nonlocal profiler
            clock.reset()
            timing.update(trl_grpo_job.zeroed())
            self.t0 = time.perf_counter()
            if args.torch_profile and state.global_step == args.warmup:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()

        def on_pre_optimizer_step(self, *_a, **_k):
            clock._switch("optimizer")

        def on_optimizer_step(self, *_a, **_k):
            clock._switch(None)

        def on_step_end(self, _args, state, *_a, **_k):
            nonlocal profiler
            clock._switch("other")
            clock._switch(None)
            if profiler is not None:
                profiler.__exit__(None, None, None)
                print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
                profiler = None
            step_s = time.perf_counter() - self.t0
            row = {"step_s": step_s, **dict(clock.seconds), "cpu": dict(clock.cpu), "peak": dict(clock.peak),
                   **timing}
            tag = "warm-up" if state.global_step <= args.warmup else "timed"
            if tag == "timed":
                rows.append(row)
            print(f"step {state.global_step} ({tag}): {step_s:.1f} s = "
                  + ", ".join(f"{p} {clock.seconds[p]:.1f}" for p in PHASES)
                  + " | CPU s " + ", ".join(f"{p} {clock.cpu[p]:.1f}" for p in PHASES)
                  + f" | tokens real {timing['forwarded']}, padded {timing['padded']}, trained {timing['trained']}"
                  + f" | peak RSS MB " + ", ".join(f"{p} {clock.peak[p]:.0f}" for p in PHASES if clock.peak[p])
                  + f" | load {os.getloadavg()[0]:.1f}", flush=True)

    trainer.add_callback(Steps())
    trainer.train()

    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", *PHASES, "forwarded", "padded", "trained")}
    cpu = {p: statistics.median(r["cpu"][p] for r in rows) for p in PHASES}
    peak = {p: max(r["peak"][p] for r in rows) for p in PHASES}
    print(f"\ntrl_profile: median of {len(rows)} timed steps (peak RSS: the largest over them); RSS before the "
          f"trainer {rss_before:.0f} MB, after building it {rss_model:.0f} MB")
    print(f"{'phase':<10} {'seconds':>8} {'share':>6} {'CPU s':>8} {'share':>6} {'peak RSS MB':>12}")
    for p in PHASES:
        print(f"{p:<10} {med[p]:8.1f} {med[p] / med['step_s']:6.1%} {cpu[p]:8.1f} {cpu[p] / sum(cpu.values()):6.1%} "
              f"{peak[p]:12.0f}")
    print(f"{'step':<10} {med['step_s']:8.1f} {'':>6} {sum(cpu.values()):8.1f}")
    update = med["step_s"] - med["generate"]
    print(f"update (step less generate) {update:.1f} s: {med['forwarded'] / update:.0f} real tokens/s "
          f"({med['forwarded']:.0f} real of {med['padded']:.0f} positions forwarded, "
          f"{med['forwarded'] / med['padded']:.0%}), {med['trained']:.0f} trained tokens")


if __name__ == "__main__":
    main()
