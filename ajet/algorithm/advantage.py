"""Advantages: one scalar per episode from its reward and its group, written out.

References:
    GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1 (outcome supervision: one normalised reward per output).
    Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (no std division; see loss.py for the
        other half).
    Estimator names: verl's `adv_estimator` (verl/trainer/ppo/core_algos.py).

Accounting: one advantage per episode, shared by every sample the episode produced.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: list[str], eps: float = 1e-6,
                    norm_by_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps) for each episode i.

    Args:
        rewards: `[num_episodes]` scalar rewards.
        group_ids: `[num_episodes]` group key of each episode (episodes of one task in one step).
        eps: added to the std so uniform-reward groups give 0, not NaN.
        norm_by_std: False drops the std division (one half of Dr. GRPO; the other is the loss aggregation).
    Returns:
        `[num_episodes]` advantages; 0 for groups of one episode (no baseline to compare with).
    Raises:
        ValueError: when the lengths differ.
    """
    if rewards.ndim != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids ({len(group_ids)}) must be [num_episodes]")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for idx in members.values():
        if len(idx) < 2:
            continue
        r = rewards[idx].float()
        centred = r - r.mean()
        std = r.std(unbiased=True)
        if norm_by_std:  # a uniform group (std 0) carries no signal: 0, never 0/0
            centred = centred / (std + eps) if std > 0 else torch.zeros_like(centred)
        adv[idx] = centred
    return adv


def assign_advantages(samples: list, rewards: dict[str, float], episode_groups: dict[str, str] | None = None,
                      eps: float = 1e-6, norm_by_std: bool = True) -> None:
    """Set `reward` and `advantage` on every sample: one GRPO advantage per (episode, group).

    The unit of the group statistics is the episode (or, with per-agent-tag groups, the episode's part
    for that tag), never the sample: an episode that forked into 3 samples counts once in its group's
    mean and std, and all 3 samples carry its advantage. Every episode in `episode_groups` counts in its
    group's baseline, including episodes that produced no trainable sample (no call, or only calls of
    agents outside `trainable_targets`): their rewards are part of the group's mean and std.

    Args:
        samples: `Sample`s of the step's trainable episodes (possibly filtered to the trainable agents).
        rewards: episode_id -> scalar reward, for every episode in `samples` and `episode_groups`.
        episode_groups: episode_id -> the episode's GRPO group id (the task group, before any ":<tag>"
            suffix) for EVERY trainable episode of the step. None: only the episodes that have samples
            count (the baseline then ignores sample-less episodes).
    Raises:
        KeyError: a sample's episode has no reward.
    """
    if episode_groups is None:
        units = list(dict.fromkeys((s.episode_id, s.group_id) for s in samples))    # first-seen order
    else:
        # each sample group (the task group, or task group:tag) is joined by every episode of its task group
        sample_groups: dict[str, list[str]] = defaultdict(list)
        for s in samples:
            base = episode_groups.get(s.episode_id, s.group_id)
            if s.group_id not in sample_groups[base]:
                sample_groups[base].append(s.group_id)
        units = [(e, g) for e, base in episode_groups.items() for g in sample_groups.get(base, [])]
        known = set(units)
        units += [u for u in dict.fromkeys((s.episode_id, s.group_id) for s in samples) if u not in known]
    adv = grpo_advantages(torch.tensor([float(rewards[e]) for e, _ in units]), [g for _, g in units], eps, norm_by_std)
    by_unit = dict(zip(units, adv.tolist()))
    for s in samples:
        s.reward, s.advantage = float(rewards[s.episode_id]), by_unit[(s.episode_id, s.group_id)]
