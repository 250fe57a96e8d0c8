"""The running batch's KV cache, written in place: each layer's keys and values live in a preallocated slab
`[B, kv_heads, capacity, head_dim]` with spare columns after the last token, so a decode step writes its one new
column where it goes instead of concatenating (and reallocating) the whole cache, as transformers' `DynamicLayer`
does at every token.

Why: with a `DynamicLayer` every decode step of every layer allocates a cache one column longer and frees the old
one; the freed blocks, of ever-changing sizes, stay in the engine thread's C heap (glibc keeps a thread's arena;
`ajet.heap.trim_free_memory` hands them back only when called) and the copies cost time (`torch.cat` was 11-15% of
the engine's time in a 16-32-row decode profile). A slab is reallocated only when rows join or leave the batch (a
copy the engine made anyway) or when its spare columns run out (every `spare` tokens).

The layer is a `transformers.DynamicLayer` to the model: `keys`/`values` are views `[B, H, n, D]` of the slab's
first `n` columns (what `update` returns and what attention reads), so masks, `get_seq_length` and everything else
that reads a layer see exactly a dynamic layer's tensors. The numbers are the same as a dynamic cache's; only the
strides of the views differ.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE_COLUMNS = 64    # columns (tokens) allocated past the last one; a slab grows by this much when full


class SlabLayer(DynamicLayer):
    """One layer's keys and values in slabs `[B, H, n + spare, D]`; `keys`/`values` are the views `[B, H, n, D]`.

    Args:
        k_slab, v_slab: the slabs `[B, H, capacity, D]`, their first `n` columns filled (taken, not copied).
        n: filled columns (tokens).
        spare: columns to add when the slab is full, and to leave free after a `keep` (tokens).
    """

    def __init__(self, k_slab: torch.Tensor, v_slab: torch.Tensor, n: int, spare: int = SPARE_COLUMNS):
        super().__init__()
        self.spare = spare
        self.device, self.dtype = k_slab.device, k_slab.dtype
        self.is_initialized = True
        self._k, self._v, self.n = k_slab, v_slab, n
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]           # [B, H, n, D]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` `[B, H, k, D]` after the last column (into a new slab with `k + spare`
        free columns when they do not fit); returns the keys and values of all `n + k` columns (views)."""
        k = key_states.shape[2]
        if self.n + k > self._k.shape[2]:
            self._k, self._v = _copy_to_slab(self.keys, k + self.spare), _copy_to_slab(self.values, k + self.spare)
        self._k[:, :, self.n:self.n + k] = key_states
        self._v[:, :, self.n:self.n + k] = value_states
        self.n += k
        self._views()
        return self.keys, self.values

    def keep(self, rows: torch.Tensor, first: int) -> None:
        """Keep batch rows `rows` (`[B']` long) and the columns from `first` on, in a new slab (one copy)."""
        self._k = _copy_to_slab(self._k[rows, :, first:self.n], self.spare)
        self._v = _copy_to_slab(self._v[rows, :, first:self.n], self.spare)
        self.n -= first
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


def _copy_to_slab(x: torch.Tensor, spare: int) -> torch.Tensor:
    """A new `[B, H, n + spare, D]` tensor whose first `n` columns are `x` `[B, H, n, D]` (the rest unset)."""
    B, H, n, D = x.shape
    slab = x.new_empty((B, H, n + spare, D))
    slab[:, :, :n] = x
    return slab
