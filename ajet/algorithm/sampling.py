"""Dynamic sampling's group filter (Yu et al. 2025, "DAPO", sec. 3.2; verl's `filter_groups`, TRL's
`frac_reward_zero_std`).

A GRPO group whose episodes all got the same reward has advantage 0 for every episode: it adds nothing to
the policy gradient but still dilutes the batch. Dynamic sampling drops such groups and rolls out more
tasks (ajet/rollout/dynamic_sampling.py) until the step has enough groups with signal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ajet.episode import Episode

ZERO_STD_REASON = "zero_std_group"


def zero_std_groups(episodes: list[Episode]) -> list[str]:
    """The group ids whose successful episodes all have the same reward (std 0: no GRPO signal), in
    first-seen order. A group with one successful episode counts too (nothing to compare with); a group
    with none does not (it has nothing to drop: see `rollout/failed`).

    Args:
        episodes: finished episodes of one step, any order; failed ones (`not ep.ok`) are ignored.
    Returns:
        group ids, each once.
    """
    rewards: dict[str, list[float]] = {}
    for e in episodes:
        if e.ok:
            rewards.setdefault(e.group_id, []).append(float(e.reward))
    return [g for g, r in rewards.items() if max(r) == min(r)]   # one episode: trivially equal


def groups_with_signal(episodes: list[Episode]) -> list[str]:
    """The group ids of `episodes` with two or more successful episodes of different rewards, in
    first-seen order."""
    flat = set(zero_std_groups(episodes))
    return [g for g in dict.fromkeys(e.group_id for e in episodes if e.ok) if g not in flat]
