"""The debug engine as an engine for agents: continuous batching, last-position logits, KV prefix reuse, and a
request path that survives failures (real tiny model, real threads and event loops)."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.engines.in_process import HFEngine
from ajet.engines.prefix_cache import PrefixCache
from ajet.llm_call import SamplingParams
from ajet.sampling_dist import processed_logprobs


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, tok


def make_engine(model, tok, **kw) -> HFEngine:
    return HFEngine(model, [tok.eos_token_id], tok.pad_token_id, max_model_len=256, decode_fn=tok.decode, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def run_all(eng, calls, return_exceptions=False):
    """Send (prompt, params) `calls` to `eng` concurrently; their completions (or exceptions), in order."""
    async def together():
        return await asyncio.gather(*(eng.generate(p, sp) for p, sp in calls), return_exceptions=return_exceptions)
    return run(together())


def engine_logprobs(model, prompt, completion, temperature, top_p=1.0):
    """The trainer's view: one unpadded forward over prompt + completion, processed logprobs of each token `[n]`."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]                     # [n, V]
    n = len(completion)
    lp = processed_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_p))
    return lp.gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


def prompts(tok):
    return [tok.encode(t, add_special_tokens=False) for t in
            ["Tom has 3 apples", "What is 0 1 2 plus", "a", "The quick brown fox jumps over the lazy dog."]]


def test_continuous_batching_gives_each_request_the_tokens_it_gets_alone(model_and_tok):
    """Requests arrive while others decode: each joins at the next step, short ones leave at once, and with a
    seeded generator per request every completion equals the one it gets alone on an idle engine."""
    model, tok = model_and_tok
    ps = prompts(tok)
    params = [SamplingParams(temperature=0.9, max_tokens=40, seed=10), SamplingParams(temperature=0.6, max_tokens=3, seed=11),
              SamplingParams(temperature=1.3, top_p=0.8, max_tokens=12, seed=12), SamplingParams(temperature=0.0, max_tokens=6)]
    # no end-of-turn id: the long request decodes all its 40 tokens while the others join and leave
    alone_engine = HFEngine(model, [], tok.pad_token_id, max_model_len=256, prefix_cache_bytes=0)
    try:
        alone = [run(alone_engine.generate(p, sp)) for p, sp in zip(ps, params)]
    finally:
        alone_engine.close()

    eng = HFEngine(model, [], tok.pad_token_id, max_model_len=256)
    order = []

    async def staggered():
        started = asyncio.Event()
        first = asyncio.create_task(eng.generate(ps[0], params[0], on_tokens=lambda d: started.set()))
        await started.wait()                           # the long request is decoding
        rest = [asyncio.create_task(eng.generate(p, sp)) for p, sp in zip(ps[1:], params[1:])]
        for i, t in enumerate([first] + rest):
            t.add_done_callback(lambda _t, i=i: order.append(i))
        return await asyncio.gather(first, *rest)

    try:
        together = run(staggered())
    finally:
        eng.close()
    assert order[-1] == 0                              # the later, shorter requests finished first
    assert len(together[0].token_ids) == 40
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_prefix_reuse_prefills_only_new_tokens_and_keeps_the_trainers_logprobs(model_and_tok):
    model, tok = model_and_tok
    eng = make_engine(model, tok)
    try:
        p1 = tok.encode("You are a helpful assistant. What is 3 + 4?", add_special_tokens=False)
        sp = SamplingParams(temperature=0.8, max_tokens=10, seed=3)
        c1 = run(eng.generate(p1, sp))
        # the episode's next call: the exact sampled ids, then a tool result
        p2 = p1 + c1.token_ids + tok.encode("<tool_response>\n7\n</tool_response>", add_special_tokens=False)
        before_prefill, before_reused = eng.prefilled_tokens, eng.prefix_cache.reused_tokens
        c2 = run(eng.generate(p2, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=4)))
        reused = eng.prefix_cache.reused_tokens - before_reused
        assert reused == len(p1) + len(c1.token_ids) - 1           # everything but the last sampled token
        assert eng.prefilled_tokens - before_prefill == len(p2) - reused
        assert c2.logprobs == pytest.approx(engine_logprobs(model, p2, c2.token_ids, 0.7, 0.9), abs=1e-4)
    finally:
        eng.close()
    cold = make_engine(model, tok, prefix_cache_bytes=0)            # the same call with a full prefill
    try:
        full = run(cold.generate(p2, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=4)))
        assert cold.prefilled_tokens == len(p2)
    finally:
        cold.close()
    assert full.token_ids == c2.token_ids
    assert full.logprobs == pytest.approx(c2.logprobs, abs=1e-5)


def test_a_group_sharing_its_prompt_prefills_it_once_and_new_weights_reuse_nothing(model_and_tok):
    model, tok = model_and_tok
    eng = make_engine(model, tok)
    p = prompts(tok)[3]
    try:
        outs = run_all(eng, [(p, SamplingParams(max_tokens=4, seed=s)) for s in range(4)])
        assert eng.prefilled_tokens == len(p) + 3                   # 3 episodes recompute only the last token
        for o in outs:
            assert o.logprobs == pytest.approx(engine_logprobs(model, p, o.token_ids, 1.0), abs=1e-4)
        eng.policy_version += 1                                     # an update: every stored KV is stale
        before = eng.prefilled_tokens
        run(eng.generate(p, SamplingParams(max_tokens=2, seed=9)))
        assert eng.prefilled_tokens - before == len(p)
    finally:
        eng.close()


def test_logits_are_computed_at_the_last_position_only(model_and_tok):
    model, tok = model_and_tok
    shapes = []
    hook = model.register_forward_hook(lambda _m, _args, out: shapes.append(tuple(out.logits.shape)))
    eng = make_engine(model, tok, prefix_cache_bytes=0)
    try:
        run_all(eng, [(p, SamplingParams(max_tokens=5, seed=1)) for p in prompts(tok)])
    finally:
        eng.close()
        hook.remove()
    assert shapes and all(s[1] == 1 for s in shapes)                # [rows, 1, vocab], never [rows, prompt, vocab]
    assert any(s[0] > 1 for s in shapes)                            # and decode steps did batch rows


def test_prefix_cache_keeps_the_budget_least_recently_used_first_and_drops_extended_entries():
    def kv(n):                                                      # 2 layers, 4 bytes x 2 x n each
        return [(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1)) for _ in range(2)]

    cache = PrefixCache(budget_bytes=16 * 10)                       # 10 tokens' worth
    cache.insert([1, 2, 3], kv(3), version=0)
    cache.insert([1, 2, 3, 4, 5], kv(5), version=0)                 # extends the first: it goes
    assert len(cache) == 1 and cache.nbytes == 16 * 5
    cache.insert([7, 8, 9, 10], kv(4), version=0)
    assert cache.lookup([1, 2, 3, 4, 5, 6], version=0)[0] == 5       # touch it: [7..10] is now the oldest
    cache.insert([20, 21], kv(2), version=0)                        # 11 tokens > 10: evict the LRU one
    assert cache.lookup([7, 8, 9, 10, 11], version=0)[0] == 0
    assert cache.lookup([1, 2, 3, 4, 5], version=0)[0] == 4          # at least one token is left to prefill
    assert cache.lookup([1, 2, 99], version=0)[0] == 2               # a shared prefix of any length
    assert cache.lookup([1, 2, 3, 4, 5, 6], version=1) == (0, None)  # other weights: nothing reused
    assert len(cache) == 0 and cache.nbytes == 0
    cache.insert(list(range(11)), kv(11), version=1)                # bigger than the budget: not kept
    assert len(cache) == 0


def test_failures_reach_the_waiting_requests_and_the_engine_keeps_serving(model_and_tok):
    model, tok = model_and_tok
    eng = make_engine(model, tok)
    good = prompts(tok)[0]
    try:
        bad, ok = run_all(eng, [([10 ** 6], SamplingParams(max_tokens=3)), (good, SamplingParams(max_tokens=3, seed=1))],
                          return_exceptions=True)
        assert isinstance(bad, RuntimeError) and "prefill failed" in str(bad)
        assert len(ok.token_ids) >= 1

        real_forward = model.forward
        calls = {"n": 0}

        def failing_decode(*args, **kwargs):                          # the 3rd forward (a decode step) fails
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("scripted decode failure")
            return real_forward(*args, **kwargs)

        model.forward = failing_decode
        try:
            outs = run_all(eng, [(p, SamplingParams(max_tokens=8, seed=2)) for p in prompts(tok)[:2]],
                           return_exceptions=True)
        finally:
            model.forward = real_forward
        assert all(isinstance(o, RuntimeError) and "scripted decode failure" in str(o) for o in outs)
        assert len(run(eng.generate(good, SamplingParams(max_tokens=3, seed=1))).token_ids) >= 1   # still serving
    finally:
        eng.close()


def test_close_fails_requests_in_flight_and_queued(model_and_tok):
    model, tok = model_and_tok
    eng = HFEngine(model, [], tok.pad_token_id, max_model_len=256, max_batch_size=1)

    async def close_while_busy():
        started = asyncio.Event()
        running = asyncio.create_task(eng.generate(prompts(tok)[0], SamplingParams(max_tokens=200),
                                                   on_tokens=lambda d: started.set()))
        queued = asyncio.create_task(eng.generate(prompts(tok)[1], SamplingParams(max_tokens=5)))
        await started.wait()
        await asyncio.to_thread(eng.close)
        return await asyncio.gather(running, queued, return_exceptions=True)

    outs = run(close_while_busy())
    assert all(isinstance(o, RuntimeError) and "shut down" in str(o) for o in outs)
    assert not eng._worker.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        run(eng.generate([1, 2], SamplingParams()))
