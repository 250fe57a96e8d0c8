"""How an update's episodes are dealt into the PPO mini-batches of one epoch (`algorithm.mini_batches`)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def split_mini_batches(items: list[T], n: int) -> list[list[T]]:
    """Deal `items` `[num_items]` (an epoch's shuffled episode ids) round-robin into `n` mini-batches.

    Mini-batch `i` holds `items[i::k]` with `k = max(1, min(n, num_items))`: at most `num_items` mini-batches (none
    empty) whose sizes differ by at most one; no items give one empty mini-batch. Each mini-batch is one optimizer
    step of the epoch.

    Args:
        items: the items to deal, in order (`[num_items]`).
        n: the mini-batches wanted per epoch (`algorithm.mini_batches`; below 1 counts as 1).

    Returns:
        `k` lists (`[k][<= ceil(num_items / k)]`) that together hold every item once.
    """
    k = max(1, min(n, len(items)))
    return [items[i::k] for i in range(k)]
