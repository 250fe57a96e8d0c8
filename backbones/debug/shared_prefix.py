"""Shared-prefix packing for the update's forwards: a GRPO group's samples begin with the same prompt; the
transformer body runs it once per packed row, and each sample's own tokens attend to it.

A packed row holds the prefix its members share (`shared` tokens), then each member's remaining tokens (its
segment), then padding:

    tokens:     p_0 .. p_{c-1} | a_c .. a_{n_a - 1} | b_c .. b_{n_b - 1} | pad ..
    positions:  0   .. c-1     | c   .. n_a - 1     | c   .. n_b - 1     | 0 ..
    attends to: causal in the prefix | the prefix + causal in its own segment | itself

Attention is causal, so a position's hidden state depends only on the tokens up to it: each member's hidden states
are those of its own unpacked row up to float rounding (other matmul shapes), and the gradient that reaches the
shared prefix is the sum of what each member's row would send it. This is Prefix Grouper's shared-prefix forward
(Liu et al., 2025, "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward", arXiv 2506.05433),
written as sequence packing with a tree-shaped attention mask instead of their split attention. On the main job's
shape (a ~270-token prompt, ~90 response tokens) a group of 4 runs ~630 tokens instead of ~1,430.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PackedRow:
    """One packed row: `members` (indices into the packed sequences, in row order) share their first `shared`
    tokens; `length` = shared + the members' segments (tokens)."""
    members: list[int]
    shared: int
    length: int


def _row(seqs: list[list[int]], members: list[int], shared: int) -> PackedRow:
    return PackedRow(members, shared, shared + sum(len(seqs[i]) - shared for i in members))


def pack_rows(seqs: list[list[int]], max_row_tokens: int, min_shared: int = 16) -> list[PackedRow]:
    """Group sequences into packed rows, greedily in lexicographic order of their tokens (sequences that share a
    prefix are neighbours): the next sequence joins the open row when the row's members and it share at least
    `min_shared` tokens, the joined row is shorter than the row and the sequence apart, and it holds at most
    `max_row_tokens` tokens; else it opens a new row. A sequence longer than `max_row_tokens` has a row of its own.
    The rows' tokens depend only on the sequences', not on their order. Returns the rows, each sequence in one."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    rows: list[PackedRow] = []
    for i in order:
        if rows:
            last = rows[-1]
            # sorted order: the members' common prefix with i is the row's first member's with i, capped
            shared = min(last.shared, common_prefix_len(seqs[last.members[0]], seqs[i]))
            joined = _row(seqs, last.members + [i], shared)
            if shared >= min_shared and joined.length < last.length + len(seqs[i]) \
                    and joined.length <= max_row_tokens:
                rows[-1] = joined
                continue
        rows.append(PackedRow([i], len(seqs[i]), len(seqs[i])))
    return rows


@dataclass
class PackedBatch:
    """Packed rows ready for a decoder forward.

    input_ids: `[R, L]` long, 0 after each row's length (padding attends only to itself; nothing reads it).
    position_ids: `[R, L]` long, each token's position in its own sequence (0 on padding).
    attention_mask: `[R, 1, L, L]` float, 0 where a query may attend a key, the dtype's minimum elsewhere
        (transformers passes a 4-D mask to its sdpa and eager attention as it is).
    index: `[B, S]` long, where the hidden state of sequence b's position t lies in the packed output flattened
        to `[R * L, hidden]` (0 past the sequence's length).
    """
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    index: torch.Tensor


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_row_tokens: int,
         dtype: torch.dtype = torch.float32, min_shared: int = 16) -> PackedBatch | None:
    """Pack the right-padded `[B, S]` batch (`attention_mask` 1 on real tokens) into rows of `pack_rows`.

    Returns None when no two sequences share a row (the plain `[B, S]` forward is then the same work)."""
    B, S = input_ids.shape
    lengths = attention_mask.sum(1).tolist()
    seqs = [input_ids[b, :n].tolist() for b, n in enumerate(lengths)]
    rows = pack_rows(seqs, max_row_tokens, min_shared)
    if all(len(r.members) == 1 for r in rows):
        return None
    R, L = len(rows), max(r.length for r in rows)
    ids = torch.zeros((R, L), dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    allow = torch.zeros((R, L, L), dtype=torch.bool)
    index = torch.zeros((B, S), dtype=torch.long)
    for r, row in enumerate(rows):
        c = row.shared
        ids[r, :c] = torch.tensor(seqs[row.members[0]][:c], dtype=torch.long)
        pos[r, :c] = torch.arange(c)
        allow[r, :c, :c] = torch.ones((c, c), dtype=torch.bool).tril()
        start = c
        for b in row.members:
            n = len(seqs[b]) - c                                  # this member's segment: its tokens c..len-1
            end = start + n
            ids[r, start:end] = torch.tensor(seqs[b][c:], dtype=torch.long)
            pos[r, start:end] = torch.arange(c, c + n)
            allow[r, start:end, :c] = True
            allow[r, start:end, start:end] = torch.ones((n, n), dtype=torch.bool).tril()
            index[b, :c] = r * L + torch.arange(c)
            index[b, c:c + n] = r * L + torch.arange(start, end)
            start = end
        pad = torch.arange(row.length, L)
        allow[r, pad, pad] = True                                 # padding attends to itself: no empty softmax row
    mask = torch.zeros((R, 1, L, L), dtype=dtype).masked_fill(~allow[:, None], torch.finfo(dtype).min)
    dev = input_ids.device
    return PackedBatch(ids.to(dev), pos.to(dev), mask.to(dev), index.to(dev))


def supports_packing(model) -> bool:
    """Whether `model`'s decoder takes a packed batch: sdpa or eager attention (they apply a 4-D mask as given;
    flash and flex attention do not) and no sliding-window layer (a 4-D mask replaces the window)."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)        # transformers 5: per-layer "full_attention" / "sliding_attention"
    sliding = "sliding_attention" in types if types else getattr(cfg, "sliding_window", None) is not None
    return getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager") and not sliding
