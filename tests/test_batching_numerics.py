"""What a seed reproduces (README, docs/benchmarks.md): a call's sampler is seeded per call, and a call decoded alone
gives the same tokens and logprobs bit for bit, every time; decoded in a batch with other calls, its logprobs move
in their last bits (the forward pass's float sums run in another order), so a seed alone does not fix the tokens
of a run whose batches differ (they follow the calls' timing, hence the machine's load). The debug engine over the
tiny model, no prefix cache (its reuse also depends on what ran before)."""

from __future__ import annotations

import asyncio

import pytest

from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams

QUERIES = ["Tom has 3 apples and buys 4 more. How many apples does Tom have now?", "What is 9 times 8?",
           "A box holds 12 pens. How many pens are in 3 boxes?", "Write 5 + 5.",
           "Sara had 20 stickers and gave away 7. How many are left?", "Count from 1 to 10, please, with words.",
           "The quick brown fox jumps over the lazy dog.", "say 3"]
TOKENS = 16


@pytest.fixture(scope="module")
def model_and_prompts(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUERIES]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    assert len({len(p) for p in prompts}) > 3          # rows of different lengths: the batch is left-padded
    return model, tok, prompts


def _generate(model, tok, prompts, batches: list[list[int]], rows: int, temperature: float):
    """Completions of `prompts[i]`, i in each of `batches` in turn, the calls of a batch sent together to one
    engine of `rows` rows (each call seeded by its index, as the proxy seeds each call from the run seed, the
    episode and the call index). Returns them in order."""
    engine = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=rows,
                      max_model_len=512, prefix_cache_bytes=0, batch_wait_s=0.5 if rows > 1 else 0.0)

    async def run():
        out = []
        for batch in batches:   # arrivals within batch_wait_s of an idle engine: admitted as one batch
            out += await asyncio.gather(*(engine.generate(prompts[i], SamplingParams(
                temperature=temperature, top_p=1.0, max_tokens=TOKENS, seed=100 + i)) for i in batch))
        return out
    try:
        return asyncio.run(asyncio.wait_for(run(), 300))
    finally:
        engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_call_alone_repeats_bit_for_bit_and_batching_moves_its_logprobs_in_the_last_bits(model_and_prompts,
                                                                                         temperature):
    model, tok, prompts = model_and_prompts
    everyone = list(range(len(prompts)))
    one_by_one = _generate(model, tok, prompts, [[i] for i in everyone] * 2, 1, temperature)
    alone, again = one_by_one[:len(prompts)], one_by_one[len(prompts):]
    for a, b in zip(alone, again):                # the same call, alone: the same tokens and logprobs, exactly
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    batched = _generate(model, tok, prompts, [everyone], len(prompts), temperature)
    moved = 0
    for a, b in zip(alone, batched):
        assert len(b.token_ids) == TOKENS
        same = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), TOKENS)
        for x, y in zip(a.logprobs[:same], b.logprobs[:same]):   # while the tokens agree
            assert x == pytest.approx(y, abs=1e-4)
            moved += x != y
    # batching is not bit-exact: some logprob moved (one near-tie is then enough to change a token)
    assert moved > 0
