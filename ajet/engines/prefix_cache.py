"""Per-episode KV prefix reuse for the debug engine: keep the KV of recent prompts and completions, bounded.

An agent's next call extends its previous call token for token (the proxy builds it from the exact sampled ids,
then appends the tool result and the next turn's opening), and the episodes of a GRPO group open with the same
prompt. So the engine keeps, per finished or prefilled sequence, the keys and values of every layer, and a new
prompt prefills only the tokens after the longest stored prefix it shares. Entries live in least-recently-used
order under a byte budget; an entry another one extends is dropped (the longer one serves the same prefixes);
entries computed with older weights (another policy version) are never used. With one LoRA adapter per agent
role, each entry is tagged with the adapter that computed it, and a prompt reuses only its own adapter's entries.

This is the idea of vLLM's automatic prefix caching (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention") at the granularity of whole sequences, on transformers'
`DynamicCache` tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each `[1, kv_heads, tokens, head_dim]`: one sequence's cache."""


def kv_nbytes(kv: KV) -> int:
    """Bytes held by `kv`."""
    return sum(k.nelement() * k.element_size() + v.nelement() * v.element_size() for k, v in kv)


@dataclass
class _Entry:
    tokens: torch.Tensor      # [n] long: the ids whose keys/values `kv` holds, in order
    kv: KV                    # [1, kv_heads, n, head_dim] per layer
    version: int              # the policy version of the weights that computed it
    nbytes: int
    adapter: str | None = None   # the LoRA adapter that computed it (None: the model as it is)


class PrefixCache:
    """Stored sequence KVs, looked up by the longest shared prefix.

    Args:
        budget_bytes: most bytes of keys and values kept; the least recently used entries go first. 0 disables
            the cache (`lookup` always misses, `insert` keeps nothing).

    Attributes:
        reused_tokens: prompt tokens served from the cache so far (not prefilled).
        lookups, hits: `lookup` calls, and those that reused at least one token.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()   # least recently used first
        self._next_key = 0
        self.nbytes = 0
        self.reused_tokens = 0
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt_ids: list[int], version: int, adapter: str | None = None) -> tuple[int, KV | None]:
        """The longest stored prefix of `prompt_ids` computed by policy `version` (with LoRA adapter `adapter`),
        leaving at least one prompt token to prefill (its logits give the first sampled token).

        Returns:
            (r, kv): r tokens reused and their keys/values (views of the stored tensors, `[1, kv_heads, r,
            head_dim]` per layer; never modify them in place), or (0, None).
        """
        self.lookups += 1
        for key in [k for k, e in self._entries.items() if e.version != version]:   # older weights: stale
            self._drop(key)
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        best_r, best_key = 0, None
        for key, e in self._entries.items():
            m = min(len(e.tokens), len(prompt) - 1)
            if m <= best_r or e.adapter != adapter:
                continue
            differ = (e.tokens[:m] != prompt[:m]).nonzero()
            r = m if len(differ) == 0 else int(differ[0])
            if r > best_r:
                best_r, best_key = r, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best_r
        return best_r, [(k[:, :, :best_r], v[:, :, :best_r]) for k, v in self._entries[best_key].kv]

    def insert(self, token_ids: list[int], kv: KV, version: int, adapter: str | None = None) -> None:
        """Keep `kv` (the keys/values of exactly `token_ids` under LoRA adapter `adapter`, `[1, kv_heads,
        len(token_ids), head_dim]` per layer; pass tensors nothing else will modify, and not views of a larger batch tensor, which would keep
        that whole tensor alive). Drops entries `token_ids` extends, then the least recently used ones until the
        budget holds. An entry larger than the whole budget is not kept."""
        nbytes = kv_nbytes(kv)
        if nbytes > self.budget_bytes or not token_ids:
            return
        tokens = torch.tensor(token_ids, dtype=torch.long)
        for key, e in list(self._entries.items()):
            if e.version == version and e.adapter == adapter and len(e.tokens) <= len(tokens) and torch.equal(e.tokens, tokens[:len(e.tokens)]):
                self._drop(key)                        # the new entry serves every prefix this one served
        self._entries[self._next_key] = _Entry(tokens, kv, version, nbytes, adapter)
        self._next_key += 1
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Drop every entry."""
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
