"""Generation throughput through the proxy (debug backbone engine), at 1 and 8 concurrent episodes.

Each episode sends one chat completion through the real proxy with the real OpenAI SDK, asking for at most
`--max-tokens` tokens; what was generated is counted (a completion may end at end-of-turn sooner). For reference,
the same prompts go through `transformers`' own batched `generate` (counted up to and including end-of-turn).

The two sides are measured in `--rounds` rounds per concurrency, back to back and in alternating order (proxy first
in even rounds, `generate` first in odd ones), and the ratio is the median of the rounds' ratios. On a shared CPU
one measurement of each side taken one after the other compares two different loads: with two torch threads on two
cores, each of a batch-1 step's many small parallel regions waits for both threads to be scheduled (at load 15,
2026-11-28, one plain batch-1 decode loop of SmolLM2-135M ran 0.6 tok/s with two threads against 4.5 with one).
Each round's line gives the load average when it ended.

    python benchmarks/rollout_throughput.py [--model smollm2-135m-instruct] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai
import torch

from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams
from ajet.model import load_model, load_tokenizer, resolve_model_path
from ajet.proxy.server import ProxyServer

QUESTIONS = ["Tom has 3 apples and buys 4 more. How many apples does he have?",
             "A box holds 12 pens. How many pens are in 3 boxes?",
             "Sara had 20 stickers and gave away 7. How many are left?",
             "What is 15 plus 27?"]


async def _episodes(proxy: ProxyServer, n: int, max_tokens: int) -> int:
    async def one(i: int) -> int:
        ep = proxy.open_episode(f"bench-{i}")
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], max_tokens=max_tokens)
        await client.close()
        proxy.close_episode(ep)
        return r.usage.completion_tokens

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3, help="alternating measurements of each side per concurrency")
    args = ap.parse_args()
    if args.rounds < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        ap.error("--rounds, --max-tokens and every --concurrency must be at least 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    model = load_model(path).eval()
    engine = HFEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch_size=64, decode_fn=tok.decode)
    proxy = ProxyServer(engine, tok, SamplingParams(temperature=1.0, max_tokens=args.max_tokens),
                        sampling_policy="client").start()
    asyncio.run(_episodes(proxy, 2, args.max_tokens))     # warm-up: both sides once, at the measured lengths
    _hf_generate(model, tok, 2, args.max_tokens)
    print(f"model={args.model} max_tokens={args.max_tokens} threads={torch.get_num_threads()} rounds={args.rounds}")

    def proxy_tps(n: int) -> float:
        t0 = time.perf_counter()
        tokens = asyncio.run(_episodes(proxy, n, args.max_tokens))
        return tokens / (time.perf_counter() - t0)

    rows = []
    for n in args.concurrency:
        ratios, p_all, g_all = [], [], []
        for r in range(args.rounds):
            if r % 2 == 0:
                p_tps = proxy_tps(n)
                g_tps = _hf_generate(model, tok, n, args.max_tokens)
            else:
                g_tps = _hf_generate(model, tok, n, args.max_tokens)
                p_tps = proxy_tps(n)
            p_all.append(p_tps)
            g_all.append(g_tps)
            ratios.append(p_tps / g_tps)
            print(f"  episodes {n} round {r}: proxy {p_tps:.1f} tok/s, hf.generate {g_tps:.1f} tok/s, "
                  f"ratio {p_tps / g_tps:.2f}, load {_load()}", flush=True)
        rows.append((n, statistics.median(p_all), statistics.median(g_all), statistics.median(ratios)))
    print(f"{'episodes':>8} {'proxy tok/s':>12} {'hf.generate tok/s':>18} {'ratio':>6}   (medians over rounds)")
    for n, p_tps, g_tps, ratio in rows:
        print(f"{n:>8} {p_tps:>12.1f} {g_tps:>18.1f} {ratio:>6.2f}")
    proxy.stop()
    engine.close()


def _load() -> str:
    """The 1-minute load average (`/proc/loadavg`), or "?" where there is none."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


@torch.inference_mode()
def _hf_generate(model, tok, n: int, max_tokens: int) -> float:
    """transformers' batched sampling on the same prompts (left-padded), tokens/s."""
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=False,
                                     add_generation_prompt=True) for i in range(n)]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    out = model.generate(**batch, do_sample=True, temperature=1.0, max_new_tokens=max_tokens,
                         pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    new = out[:, batch["input_ids"].shape[1]:]                      # [n, gen_len]
    produced = 0
    for row in new.tolist():                                         # count up to and including end-of-turn
        produced += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return produced / dt


if __name__ == "__main__":
    main()
