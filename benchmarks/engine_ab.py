"""The debug engine against its own code at another git revision, in one process: wall time of a batch of calls,
interleaved, and whether both sample the same tokens and logprobs.

    python benchmarks/engine_ab.py --baseline REV [--rows 32] [--rounds 3] [--threads 2] [--max-tokens 48]

`--rows` calls of the main job's shape (a shared 250-token prefix, then a short question of 14-20 tokens; budgets
`max_tokens - 7 * (i % 5)`, so rows leave the batch at different steps; temperature 0.8, each call seeded) are sent
together to an `HFEngine` over SmolLM2-135M (fp32, no prefix cache), `--rounds` times per side, the two sides
alternating (baseline first). The baseline is `backbones/debug/engine.py` as it was at `REV` (`git show`), loaded as
a module of its own; the rest of ajet is this checkout's. Printed: each run's wall seconds and tokens, the median
ratio (this checkout / baseline), and whether the first round's completions are the same token for token and
logprob for logprob.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def engine_at(rev: str):
    """`backbones/debug/engine.py` at git revision `rev`, imported as a module of its own."""
    src = subprocess.run(["git", "show", f"{rev}:backbones/debug/engine.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="ajet-engine-ab-")) / "engine_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("engine_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_baseline"] = module          # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision of the engine to compare against")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    import torch

    from ajet.backbones.debug import engine as current
    from ajet.llm_call import SamplingParams
    from ajet.model import load_model, load_tokenizer, resolve_model_path

    torch.set_num_threads(args.threads)
    baseline = engine_at(args.baseline)
    path = resolve_model_path("smollm2-135m-instruct")
    model, tok = load_model(path, device="cpu"), load_tokenizer(path)
    prefix = tok.encode("You are a math assistant. " * 40)[:250]
    prompts = [prefix + tok.encode(f" Question {i}: what is {i} plus {i * 3}?" + " Think." * (i % 7))
               for i in range(args.rows)]

    def run(module) -> tuple[float, list]:
        engine = module.HFEngine(model, [], tok.pad_token_id, max_batch_size=args.rows, max_model_len=2048,
                                 decode_fn=tok.decode, prefix_cache_bytes=0)

        async def calls():
            return await asyncio.gather(*(engine.generate(p, SamplingParams(
                max_tokens=args.max_tokens - 7 * (i % 5), temperature=0.8, seed=i)) for i, p in enumerate(prompts)))
        t0 = time.perf_counter()
        try:
            out = asyncio.run(calls())
        finally:
            engine.close()
        return time.perf_counter() - t0, out

    walls: dict[str, list[float]] = {"baseline": [], "current": []}
    first: dict[str, list] = {}
    for r in range(args.rounds):
        for name, module in (("baseline", baseline), ("current", current)):
            wall, out = run(module)
            walls[name].append(wall)
            first.setdefault(name, out)
            load = open("/proc/loadavg").read().split()[0]
            print(f"round {r} {name:<8} {wall:7.2f} s  {sum(len(c.token_ids) for c in out)} tokens  load {load}",
                  flush=True)
    ratio = statistics.median(c / b for c, b in zip(walls["current"], walls["baseline"]))
    same = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs
               for a, b in zip(first["baseline"], first["current"]))
    print(f"median wall ratio current / baseline ({args.baseline}): {ratio:.2f}; same tokens and logprobs: {same}")


if __name__ == "__main__":
    main()
