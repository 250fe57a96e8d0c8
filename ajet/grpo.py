"""GRPO advantages and the PPO-clip token loss, written out.

References:
    GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1 (outcome supervision: one normalised reward per output).
    PPO-clip: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.
    Asymmetric clip ("clip-higher"): Yu et al. 2025, "DAPO".
    k3 KL estimator: Schulman 2020, "Approximating KL divergence".
    Dr. GRPO (no std division): Liu et al. 2025, "Understanding R1-Zero-Like Training".

Accounting: one advantage per episode, shared by every sample the episode produced; every episode weighs
the same in the loss however many samples or tokens it yields (token-mean within an episode, then mean
over episodes), so splitting an episode into several samples does not change the gradient.
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
        norm_by_std: False drops the std division (Dr. GRPO).
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


def assign_advantages(samples: list, rewards: dict[str, float], eps: float = 1e-6, norm_by_std: bool = True) -> None:
    """Set `reward` and `advantage` on every sample: one GRPO advantage per (episode, group).

    The unit of the group statistics is the episode (or, with per-agent-tag groups, the episode's part
    for that tag), never the sample: an episode that forked into 3 samples counts once in its group's
    mean and std, and all 3 samples carry its advantage.

    Args:
        samples: `Sample`s of the step's successful episodes.
        rewards: episode_id -> scalar reward.
    """
    units = list(dict.fromkeys((s.episode_id, s.group_id) for s in samples))    # first-seen order
    adv = grpo_advantages(torch.tensor([float(rewards[e]) for e, _ in units]), [g for _, g in units], eps, norm_by_std)
    by_unit = dict(zip(units, adv.tolist()))
    for s in samples:
        s.reward, s.advantage = float(rewards[s.episode_id]), by_unit[(s.episode_id, s.group_id)]


def episode_token_weights(episode_ids: list[str], loss_tokens: list[int]) -> list[float]:
    """Per-token loss weight of each sample: 1 / (num_episodes * loss tokens of the sample's episode).

    Args:
        episode_ids: `[num_samples]` the episode of each sample.
        loss_tokens: `[num_samples]` loss-masked tokens in each sample.
    Returns:
        `[num_samples]` weights; summing weight * per-token loss over all samples gives the mean over
        episodes of each episode's token-mean loss. Episodes without loss tokens are not counted.
    """
    per_episode: dict[str, int] = defaultdict(int)
    for e, n in zip(episode_ids, loss_tokens):
        per_episode[e] += n
    live = [e for e, n in per_episode.items() if n > 0]
    if not live:
        return [0.0] * len(episode_ids)
    return [1.0 / (len(live) * per_episode[e]) if per_episode[e] else 0.0 for e in episode_ids]


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                  ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0):
    """Weighted PPO-clip surrogate (+ optional k3 KL to a reference policy), summed over tokens.

    Args:
        logprobs: `[batch, seq]` log pi_theta(token) under the current weights (requires grad).
        old_logprobs: `[batch, seq]` log pi_old(token) from the engine that sampled it.
        advantages: `[batch, seq]` (or `[batch, 1]`) advantage of each token's episode.
        weights: `[batch, seq]` per-token weight, 0 where loss_mask is 0 (see `episode_token_weights`).
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        ref_logprobs: `[batch, seq]` log pi_ref(token), needed when kl_coef > 0.
    Returns:
        (loss, stats): a scalar to call backward on, and detached floats (pg_loss, kl, clip_frac,
        ratio_mean), each a weighted mean over tokens.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)                                                # [batch, seq]
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)                                # pessimistic bound
    pg_loss = (weights * pg).sum()
    loss = pg_loss
    kl = torch.zeros((), dtype=logprobs.dtype)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        d = ref_logprobs - logprobs
        kl = (weights * (torch.exp(d) - d - 1.0)).sum()                         # k3 >= 0, unbiased
        loss = loss + kl_coef * kl
    with torch.no_grad():
        clipped = (pg_clipped > pg_unclipped).float()
        stats = {"pg_loss": float(pg_loss), "kl": float(kl), "clip_frac": float((weights * clipped).sum()),
                 "ratio_mean": float((weights * ratio).sum())}
    return loss, stats
