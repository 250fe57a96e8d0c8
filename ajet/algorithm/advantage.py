"""Advantages: one scalar per episode from its reward and its group, written out.

References:
    grpo: Shao et al. 2024, "DeepSeekMath", sec. 4.1 (outcome supervision: one normalised reward per output).
    Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (no std division; see loss.py for the
        other half).
    rloo: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization" (leave-one-out mean).
    reinforce_plus_plus(_baseline): Hu 2025, "REINFORCE++" (arXiv 2501.03262): global batch whitening.
    Names and definitions: verl's `adv_estimator` (verl/trainer/ppo/core_algos.py, `compute_*_outcome_advantage`),
        for outcome rewards and gamma = 1 (every response token's return is the episode's reward).

Precision: the group statistics are computed in float64 on rewards divided by their largest magnitude (every
estimator is scale-equivariant: A(c r) = c A(r) for the centred ones, A(c r) = A(r) for the whitened ones up to
eps), then returned as float32, so a reward of 1e30 neither overflows a square (float32 tops out at 3.4e38) nor
zeroes the step; within `gateway.reward_range` the figures equal plain float32 arithmetic's up to rounding.

Accounting: one advantage per episode, shared by every sample the episode produced. Where verl computes a
statistic over response tokens (the REINFORCE++ whitening), an episode counts with its loss tokens, which
is what verl's token statistic gives for the episode's rows.
"""

from __future__ import annotations

from collections import defaultdict

import torch

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
WHITEN_EPS = 1e-8   # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


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
    _check(rewards, group_ids)
    adv = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for idx in _groups(group_ids).values():
        if len(idx) < 2:
            continue
        r, scale = _scaled(rewards[idx])
        centred = r - r.mean()
        std = r.std(unbiased=True)
        if norm_by_std:  # a uniform group (std 0) carries no signal: 0, never 0/0
            centred = centred / (std + eps / scale) if std > 0 else torch.zeros_like(centred)
        else:
            centred = centred * scale
        adv[idx] = centred
    return adv.float()


def _scaled(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(`values` in float64 divided by their largest magnitude, that magnitude); (as is, 1.0) when all are 0."""
    v = values.double()
    scale = float(v.abs().max()) if v.numel() else 0.0
    return (v / scale, scale) if scale > 0 else (v, 1.0)


def _groups(group_ids: list[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return members


def rloo_advantages(rewards: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean(r_group)), n the group size.

    Args:
        rewards: `[num_episodes]` scalar rewards.
        group_ids: `[num_episodes]` group key of each episode.

    Returns:
        `[num_episodes]` advantages; a group of one episode keeps its reward (A = r: no other episode to
        compare with, as verl's `compute_rloo_outcome_advantage`).

    Raises:
        ValueError: when the lengths differ.
    """
    _check(rewards, group_ids)
    adv = rewards.double().clone()
    for idx in _groups(group_ids).values():
        n = len(idx)
        if n > 1:
            r, scale = _scaled(rewards[idx])
            adv[idx] = (r - r.mean()) * scale * n / (n - 1)
    return adv.float()


def whiten(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(v_i - mean) / sqrt(var + 1e-8), mean and unbiased var over the batch with v_i counted counts_i times
    (verl's `masked_whiten` over `[batch, response]` tokens, each response token holding its row's value).

    Args:
        values: `[n]` one value per episode.
        counts: `[n]` how many times each value counts (its loss tokens; 0 leaves it out of the statistics).

    Returns:
        `[n]` whitened values; all 0 when fewer than 2 counted tokens (verl raises there; a step with one
        trained token has no batch statistic to learn from).
    """
    w = counts.double()
    total = float(w.sum())
    if total < 2:
        return torch.zeros_like(values, dtype=torch.float32)
    v, scale = _scaled(values)
    mean = (w * v).sum() / total
    var = (w * (v - mean) ** 2).sum() / (total - 1)                                # Bessel: N / (N - 1)
    denom = var + WHITEN_EPS / scale / scale       # (a huge scale: eps underflows to 0, as it should)
    if denom <= 0:                                   # equal values at a scale where eps underflows: no signal
        return torch.zeros_like(values, dtype=torch.float32)
    return ((v - mean) * torch.rsqrt(denom)).float()


def reinforce_plus_plus_advantages(rewards: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: A_i = whiten(r)_i over the whole batch (no group baseline; for tasks run once).

    Args:
        rewards: `[num_episodes]` scalar rewards.
        token_counts: `[num_episodes]` loss tokens of each episode (verl whitens over tokens).

    Returns:
        `[num_episodes]` advantages (see `whiten`).
    """
    return whiten(rewards, token_counts)


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, group_ids: list[str],
                                            token_counts: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline: A = whiten(r_i - mean(r_group)) over the whole batch; a group of
    one episode has baseline 0 (verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`).

    Args: as `rloo_advantages`, plus token_counts as `reinforce_plus_plus_advantages`.

    Returns:
        `[num_episodes]` advantages.

    Raises:
        ValueError: when the lengths differ.
    """
    _check(rewards, group_ids)
    centred, scale = _scaled(rewards)
    centred = centred.clone()
    for idx in _groups(group_ids).values():
        if len(idx) > 1:
            centred[idx] = centred[idx] - centred[idx].mean()
    return whiten(centred * scale, token_counts)


def compute_advantages(adv_estimator: str, rewards: torch.Tensor, group_ids: list[str],
                       token_counts: torch.Tensor | None = None, eps: float = 1e-6,
                       norm_by_std: bool = True) -> torch.Tensor:
    """`[num_episodes]` advantages under `adv_estimator` (one of `ADV_ESTIMATORS`, verl's names).

    token_counts `[num_episodes]` (loss tokens per episode) weighs the REINFORCE++ whitening; None counts
    each episode once. eps and norm_by_std apply to grpo only.

    Raises:
        ValueError: an unknown estimator, or lengths that differ.
    """
    if adv_estimator == "grpo":
        return grpo_advantages(rewards, group_ids, eps, norm_by_std)
    if adv_estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    counts = torch.ones(len(group_ids)) if token_counts is None else token_counts
    if adv_estimator == "reinforce_plus_plus":
        _check(rewards, group_ids)
        return reinforce_plus_plus_advantages(rewards, counts)
    if adv_estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(rewards, group_ids, counts)
    raise ValueError(f"algorithm.adv_estimator {adv_estimator!r} is not one of {ADV_ESTIMATORS}")


def _check(rewards: torch.Tensor, group_ids: list[str]) -> None:
    if rewards.ndim != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids ({len(group_ids)}) must be [num_episodes]")


def assign_advantages(samples: list, rewards: dict[str, float], episode_groups: dict[str, str] | None = None,
                      eps: float = 1e-6, norm_by_std: bool = True, adv_estimator: str = "grpo") -> None:
    """Set `reward` and `advantage` on every sample: one advantage per (episode, group), under
    `adv_estimator` (see `compute_advantages`; a unit's token count is its samples' loss tokens).

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
        ValueError: an unknown adv_estimator.
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
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    for s in samples:
        tokens[(s.episode_id, s.group_id)] += s.num_loss_tokens
    adv = compute_advantages(adv_estimator, torch.tensor([float(rewards[e]) for e, _ in units], dtype=torch.float64),
                             [g for _, g in units], torch.tensor([float(tokens[u]) for u in units]), eps, norm_by_std)
    by_unit = dict(zip(units, adv.tolist()))
    for s in samples:
        s.reward, s.advantage = float(rewards[s.episode_id]), by_unit[(s.episode_id, s.group_id)]
