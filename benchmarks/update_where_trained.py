"""Update time and memory: the LM head only at the loss tokens vs the full-vocabulary head at every position.

The main job's update shape by default: 16 samples (4 GRPO groups of 4 episodes sharing a ~270-token
prompt), each response a 48-token call, a ~12-token tool result (loss mask 0) and a 30-48-token call, on
SmolLM2-135M-Instruct in fp32. Both variants run the debug backbone's real `update` (one optimizer step);
"full" swaps in the computation this replaced (`model(...).logits` and the processed log-softmax at every
position). Runs are interleaved full, gathered, full, gathered, ... after one warm-up update (it also
builds AdamW's state); the figures are medians. Peak memory is the process RSS high-water mark
during the update above its RSS just before (large buffers are returned to the OS at once:
MALLOC_MMAP_THRESHOLD_ is fixed and malloc_trim runs between updates).

`--shared-prefix` also measures the issue's other idea, a GRPO group's shared prompt computed once: the
transformer body's forward + backward over one group's 4 full rows vs its prompt once, whose KV cache is
repeated for the group's 4 responses (the responses' tokens attend to it, and the gradient flows back into
the one prompt pass).

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/update_where_trained.py [--rounds 3] [--shared-prefix]
        [--model smollm2-135m-instruct] [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ajet.backbones.debug import backbone as backbone_module  # noqa: E402
from ajet.backbones.debug.backbone import DebugBackbone  # noqa: E402
from ajet.config import AjetConfig  # noqa: E402
from ajet.tracker.sample import Sample  # noqa: E402
from tests.full_token_logprobs import full_token_logprobs  # noqa: E402

GATHERED = backbone_module.token_logprobs


class PeakRSS:
    """Highest resident set size (bytes) seen every 2 ms while the block runs, minus the RSS at entry."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.delta = self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main_job_samples(vocab: int, groups: int, group_size: int, prompt_len: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    toks = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()   # noqa: E731
    samples = []
    for k in range(groups):
        prompt = toks(prompt_len + k)
        for e in range(group_size):
            c1, tool, c2 = toks(48), toks(12), toks(30 + (5 * e + 3 * k) % 19)
            mask = [1] * len(c1) + [0] * len(tool) + [1] * len(c2)
            s = Sample(episode_id=f"g{k}e{e}", group_id=f"g{k}", agent_tag="default", call_ids=["a", "b"],
                       prompt_ids=prompt, response_ids=c1 + tool + c2, loss_mask=mask,
                       old_logprobs=[-3.0 if m else 0.0 for m in mask], policy_versions=[0] * len(mask),
                       advantage=[1.0, -1.0, 0.5, -0.5][e % 4])
            s.temperatures = [0.6 if m else 1.0 for m in mask]
            samples.append(s)
    return samples


def time_update(bb: DebugBackbone, samples: list[Sample], variant: str) -> tuple[float, int]:
    backbone_module.token_logprobs = full_token_logprobs if variant == "full" else GATHERED
    _trim()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        bb.update(samples)
        dt = time.perf_counter() - t0
    backbone_module.token_logprobs = GATHERED
    return dt, mem.delta


def body_fwd_bwd(model, samples: list[Sample], shared: bool, device) -> float:
    """Seconds of the decoder body's forward + backward (a sum of the last hidden states at the loss
    positions as the loss) over all samples in one batch: every row whole, or each group's prompt once."""
    decoder = model.get_decoder()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if not shared:
        S = max(len(s.input_ids) for s in samples)
        ids = torch.zeros((len(samples), S), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, :len(s.input_ids)] = torch.tensor(s.input_ids)
            attn[i, :len(s.input_ids)] = 1
        h = decoder(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).last_hidden_state
        loss = sum(h[i, len(s.prompt_ids) - 1:len(s.input_ids) - 1].sum() for i, s in enumerate(samples))
    else:
        by_group: dict[str, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        loss = 0.0
        for members in by_group.values():
            P = len(members[0].prompt_ids) - 1          # the last prompt token is recomputed per row (it predicts)
            prefix = torch.tensor([members[0].prompt_ids[:P]], device=device)
            out = decoder(input_ids=prefix, use_cache=True)
            cache = out.past_key_values
            cache.batch_repeat_interleave(len(members))
            R = max(len(s.input_ids) - P for s in members)
            ids = torch.zeros((len(members), R), dtype=torch.long)
            attn = torch.zeros((len(members), P + R), dtype=torch.long)
            for i, s in enumerate(members):
                ids[i, :len(s.input_ids) - P] = torch.tensor(s.input_ids[P:])
                attn[i, :len(s.input_ids)] = 1
            h = decoder(input_ids=ids.to(device), attention_mask=attn.to(device), past_key_values=cache,
                        use_cache=True).last_hidden_state
            loss = loss + sum(h[i, :len(s.input_ids) - P - 1].sum() for i, s in enumerate(members))
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3, help="timed (full, gathered) pairs after one warm-up")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=268)
    ap.add_argument("--shared-prefix", action="store_true", help="also time the shared-prompt body pass")
    args = ap.parse_args()
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"},
                     model={"path": args.model, "device": args.device, "dtype": args.dtype})
    bb = DebugBackbone(cfg)
    samples = main_job_samples(bb.model.config.vocab_size, args.groups, args.group_size, args.prompt_len)
    n_tok = sum(len(s.input_ids) for s in samples)
    n_loss = sum(s.num_loss_tokens for s in samples)
    print(f"{len(samples)} samples, {n_tok} tokens, {n_loss} loss tokens; micro_batch_tokens "
          f"{cfg.algorithm.micro_batch_tokens}; load average {os.getloadavg()[0]:.1f}; torch threads "
          f"{torch.get_num_threads()}")
    res: dict[str, list[tuple[float, int]]] = {"full": [], "gathered": []}
    dt, mem = time_update(bb, samples, "gathered")
    print(f"  warm-up gathered {dt:7.2f} s  peak +{mem / 2**20:7.0f} MiB", flush=True)
    for r in range(1, args.rounds + 1):
        for variant in ("full", "gathered"):
            dt, mem = time_update(bb, samples, variant)
            print(f"  round {r} {variant:8s} {dt:7.2f} s  peak +{mem / 2**20:7.0f} MiB"
                  f"  (load {os.getloadavg()[0]:.1f})", flush=True)
            res[variant].append((dt, mem))
    med = {v: (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)) for v, xs in res.items()}
    for v, (dt, mem) in med.items():
        print(f"update {v:8s}: median {dt:.2f} s, peak memory +{mem / 2**20:.0f} MiB over the pre-update RSS")
    print(f"gathered / full: time {med['gathered'][0] / med['full'][0]:.2f}x, "
          f"peak memory {med['gathered'][1] / max(med['full'][1], 1):.2f}x")
    if args.shared_prefix:       # one GRPO group: the saving per group is the same for every group
        bb.model.train()
        group = [s for s in samples if s.group_id == samples[0].group_id]
        times: dict[str, list[float]] = {"rows": [], "shared": []}
        for r in range(args.rounds + 1):
            for v in ("rows", "shared"):
                dt = body_fwd_bwd(bb.model, group, v == "shared", bb.device)
                print(f"  {'warm-up' if r == 0 else f'round {r}'} body fwd+bwd {v:6s} {dt:7.2f} s", flush=True)
                if r:
                    times[v].append(dt)
        rows, shared = statistics.median(times["rows"]), statistics.median(times["shared"])
        print(f"body fwd+bwd of one group ({len(group)} samples): every row whole {rows:.2f} s, group prompt once {shared:.2f} s: "
              f"shared / rows {shared / rows:.2f}x")
    bb.close()


if __name__ == "__main__":
    main()
