"""The debug backbone's update with a GRPO group's shared prompt run once per packed row, against one row per sample.

    python benchmarks/update_shared_prefix.py [--groups 4] [--rounds 2] [--set KEY=VALUE ...]

The main job's model and config (`tutorial/example_math_agent/math_agent.yaml`: SmolLM2-135M-Instruct, fp32,
micro-batches of 1,024 tokens, activation checkpointing) and its update's shape (`--groups` GRPO groups of 4
samples: a ~270-token prompt, a 48-token call, a 12-token tool result, a 30-48-token call;
`benchmarks/update_where_trained.py`'s samples). Each round runs the update once per variant, "rows" then "shared"
(`DebugBackbone.share_prefixes` False / True), each from the same weights and AdamW state (restored before each
run). Printed per run: seconds, peak RSS over the RSS just before, tokens run through the decoder body; then the
medians, the ratio shared / rows, and how far the two variants' weights after one update lie apart relative to how
far the update moved them (the gradients agree up to float rounding; AdamW's step divides by the gradient's running
scale, so where a gradient is near 0 its rounding shows in the step).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.main_job_memory import CONF, PhaseMemory, parse_overrides, rss_bytes
from benchmarks.update_where_trained import main_job_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=4, help="GRPO groups of 4 samples in the update")
    ap.add_argument("--rounds", type=int, default=2, help="(rows, shared) pairs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = ap.parse_args()

    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import load_config
    from ajet.heap import trim_free_memory

    cfg = load_config(CONF, {"backbone": "debug", **parse_overrides(args.set)})
    bb = DebugBackbone(cfg)
    samples = main_job_samples(bb.model.config.vocab_size, args.groups, 4, 268)
    bb.update(samples)                       # warm-up: builds AdamW's state, so that every timed run has it
    weights0 = copy.deepcopy(bb.model.state_dict())
    optim0 = copy.deepcopy(bb.optimizer.state_dict())
    body_tokens = [0]
    bb.model.get_decoder().register_forward_pre_hook(
        lambda _m, a, kw: body_tokens.__setitem__(0, body_tokens[0] + kw["input_ids"].numel()), with_kwargs=True)
    print(f"{len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens; micro_batch_tokens "
          f"{cfg.algorithm.micro_batch_tokens}; torch threads {torch.get_num_threads()}; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[tuple[float, int, int]]] = {"rows": [], "shared": []}
    after: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(1, args.rounds + 1):
        for variant in ("rows", "shared"):
            bb.model.load_state_dict(weights0)
            bb.optimizer.load_state_dict(copy.deepcopy(optim0))
            bb.share_prefixes = variant == "shared"
            trim_free_memory()
            body_tokens[0] = 0
            mem = PhaseMemory(0.005).start()
            before = rss_bytes()
            token = mem.enter("update")
            t0 = time.perf_counter()
            bb.update(samples)
            dt = time.perf_counter() - t0
            mem.leave(token)
            mem.stop()
            runs[variant].append((dt, mem.peak["update"] - before, body_tokens[0]))
            after[variant] = {k: v.detach().clone() for k, v in bb.model.state_dict().items()}
            print(f"  round {r} {variant:6s} {dt:6.1f} s, peak +{(mem.peak['update'] - before) / 1e9:.2f} GB, "
                  f"{body_tokens[0]} body tokens (load {os.getloadavg()[0]:.1f})", flush=True)
    med = {v: [statistics.median(x[i] for x in xs) for i in range(3)] for v, xs in runs.items()}
    for v, (dt, mem, tok) in med.items():
        print(f"{v:6s}: median {dt:.1f} s, peak +{mem / 1e9:.2f} GB, {tok:.0f} body tokens")
    moved = max(float((after["rows"][k] - weights0[k]).abs().max()) for k in weights0)
    apart = max(float((after["rows"][k] - after["shared"][k]).abs().max()) for k in weights0)
    print(f"shared / rows: time {med['shared'][0] / med['rows'][0]:.2f}x, peak memory "
          f"{med['shared'][1] / max(med['rows'][1], 1):.2f}x, body tokens {med['shared'][2] / med['rows'][2]:.2f}x; "
          f"weights after one update apart by {apart:.2e} (max |diff|), the update moved them by {moved:.2e}: "
          f"{apart / moved:.1e} of it")
    bb.close()


if __name__ == "__main__":
    main()
