"""The running batch's KV cache, written in place: each layer's keys and values live in a preallocated slab
`[B, kv_heads, capacity, head_dim]` with spare columns after the last token, so a decode step writes its one new
column where it goes instead of concatenating (and reallocating) the whole cache, as transformers' `DynamicLayer`
does at every token.

Why: with a `DynamicLayer` every decode step of every layer allocates a cache one column longer and frees the old
one; the freed blocks, of ever-changing sizes, stay in the engine thread's C heap (glibc keeps a thread's arena;
`ajet.heap.trim_free_memory` hands them back only when called) and the copies cost time (`torch.cat` was 11-15% of
the engine's time in a 16-32-row decode profile). A decode step reallocates a slab only when its spare columns run
out (every `spare` tokens).

Rows join and leave in place too (`append_rows`, `drop_rows`, `trim_front`): the slab has spare rows and free
columns before the first one in use, so a joining row is written into the next free row (its left padding zeroed),
a leaving row's place is taken by the last row (one row copied, `drop_moves`), and columns that every row has as
padding are dropped by moving where the view starts. Before, every join and every leave copied the whole batch's
cache into a new slab (29% of the engine thread's time in a profile of the main job's evaluation). The slab is
reallocated (one copy) only when it runs out of rows, of columns before the first one (a row longer than the batch
joins) or of spare columns after the last.

The layer is a `transformers.DynamicLayer` to the model: `keys`/`values` are views `[B, H, n, D]` of the slab's
rows `[0, B)` and columns `[start, start + n)` (what `update` returns and what attention reads), so masks,
`get_seq_length` and everything else that reads a layer see exactly a dynamic layer's tensors. The numbers are the
same as a dynamic cache's; only the strides of the views differ.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE_COLUMNS = 64    # columns (tokens) allocated past the last one; a slab grows by this much when full


class SlabLayer(DynamicLayer):
    """One layer's keys and values in slabs `[R, H, C, D]`; `keys`/`values` are the views `[B, H, n, D]` of rows
    `[0, B)` and columns `[start, start + n)`.

    Args:
        k_slab, v_slab: the slabs `[R, H, C, D]`, rows `[0, rows)` and columns `[start, start + n)` filled (taken,
            not copied).
        n: filled columns (tokens).
        spare: columns to add when the slab is full, and to leave free after a reallocation (tokens).
        rows: rows in use (default: all `R`).
        start: the first column in use.
    """

    def __init__(self, k_slab: torch.Tensor, v_slab: torch.Tensor, n: int, spare: int = SPARE_COLUMNS,
                 rows: int | None = None, start: int = 0):
        super().__init__()
        self.spare = spare
        self.device, self.dtype = k_slab.device, k_slab.dtype
        self.is_initialized = True
        self._k, self._v, self.n = k_slab, v_slab, n
        self.rows = k_slab.shape[0] if rows is None else rows
        self.start = start
        self._views()

    def _views(self) -> None:
        cols = slice(self.start, self.start + self.n)
        self.keys, self.values = self._k[:self.rows, :, cols], self._v[:self.rows, :, cols]     # [B, H, n, D]

    def _reallocate(self, rows: int, before: int, after: int) -> None:
        """Move the rows in use into new slabs of `rows` rows with `before` free columns before the ones in use and
        `after` after them (one copy)."""
        k, v = _copy_to_slab(self.keys, rows, before, after), _copy_to_slab(self.values, rows, before, after)
        self._k, self._v, self.start = k, v, before
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` `[B, H, k, D]` after the last column (into a new slab with `k + spare`
        free columns when they do not fit); returns the keys and values of all `n + k` columns (views)."""
        k = key_states.shape[2]
        end = self.start + self.n
        if end + k > self._k.shape[2]:
            self._reallocate(self._k.shape[0], 0, k + self.spare)
            end = self.n
        self._k[:self.rows, :, end:end + k] = key_states
        self._v[:self.rows, :, end:end + k] = value_states
        self.n += k
        self._views()
        return self.keys, self.values

    def keep(self, rows: torch.Tensor, first: int) -> None:
        """Keep batch rows `rows` (`[B']` long) and the columns from `first` on, in a new slab (one copy)."""
        self._k = _copy_to_slab(self.keys[rows, :, first:], len(rows), 0, self.spare)
        self._v = _copy_to_slab(self.values[rows, :, first:], len(rows), 0, self.spare)
        self.rows, self.start, self.n = len(rows), 0, self.n - first
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """`DynamicLayer`'s batch selection (`indices` `[B']` long), kept in a slab: `keep(indices, 0)`."""
        self.keep(indices, 0)

    def crop(self, tokens_to_remove: int) -> None:
        """`DynamicLayer`'s crop: drop the last `-tokens_to_remove` columns (the slab keeps them as spare).

        Raises:
            ValueError: `tokens_to_remove` is positive (transformers' legacy meaning, not supported).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to remove, got {tokens_to_remove}")
        self.n += tokens_to_remove
        self._views()

    # ---- rows joining and leaving in place -----------------------------------------------------------------
    def append_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]], max_rows: int) -> None:
        """Add rows after the last one: `parts` `(keys, values)` `[1, H, m_j, D]` each, left-padded with zeros to the
        batch's columns, which grow (at the front, zeros for the rows already there) to the longest `m_j`. Written
        in place into free rows and free leading columns; otherwise the slab is reallocated once, with room for
        `max_rows` rows at most (twice the rows needed, capped) and `spare` free columns on both sides."""
        need = self.rows + len(parts)
        grow = max(0, max(x[0].shape[2] for x in parts) - self.n)          # columns to add before the first one
        if need > self._k.shape[0] or grow > self.start:
            self._reallocate(max(need, min(2 * need, max_rows)), grow + self.spare, self.spare)
        if grow:
            self.start -= grow
            self.n += grow
            self._k[:self.rows, :, self.start:self.start + grow] = 0      # padding: masked, but never garbage (NaN)
            self._v[:self.rows, :, self.start:self.start + grow] = 0
        end = self.start + self.n
        for keys, values in parts:
            m, r = keys.shape[2], self.rows
            for slab, x in ((self._k, keys), (self._v, values)):
                slab[r, :, self.start:end - m] = 0
                slab[r, :, end - m:end] = x[0]
            self.rows += 1
        self._views()

    def drop_rows(self, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
        """Keep `rows` rows: first copy rows `src` into rows `dst` (`[k]` long each; `drop_moves` gives them), in the
        columns in use."""
        cols = slice(self.start, self.start + self.n)
        if len(src):
            self._k[dst, :, cols] = self._k[src, :, cols]
            self._v[dst, :, cols] = self._v[src, :, cols]
        self.rows = rows
        self._views()

    def trim_front(self, first: int) -> None:
        """Stop using the first `first` columns (padding in every row): the view starts later, nothing moves."""
        self.start += first
        self.n -= first
        self._views()


def drop_moves(rows: int, leaving: list[int]) -> tuple[list[int], list[int]]:
    """Where the rows of a batch of `rows` go when rows `leaving` leave it in place: the staying rows at or after
    the new size move into the leaving rows' places before it. Returns `(src, dst)`, equally long lists of row
    indices; row `src[i]` becomes row `dst[i]`, every other staying row keeps its index."""
    gone = set(leaving)
    size = rows - len(gone)
    src = [i for i in range(size, rows) if i not in gone]
    dst = [i for i in sorted(gone) if i < size]
    return src, dst


def slab_cache(parts: list[list[tuple[torch.Tensor, torch.Tensor]]], spare: int = SPARE_COLUMNS) -> DynamicCache:
    """A batch cache of `SlabLayer`s stacking `parts` along the batch, each left-padded with zero columns to the
    longest (each row's last token in the last column), with `spare` free columns after it.

    Args:
        parts: per part (one or more batch rows), per layer, `(keys, values)` `[b_i, H, n_i, D]`.
        spare: free columns after the last one (tokens).

    Returns:
        a `DynamicCache` whose layers are `SlabLayer`s holding `[sum b_i, H, max n_i, D]`.
    """
    rows = sum(p[0][0].shape[0] for p in parts)
    L = max(p[0][0].shape[2] for p in parts)
    layers = []
    for li in range(len(parts[0])):
        slabs = []
        for which in (0, 1):                                        # keys, values
            x0 = parts[0][li][which]
            slab = x0.new_empty((rows, x0.shape[1], L + spare, x0.shape[3]))      # [B, H, L + spare, D]
            r = 0
            for p in parts:
                x = p[li][which]
                b, n = x.shape[0], x.shape[2]
                slab[r:r + b, :, :L - n] = 0                        # padding: masked, but never garbage (NaN)
                slab[r:r + b, :, L - n:L] = x
                r += b
            slabs.append(slab)
        layers.append(SlabLayer(slabs[0], slabs[1], L, spare))
    cache = DynamicCache()
    cache.layers = layers
    return cache


def _copy_to_slab(x: torch.Tensor, rows: int, before: int, after: int) -> torch.Tensor:
    """A new `[rows, H, before + n + after, D]` tensor holding `x` `[B, H, n, D]` (`B <= rows`) in its first `B` rows
    and the columns from `before` on (the rest unset)."""
    B, H, n, D = x.shape
    slab = x.new_empty((rows, H, before + n + after, D))
    slab[:B, :, before:before + n] = x
    return slab
