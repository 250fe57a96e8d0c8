"""Dynamic sampling's group filter (Yu et al. 2025, "DAPO", sec. 3.2; verl's `filter_groups`, TRL's
`frac_reward_zero_std`).

A GRPO group whose episodes all got the same reward has advantage 0 for every episode: it adds nothing to
the policy gradient but still dilutes the batch. Dynamic sampling drops such groups and rolls out more
tasks (ajet/rollout/dynamic_sampling.py) until the step has enough groups with signal.

With a success threshold (`algorithm.dynamic_sampling.success_reward`), a group in which no episode reached it
is dropped too: its reward differences are partial credit only (a format or tool bonus), and training on them
alone pays a behaviour that earns the bonus without ever solving the task, the shaping trap of
docs/algorithm.md. This is the lower bound of PRIME's online prompt filter (Cui et al. 2025, "Process
Reinforcement through Implicit Rewards", arXiv:2502.01456; verl's PRIME recipe: `data.filter_accuracy` keeps a
prompt whose rollouts' mean accuracy lies within `accuracy_lower_bound` 0.2 and `accuracy_upper_bound` 0.8) at one
success per group: inside a kept group the bonus still ranks the episodes.

A group of one episode (`rollout.num_repeat: 1`, e.g. REINFORCE++, whose baseline is the whole step) is kept,
as verl's DAPO trainer keeps it (recipe/dapo/dapo_ray_trainer.py keeps a prompt whose reward std is > 0 *or*
that has one trajectory: `std > 0 or len(prompt_uid2metric_vals[uid]) == 1`): dropping it would drop every
group, and such a run would train nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ajet.episode import Episode

ZERO_STD_REASON = "zero_std_group"
NO_SUCCESS_REASON = "no_success_group"


def zero_std_groups(episodes: list[Episode]) -> list[str]:
    """The group ids whose successful episodes all have the same reward (std 0: no GRPO signal), in
    first-seen order. A group of two or more episodes with one success counts too (nothing to compare with,
    the others failed); a group with no success does not (it has nothing to drop: see `rollout/failed`), nor
    does a group of one episode (a task run once: kept, as verl keeps it; see the module docstring).

    Args:
        episodes: finished episodes of one step, any order; failed ones (`not ep.ok`) count only in their
            group's size.

    Returns:
        group ids, each once.
    """
    sizes, rewards = _group_rewards(episodes)
    return [g for g, r in rewards.items() if max(r) == min(r) and sizes[g] > 1]   # one success of several: equal


def no_success_groups(episodes: list[Episode], success_reward: float | None) -> list[str]:
    """The group ids in which no finished episode has a reward of at least `success_reward`, in first-seen order,
    leaving out groups of one episode (kept, as in `zero_std_groups`) and groups without a finished episode
    (nothing to drop). None when `success_reward` is None: every group counts as having a success.

    Args:
        episodes: finished episodes of one step, any order; failed ones (`not ep.ok`) have no reward.
        success_reward: the reward at or above which an episode solved its task (the main job: 1.0, the
            right answer; its tool bonuses are 0.1 and 0.2), or None.

    Returns:
        group ids, each once.
    """
    if success_reward is None:
        return []
    sizes, rewards = _group_rewards(episodes)
    return [g for g, r in rewards.items() if max(r) < success_reward and sizes[g] > 1]


def _group_rewards(episodes: list[Episode]) -> tuple[dict[str, int], dict[str, list[float]]]:
    """({group: episodes in it}, {group: rewards of its successful episodes}), groups in first-seen order; a group
    without a successful episode is in the first only."""
    sizes: dict[str, int] = {}
    rewards: dict[str, list[float]] = {}
    for e in episodes:
        sizes[e.group_id] = sizes.get(e.group_id, 0) + 1
        if e.ok:
            rewards.setdefault(e.group_id, []).append(float(e.reward))
    return sizes, rewards


def groups_with_signal(episodes: list[Episode], failed_episode_policy: str = "drop_episode",
                       success_reward: float | None = None) -> list[str]:
    """The group ids of `episodes` that the update trains with a learning signal, in first-seen order: groups
    with a successful episode that are not zero-std (`zero_std_groups`) nor, with `success_reward`, without an
    episode that reached it (`no_success_groups`), minus, under `failed_episode_policy` "drop_group"
    (`rollout.failed_episode_policy`), every group with a failed episode (the trainer leaves those out whole,
    so they must not count towards the step's groups)."""
    flat = set(zero_std_groups(episodes)) | set(no_success_groups(episodes, success_reward))
    failed = {e.group_id for e in episodes if not e.ok} if failed_episode_policy == "drop_group" else set()
    return [g for g in dict.fromkeys(e.group_id for e in episodes if e.ok) if g not in flat and g not in failed]
