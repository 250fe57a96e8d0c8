"""The debug backbone's engine: batched sampling whose logprobs the trainer reproduces."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.backbones.debug.backbone import token_logprobs
from ajet.backbones.debug.engine import HFEngine
from ajet.llm_call import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = HFEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch_size=8, max_model_len=256,
                   decode_fn=tok.decode)
    yield eng, model, tok
    eng.close()


async def _many(eng, prompts, params):
    return await asyncio.gather(*(eng.generate(p, params) for p in prompts))


def test_concurrent_requests_are_batched_and_logprobs_match_the_trainer(engine):
    eng, model, tok = engine
    prompts = [tok.encode(t, add_special_tokens=False) for t in
               ["hello there", "what is two plus two and why", "a", "tool call please, with many more words here"]]
    params = SamplingParams(temperature=0.7, max_tokens=10)
    outs = asyncio.run(_many(eng, prompts, params))
    for p, out in zip(prompts, outs):
        assert 1 <= len(out.token_ids) <= 10 and len(out.logprobs) == len(out.token_ids)
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "length":
            assert len(out.token_ids) == 10
        # the trainer's recomputation on the unpadded sequence gives the engine's numbers
        ids = torch.tensor([p + out.token_ids])
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0.7]]))
        assert lp[0, len(p):].tolist() == pytest.approx(out.logprobs, abs=1e-4)


def test_seeded_requests_repeat_and_max_tokens_is_respected(engine):
    eng, _, tok = engine
    p = tok.encode("repeat after me", add_special_tokens=False)
    a, b = asyncio.run(_many(eng, [p, p], SamplingParams(max_tokens=6, seed=123)))
    c = asyncio.run(_many(eng, [p], SamplingParams(max_tokens=6, seed=123)))[0]
    assert a.token_ids == b.token_ids == c.token_ids
    assert a.logprobs == pytest.approx(c.logprobs, abs=1e-4)


def test_prompt_longer_than_context_is_rejected(engine):
    eng, _, _ = engine
    with pytest.raises(ValueError, match="context holds 256"):
        asyncio.run(_many(eng, [[5] * 300], SamplingParams(max_tokens=4)))
