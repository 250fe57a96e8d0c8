"""The debug backbone's engine: batched sampling whose logprobs the trainer reproduces."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.backbones.debug.backbone import token_logprobs
from ajet.engines.in_process import HFEngine, _Row, sample_rows
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


def _reference(model, prompt, out, temperature, top_p):
    """Recompute a completion from scratch (one unpadded forward): per sampled token its processed logprob
    `[n]`, whether it lies in its step's nucleus `[n]`, and the argmax at each step `[n]`."""
    from ajet.sampling_dist import nucleus_keep, processed_logprobs
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()           # [n, V]
    t = torch.full((len(out.token_ids),), float(temperature))
    p = torch.full((len(out.token_ids),), float(top_p))
    tok = torch.tensor(out.token_ids)
    lp = processed_logprobs(logits, t, p).gather(1, tok[:, None]).squeeze(1)
    inside = nucleus_keep(logits / t[:, None], p).gather(1, tok[:, None]).squeeze(1)
    return lp.tolist(), inside.tolist(), logits.argmax(-1).tolist()


def test_top_p_logprobs_are_the_processed_distribution_and_never_leave_the_nucleus(engine):
    eng, model, tok = engine
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["hello there", "what is two plus two", "a b c"]]
    params = SamplingParams(temperature=0.8, top_p=0.3, max_tokens=40)
    outs = asyncio.run(_many(eng, prompts, params))
    n = 0
    for p, out in zip(prompts, outs):
        lp, inside, _ = _reference(model, p, out, 0.8, 0.3)
        assert lp == pytest.approx(out.logprobs, abs=1e-4)     # truncated-renormalised, as the trainer scores
        assert all(inside)                                     # no token outside the nucleus was ever drawn
        n += len(out.token_ids)
    assert n >= 60          # enough draws that sampling from the full distribution would leave the nucleus


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_tokens_follow_the_processed_distribution(temperature, top_p):
    """`sample_rows`' draws over 40,000 rows: each token's frequency within 5 standard errors of its probability
    under softmax(logits / T) truncated to the nucleus and renormalised (written out here), and never a token
    outside it; a row's token depends on its own seed only."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])      # [V]
    p = torch.softmax(logits / temperature, -1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]                    # mass of the tokens ranked above each one
    nucleus = torch.zeros_like(p, dtype=torch.bool)
    nucleus[order[before < top_p]] = True                     # the smallest top set reaching top_p
    want = torch.where(nucleus, p, 0.0) / p[nucleus].sum()
    n = 40_000
    rows = [_Row(None, temperature, top_p, False, torch.Generator().manual_seed(i), 1, 0) for i in range(n)]
    _, tokens = sample_rows(logits.expand(n, -1), rows)
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    stderr = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * stderr + 1e-12).all(), (freq, want)
    assert freq[~nucleus].sum() == 0
    # each row draws from its own generator only: the first 50 seeds in reverse order draw the same tokens reversed
    again = [_Row(None, temperature, top_p, False, torch.Generator().manual_seed(i), 1, 0) for i in reversed(range(50))]
    assert torch.equal(sample_rows(logits.expand(50, -1), again)[1], tokens[:50].flip(0))


def test_sampled_tokens_are_torch_multinomials_for_the_same_generators():
    """Each sampled row's token and its generator's state after are those of `torch.multinomial` on that row's
    processed probabilities with a generator of the same seed (49,152 entries, as SmolLM2's vocabulary; a greedy
    row between them draws nothing), so a seed's tokens do not change with the batched sampler; and the draw is
    robust to rounding: logits moved by 3e-4 draw the same tokens in nearly every row (inverting one CDF moves
    every boundary and fails this)."""
    from ajet.sampling_dist import processed_logprobs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 49_152, generator=g) * 2                                     # [B, V]
    temps, tops = [0.8, 1.0, 0.6, 0.8] * 6, [1.0, 1.0, 0.9, 0.5] * 6
    greedy = [i % 7 == 3 for i in range(24)]
    rows = [_Row(None, t, p, gr, torch.Generator().manual_seed(100 + i), 1, 0)
            for i, (t, p, gr) in enumerate(zip(temps, tops, greedy))]
    _, tokens = sample_rows(logits, rows)
    probs = processed_logprobs(logits, torch.tensor(temps), torch.tensor(tops)).exp()     # [B, V]
    for i in range(24):
        ref = torch.Generator().manual_seed(100 + i)
        want = logits[i].argmax() if greedy[i] else torch.multinomial(probs[i], 1, generator=ref)[0]
        assert tokens[i] == want, i
        assert torch.equal(rows[i].generator.get_state(), ref.get_state()), i
    wide = torch.randn(200, 49_152, generator=g) * 2                                     # [200, V]
    moved = wide + 3e-4 * torch.randn(wide.shape, generator=g)
    draws = [sample_rows(x, [_Row(None, 0.8, 1.0, False, torch.Generator().manual_seed(i), 1, 0) for i in range(200)])[1]
             for x in (wide, moved)]
    assert (draws[0] != draws[1]).sum() <= 1          # the CDF's draw: 24 of 200 differ


def test_temperature_zero_is_greedy_with_logprobs_under_temperature_one(engine):
    eng, model, tok = engine
    p = tok.encode("greedy please", add_special_tokens=False)
    out = asyncio.run(_many(eng, [p], SamplingParams(temperature=0.0, top_p=0.5, max_tokens=12)))[0]
    lp, _, argmax = _reference(model, p, out, 1.0, 1.0)
    assert out.token_ids == argmax[:len(out.token_ids)]
    assert out.logprobs == pytest.approx(lp, abs=1e-4)


def test_each_request_keeps_its_own_temperature_and_seed_in_a_shared_batch(engine):
    eng, _, tok = engine
    a = (tok.encode("first prompt here", add_special_tokens=False), SamplingParams(temperature=0.3, max_tokens=10, seed=1))
    b = (tok.encode("the second one", add_special_tokens=False),
         SamplingParams(temperature=1.7, top_p=0.9, max_tokens=10, seed=2))

    async def together():
        return await asyncio.gather(eng.generate(*a), eng.generate(*b))

    alone_a = asyncio.run(_many(eng, [a[0]], a[1]))[0]
    alone_b = asyncio.run(_many(eng, [b[0]], b[1]))[0]
    both_a, both_b = asyncio.run(together())
    assert both_a.token_ids == alone_a.token_ids and both_b.token_ids == alone_b.token_ids
    assert both_a.logprobs == pytest.approx(alone_a.logprobs, abs=1e-4)
    assert both_b.logprobs == pytest.approx(alone_b.logprobs, abs=1e-4)


def test_an_empty_stop_string_is_ignored(engine):
    eng, _, tok = engine
    p = tok.encode("keep going", add_special_tokens=False)
    plain = asyncio.run(_many(eng, [p], SamplingParams(max_tokens=8, seed=5)))[0]
    with_empty = asyncio.run(_many(eng, [p], SamplingParams(max_tokens=8, seed=5, stop=("",))))[0]
    assert len(plain.token_ids) > 1 and with_empty.token_ids == plain.token_ids


def test_proxy_over_the_engine_records_temperature_zero_and_ignores_an_empty_stop(engine):
    import openai

    from ajet.proxy.server import ProxyServer
    eng, model, tok = engine
    proxy = ProxyServer(eng, tok, SamplingParams(max_tokens=8), sampling_policy="client").start()
    try:
        ep = proxy.open_episode("ep-greedy")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [{"role": "user", "content": "count with me"}]
        client.chat.completions.create(model="policy", messages=messages, temperature=0, stop=[""], max_tokens=8)
        (call,) = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert call.sampling.temperature == 0 and call.sampling.stop == ()      # greedy, recorded as such
    assert len(call.completion_ids) > 1
    out = type("C", (), {"token_ids": call.completion_ids})
    lp, _, argmax = _reference(model, call.prompt_ids, out, 1.0, 1.0)
    assert call.completion_ids == argmax and call.completion_logprobs == pytest.approx(lp, abs=1e-4)


def test_each_row_of_a_batch_stops_at_its_own_stop_strings(engine):
    """Two greedy requests decoded in one batch, each with its own stop string: each stops at the first token
    after which its own text holds its stop (expected lengths from the tokenizer, not the engine)."""
    eng, _, tok = engine
    p = tok.encode("tell me a long story", add_special_tokens=False)
    free = asyncio.run(_many(eng, [p], SamplingParams(temperature=0.0, max_tokens=16)))[0].token_ids
    assert len(free) == 16

    def first_hit(stop):   # tokens until the decoded completion first contains `stop`
        return next(k for k in range(1, len(free) + 1) if stop in tok.decode(free[:k]))

    candidates = [tok.decode(free[i:i + 2]) for i in range(len(free) - 1)]
    stops = {}
    for s in candidates:
        if s.strip() and first_hit(s) < 16:
            stops.setdefault(first_hit(s), s)
    (k_a, stop_a), *_, (k_b, stop_b) = sorted(stops.items())
    assert k_a < k_b

    async def together():   # admitted in the same step: one batch, row 0 = the later stop
        return await asyncio.gather(
            eng.generate(p, SamplingParams(temperature=0.0, max_tokens=16, stop=(stop_b,))),
            eng.generate(p, SamplingParams(temperature=0.0, max_tokens=16, stop=(stop_a,))))

    b, a = asyncio.run(together())
    assert (a.token_ids, a.finish_reason) == (free[:k_a], "stop")
    assert (b.token_ids, b.finish_reason) == (free[:k_b], "stop")
