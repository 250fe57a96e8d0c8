"""Shared-prefix packing (backbones/debug/shared_prefix.py): the packed layout written out by hand, and the update's
logprobs, entropies and gradients with a GRPO group's prompt run once equal those of one row per sample."""

import random
from types import SimpleNamespace

import pytest
import torch

from ajet.backbones.debug.backbone import _collate, _micro_batches, token_logprobs
from ajet.backbones.debug.shared_prefix import pack, pack_rows, supports_packing
from tests.test_update_where_trained import _backbone, _episodes, _grads_and_stats

A = [5, 6, 7, 8, 9, 10, 11, 12, 20, 21]      # shares 8 tokens with B
B = [5, 6, 7, 8, 9, 10, 11, 12, 30]
C = [40, 41, 42]                             # shares nothing


def _batch(seqs, pad=99):
    S = max(map(len, seqs))
    ids = torch.full((len(seqs), S), pad)
    attn = torch.zeros((len(seqs), S), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
    return ids, attn


def test_packed_layout_written_out():
    ids, attn = _batch([A, B, C])
    p = pack(ids, attn, max_row_tokens=100, min_shared=4)
    # row 0: the 8 shared tokens, A's 2 own tokens, B's 1; row 1: C, then padding (token 0)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 30],
                                    [40, 41, 42, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 8],
                                       [0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0]]
    # where each sequence's positions lie in the [2 * 11] flattened rows (0 past a sequence's end)
    assert p.index.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
                                [0, 1, 2, 3, 4, 5, 6, 7, 10, 0],
                                [11, 12, 13, 0, 0, 0, 0, 0, 0, 0]]
    allowed = (p.attention_mask[:, 0] == 0)                                  # [R, L, L]
    keys = lambda r, q: allowed[r, q].nonzero().flatten().tolist()
    assert keys(0, 3) == [0, 1, 2, 3]                                       # the shared prefix: causal
    assert keys(0, 8) == list(range(9))                                     # A's first own token
    assert keys(0, 9) == list(range(10))
    assert keys(0, 10) == list(range(8)) + [10]                             # B's token: the prefix and itself, not A's
    assert keys(1, 2) == [0, 1, 2]
    assert all(keys(1, q) == [q] for q in range(3, 11))                     # padding: itself only
    assert p.attention_mask.max() == 0 and p.attention_mask.min() == torch.finfo(torch.float32).min


def test_rows_follow_the_tokens_not_the_order_and_respect_the_budget():
    seqs = [A, B, C, A[:9] + [99], list(range(50, 80))]
    rows = lambda order: sorted(tuple(tuple(seqs[order[i]]) for i in r.members)
                                for r in pack_rows([seqs[i] for i in order], 100, min_shared=4))
    order = list(range(len(seqs)))
    shuffled = order[:]
    random.Random(0).shuffle(shuffled)
    assert rows(order) == rows(shuffled)
    # A, B and A's sibling share 8 tokens: one row of 8 + 2 + 1 + 2 tokens
    assert [(r.shared, r.length, len(r.members)) for r in pack_rows(seqs, 100, min_shared=4)] == \
        [(8, 13, 3), (3, 3, 1), (30, 30, 1)]
    # a budget of 12 tokens: A's sibling (9 shared with A) joins A, B (8 shared) would make 14 > 12
    assert sorted(r.length for r in pack_rows(seqs, 12, min_shared=4)) == [3, 9, 11, 30]
    # too short a shared prefix: every sequence alone
    assert all(len(r.members) == 1 for r in pack_rows(seqs, 100, min_shared=9 + 1))


def test_sliding_window_and_flash_models_are_not_packed():
    cfg = lambda **kw: SimpleNamespace(config=SimpleNamespace(**kw))
    assert supports_packing(cfg(_attn_implementation="sdpa"))
    assert supports_packing(cfg(_attn_implementation="eager", sliding_window=4096,
                                layer_types=["full_attention"] * 2))   # Qwen2 without its window
    assert not supports_packing(cfg(_attn_implementation="sdpa", layer_types=["sliding_attention", "full_attention"]))
    assert not supports_packing(cfg(_attn_implementation="sdpa", sliding_window=4096))
    assert not supports_packing(cfg(_attn_implementation="flash_attention_2"))


@pytest.fixture(scope="module")
def backbone(tiny_model_dir):
    bb = _backbone(tiny_model_dir, micro_batch_tokens=100)
    yield bb
    bb.close()


def _close(got, want, name):
    """Equal up to float rounding: the shared prompt's gradient is one sum where the rows make several (embedding
    rows of the prompt's tokens: ~1e-6 apart where the largest entry is ~4)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * max(float(want.abs().max()), 1e-3), msg=name)


def _body_tokens(bb, fn):
    """fn()'s result and the tokens the decoder body ran (the padded input's size, summed over forwards)."""
    seen = []
    h = bb.model.get_decoder().register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].numel()),
                                                         with_kwargs=True)
    try:
        return fn(), sum(seen)
    finally:
        h.remove()


def test_token_logprobs_and_gradients_as_one_row_per_sample(backbone):
    samples = _episodes(backbone)            # 3 GRPO groups of 3, prompts of 17, 9 and 23 tokens
    batch = _collate(samples, [1.0] * len(samples), backbone.tokenizer.pad_token_id, backbone.device)
    out = {}
    for share in (None, 400):
        def run(share=share):
            backbone.model.zero_grad(set_to_none=True)
            lp, ent = token_logprobs(backbone.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"],
                                     batch["top_ps"], with_entropy=True, score_mask=batch["loss_mask"],
                                     share_prefixes=share)
            torch.where(torch.isfinite(lp), lp, 0.0)[batch["loss_mask"].bool()].sum().backward()
            return lp.detach(), ent, {n: p.grad.clone() for n, p in backbone.model.named_parameters()
                                      if p.grad is not None}
        out[share] = _body_tokens(backbone, run)
    (lp_r, ent_r, g_r), tok_rows = out[None]
    (lp_s, ent_s, g_s), tok_shared = out[400]
    # 9 rows of 45 padded tokens; packed: the 17- and 23-token prompts once (the 9-token one is under min_shared)
    assert tok_rows == 9 * 45 and tok_shared == 5 * 74
    m = batch["loss_mask"].bool()
    assert torch.equal(torch.isfinite(lp_r[m]), torch.isfinite(lp_s[m]))   # outside the nucleus in both
    f = m & torch.isfinite(lp_r)
    # equal up to float32 rounding: other row lengths change the kernels' summation order (logprobs of magnitude
    # up to ~10 moved by 2.4e-6, ~5 ulps, on one CPU); a packing mistake (position ids off by one: 1.6e-3 on this
    # tiny model) moves them far more
    torch.testing.assert_close(lp_s[f], lp_r[f], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_s[m], ent_r[m], rtol=0, atol=1e-5)
    assert g_s.keys() == g_r.keys()
    for name in g_r:
        _close(g_s[name], g_r[name], name)


def test_update_gradient_and_figures_as_one_row_per_sample(backbone):
    samples = _episodes(backbone)
    items = [(s, 1.0) for s in samples]
    # packed rows never split across micro-batches: each group whose prompt is shared lies in one
    for micro in _micro_batches(items, 100, share_prefixes=True):
        groups = {s.group_id for s, _ in micro}
        assert all(sum(s.group_id == g for s, _ in micro) == 3 for g in groups - {"t1"})
    res = {}
    for share in (False, True):
        backbone.share_prefixes = share
        res[share] = _body_tokens(backbone, lambda: _grads_and_stats(backbone, samples))
    backbone.share_prefixes = True
    ((g_r, st_r), tok_r), ((g_s, st_s), tok_s) = res[False], res[True]
    assert tok_s < 0.8 * tok_r
    assert st_r["clip_frac"] > 0 and g_s.keys() == g_r.keys()
    for name in g_r:
        _close(g_s[name], g_r[name], name)
    for key in ("loss", "pg_loss", "clip_frac", "ratio_mean", "weight_sum", "_tokens", "_entropy", "_logprob_diff"):
        assert st_s[key] == pytest.approx(st_r[key], rel=1e-5, abs=1e-7), key
