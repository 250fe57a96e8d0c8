"""The running batch's KV cache written in place (`ajet/engines/kv_slab.py`): a slab layer holds what a
transformers `DynamicLayer` would (checked against `torch.cat`/indexing written out here), and the engine over
it decodes rows that join and leave the batch at different steps, past the slab's spare columns, as each row
decodes alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ajet.engines.in_process import HFEngine
from ajet.engines.kv_slab import SlabLayer, drop_moves, slab_cache
from ajet.llm_call import SamplingParams


def _kv(b: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn((b, 3, n, 4), generator=torch.Generator().manual_seed(seed))      # [B, H, n, D]


def test_a_slab_layer_holds_what_concatenation_would_through_growth_selection_and_padding():
    a_k, a_v, b_k, b_v = _kv(2, 5, 1), _kv(2, 5, 2), _kv(1, 3, 3), _kv(1, 3, 4)
    cache = slab_cache([[(a_k, a_v)], [(b_k, b_v)]], spare=2)
    layer = cache.layers[0]
    assert isinstance(layer, SlabLayer) and cache.get_seq_length() == 5
    want_k = torch.cat([a_k, torch.cat([torch.zeros((1, 3, 2, 4)), b_k], dim=2)])   # b left-padded with zeros
    want_v = torch.cat([a_v, torch.cat([torch.zeros((1, 3, 2, 4)), b_v], dim=2)])
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)
    for step in range(7):                        # 2 spare columns: the slab grows on the 3rd and 6th token
        k, v = _kv(3, 1, 10 + step), _kv(3, 1, 20 + step)
        got_k, got_v = cache.update(k, v, 0)
        want_k, want_v = torch.cat([want_k, k], dim=2), torch.cat([want_v, v], dim=2)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert cache.get_seq_length() == 12
    rows = torch.tensor([0, 2])
    layer.keep(rows, 3)                           # rows 0 and 2, from column 3 on
    assert torch.equal(layer.keys, want_k[rows][:, :, 3:]) and torch.equal(layer.values, want_v[rows][:, :, 3:])
    k, v = _kv(2, 1, 99), _kv(2, 1, 98)
    got_k, _ = layer.update(k, v)
    assert torch.equal(got_k, torch.cat([want_k[rows][:, :, 3:], k], dim=2))


def _left_padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` `[b, H, m, D]` with `n - m` zero columns before it."""
    return torch.cat([torch.zeros((x.shape[0], x.shape[1], n - x.shape[2], x.shape[3])), x], dim=2)


def test_rows_join_and_leave_a_slab_in_place_as_indexing_and_concatenation_would_place_them():
    k0, v0 = _kv(3, 4, 1), _kv(3, 4, 2)
    layer = slab_cache([[(k0, v0)]], spare=2).layers[0]
    want_k, want_v = k0, v0
    storage = layer._k.data_ptr()
    # a shorter row joins: written into a new row (the slab reallocates once: it had no spare rows), zeros before it
    a_k, a_v = _kv(1, 2, 3), _kv(1, 2, 4)
    layer.append_rows([(a_k, a_v)], max_rows=8)
    want_k, want_v = torch.cat([want_k, _left_padded(a_k, 4)]), torch.cat([want_v, _left_padded(a_v, 4)])
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)
    assert layer._k.shape[0] == 8 and layer._k.data_ptr() != storage      # room for twice the rows needed
    storage = layer._k.data_ptr()
    # a longer row joins: the batch's columns grow at the front (zeros for the rows already there), in place
    b_k, b_v = _kv(1, 6, 5), _kv(1, 6, 6)
    layer.append_rows([(b_k, b_v)], max_rows=8)
    want_k, want_v = torch.cat([_left_padded(want_k, 6), b_k]), torch.cat([_left_padded(want_v, 6), b_v])
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v) and layer._k.data_ptr() == storage
    k, v = _kv(5, 1, 7), _kv(5, 1, 8)            # a decode step writes its column after the last one
    layer.update(k, v)
    want_k, want_v = torch.cat([want_k, k], dim=2), torch.cat([want_v, v], dim=2)
    # rows 0 and 3 leave: the last row takes row 0's place, row 3 is past the new end
    src, dst = drop_moves(5, [0, 3])
    assert (src, dst) == ([4], [0])
    layer.drop_rows(torch.tensor(src), torch.tensor(dst), 3)
    order = torch.tensor([4, 1, 2])
    want_k, want_v = want_k[order], want_v[order]
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v) and layer._k.data_ptr() == storage
    layer.trim_front(2)                          # the first two columns: padding in every row left
    want_k, want_v = want_k[:, :, 2:], want_v[:, :, 2:]
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v) and layer._k.data_ptr() == storage
    c_k, c_v = _kv(1, 7, 9), _kv(1, 7, 10)       # a row as long as the batch before the trim: fits in place again
    layer.append_rows([(c_k, c_v)], max_rows=8)
    want_k, want_v = torch.cat([_left_padded(want_k, 7), c_k]), torch.cat([_left_padded(want_v, 7), c_v])
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v) and layer._k.data_ptr() == storage


@pytest.mark.parametrize("rows, leaving", [(5, [0, 3]), (4, [3]), (4, [0, 1, 2, 3]), (6, [1, 2, 5]), (3, []),
                                           (7, [6, 0, 2])])
def test_drop_moves_keeps_every_staying_row_once_in_the_new_batch(rows, leaving):
    src, dst = drop_moves(rows, leaving)
    where = list(range(rows))                    # where[i]: the old row now at index i
    for s, d in zip(src, dst):
        where[d] = s
    staying = rows - len(set(leaving))
    assert sorted(where[:staying]) == [i for i in range(rows) if i not in leaving]
    assert len(src) == len(dst) == len([i for i in leaving if i < staying])     # one copy per place to fill


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model, tok


def test_rows_joining_and_leaving_at_different_steps_decode_as_each_row_alone(tiny):
    model, tok = tiny
    texts = ["What is 9 times 8?", "Tom has 3 apples and buys 4 more. How many now?", "say 3",
             "Count from 1 to 10, please, with words.", "A box holds 12 pens. How many pens are in 3 boxes?"]
    prompts = [tok.encode(t) for t in texts]
    budgets = [90, 7, 70, 3, 40]                 # rows leave at different steps; two run past 64 spare columns

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=budgets[i], seed=7 + i)

    async def run(rows: int) -> list:
        engine = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=rows,
                          max_model_len=512, prefix_cache_bytes=0, batch_wait_s=0.2 if rows > 1 else 0.0)
        try:
            if rows == 1:
                return [await engine.generate(p, params(i)) for i, p in enumerate(prompts)]
            first = [asyncio.ensure_future(engine.generate(prompts[i], params(i))) for i in (0, 1, 2)]
            while engine.generated_tokens < 10:    # the batch is decoding: the last two join it
                await asyncio.sleep(0.01)
            late = [asyncio.ensure_future(engine.generate(prompts[i], params(i))) for i in (3, 4)]
            return list(await asyncio.gather(*first, *late))
        finally:
            engine.close()

    alone = asyncio.run(asyncio.wait_for(run(1), 300))
    batched = asyncio.run(asyncio.wait_for(run(3), 300))
    compared = 0
    for a, b, budget in zip(alone, batched, budgets):
        assert len(a.token_ids) == len(b.token_ids) == budget
        same = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), budget)
        for x, y in zip(a.logprobs[:same], b.logprobs[:same]):   # batching moves logprobs in their last bits only
            assert x == pytest.approx(y, abs=1e-4)
        compared += same
    assert compared >= sum(budgets) // 2          # most tokens agree (a near-tie may part a row, then it differs)


@pytest.mark.parametrize("interval_s, trims", [(1e-9, True), (0.0, False)])
def test_the_engine_hands_freed_memory_back_when_rows_leave_unless_told_never(tiny, monkeypatch, interval_s, trims):
    import ajet.engines.in_process as engine_module

    model, tok = tiny
    calls = []
    monkeypatch.setattr(engine_module, "trim_free_memory", lambda: calls.append(1) or True)
    engine = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=4, max_model_len=256,
                      prefix_cache_bytes=0, heap_trim_interval_s=interval_s)

    async def run():
        return await asyncio.gather(*(engine.generate(tok.encode(f"count to {i}"), SamplingParams(
            temperature=1.0, max_tokens=3 + 2 * i, seed=i)) for i in range(3)))
    try:
        asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.close()
    assert (len(calls) >= 3) if trims else not calls      # rows left at three steps
