"""The token loss: PPO-clip, loss aggregation over tokens and sequences, the k3 KL, written out.

References:
    PPO-clip: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.
    Dual-clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (`clip_ratio_c`).
    Asymmetric clip ("clip-higher") and token-mean aggregation: Yu et al. 2025, "DAPO".
    k3 KL estimator: Schulman 2020, "Approximating KL divergence".
    Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training": no std division of the advantage
        AND a constant-normalised token sum (`seq-mean-token-sum-norm`); either alone is not Dr. GRPO.
    Aggregation mode names and definitions: verl, `agg_loss` in verl/trainer/ppo/core_algos.py.
    Truncated importance sampling of off-policy tokens: Yao et al. 2025, "Your Efficient RL Framework Secretly
        Brings You Off-Policy RL Training" (TIS); verl's token-level `rollout_is` (`rollout_is_threshold`);
        the decoupled PPO objective of AReaL (Fu et al. 2025).

The trainer's "sequence" in the `seq-mean-*` modes is the EPISODE (all of its samples together), so
splitting an episode into several samples does not change the gradient; `agg_loss` offers verl's per-row
semantics.
"""

from __future__ import annotations

from collections import defaultdict

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0   # |log pi - log pi_old| is clamped here before exp (verl: [-20, 20])
KL_CLAMP = 10.0          # the k3 estimate is clamped to [-10, 10] (verl's low_var_kl)


def loss_token_weights(seq_ids: list, loss_tokens: list[int], loss_agg_mode: str = "seq-mean-token-mean",
                       loss_scale_factor: float | None = None, max_response_len: int | None = None) -> list[float]:
    """Per-token loss weight of each sample for one mini-batch, so that sum(weight * token_loss) over every
    loss-masked token of every sample equals verl's `agg_loss` of the mini-batch, however the samples are
    then cut into micro-batches (gradient accumulation gives exactly the aggregate).

    A "sequence" is all the samples sharing a `seq_ids` entry: the trainer passes episode ids (an episode
    is one sequence however many samples it forked into); pass `range(num_samples)` for verl's per-row
    semantics. With S sequences that have a loss token (a fully masked one counts in no mode, as in verl
    0.9.1), n_s loss tokens in sequence s and N = sum_s n_s (verl's definitions, one data-parallel rank,
    `global_batch_size` unset):

        token-mean               sum_t l_t / N                      (DAPO; longer sequences weigh more)
        seq-mean-token-mean      (1/S) sum_s (sum_{t in s} l_t / n_s)   (every sequence weighs the same)
        seq-mean-token-sum       (1/S) sum_s sum_{t in s} l_t
        seq-mean-token-sum-norm  (1/S) sum_s sum_{t in s} l_t / C     (Dr. GRPO; C = loss_scale_factor)

    Args:
        seq_ids: `[num_samples]` the sequence (episode) each sample belongs to.
        loss_tokens: `[num_samples]` loss-masked tokens in each sample.
        loss_agg_mode: one of `LOSS_AGG_MODES`.
        loss_scale_factor: C for seq-mean-token-sum-norm; None uses `max_response_len` (verl uses the
            padded response length, which is constant when responses are padded to the generation budget).
        max_response_len: tokens; the fallback for C.

    Returns:
        `[num_samples]` one weight per sample, applied to each of its loss-masked tokens (it multiplies no
        token of a sample without one; with N = 0 every weight is 0, where verl's token-mean divides by 0).

    Raises:
        ValueError: an unknown mode, or seq-mean-token-sum-norm without a positive C.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
    if len(seq_ids) != len(loss_tokens):
        raise ValueError(f"seq_ids ({len(seq_ids)}) and loss_tokens ({len(loss_tokens)}) must both be [num_samples]")
    per_seq: dict = defaultdict(int)
    for s, n in zip(seq_ids, loss_tokens):
        per_seq[s] += n
    S = sum(1 for n in per_seq.values() if n > 0)   # sequences with a loss token (verl 0.9.1's `seq_mask`)
    N = sum(per_seq.values())
    if loss_agg_mode == "token-mean":
        return [1.0 / N if N else 0.0] * len(seq_ids)
    if loss_agg_mode == "seq-mean-token-mean":
        return [1.0 / (S * per_seq[s]) if per_seq[s] else 0.0 for s in seq_ids]
    if loss_agg_mode == "seq-mean-token-sum":
        return [1.0 / S if S else 0.0] * len(seq_ids)
    C = loss_scale_factor if loss_scale_factor is not None else max_response_len
    if not C or C <= 0:
        raise ValueError("seq-mean-token-sum-norm needs algorithm.loss_scale_factor > 0 (or a max_response_len)")
    return [1.0 / (S * C) if S else 0.0] * len(seq_ids)


def episode_token_weights(episode_ids: list[str], loss_tokens: list[int]) -> list[float]:
    """`loss_token_weights` in mode seq-mean-token-mean over episodes: 1 / (num_episodes * loss tokens
    of the sample's episode) per token, so every episode weighs the same. Shapes as there."""
    return loss_token_weights(episode_ids, loss_tokens, "seq-mean-token-mean")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate a token loss matrix into a scalar, with verl's `agg_loss` semantics (each row one sequence).

    Args:
        loss_mat: `[batch, seq]` per-token loss.
        loss_mask: `[batch, seq]` 1 where the token counts (0/1 or bool).
        loss_agg_mode: one of `LOSS_AGG_MODES` (defined in `loss_token_weights`).
        loss_scale_factor: C of seq-mean-token-sum-norm; None uses `loss_mask.shape[-1]` as verl does.

    Returns:
        a scalar tensor (differentiable through loss_mat); masked positions never contribute, even
        when they hold inf or NaN.

    Raises:
        ValueError: an unknown mode, or shapes that differ.
    """
    if loss_mat.shape != loss_mask.shape or loss_mat.ndim != 2:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must be [batch, seq]")
    mask = loss_mask.bool()
    counts = mask.sum(-1).tolist()                                              # [batch] tokens per row
    w = torch.tensor(loss_token_weights(list(range(loss_mat.shape[0])), counts, loss_agg_mode, loss_scale_factor,
                                        loss_mat.shape[-1]), dtype=loss_mat.dtype, device=loss_mat.device)
    return torch.where(mask, loss_mat * w[:, None], torch.zeros_like(loss_mat)).sum()


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                  ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                  clip_ratio_c: float | None = None):
    """Weighted PPO-clip surrogate (+ optional dual clip, + optional k3 KL to a reference policy), summed.

        r_t      = exp(clamp(log pi_theta - log pi_old, -20, 20))
        pg_t     = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))          (PPO-clip)
        pg_t     = min(pg_t, -A clip_ratio_c)          where A < 0               (dual-clip)
        kl_t     = clamp(exp(d) - d - 1, -10, 10),  d = clamp(log pi_ref - log pi_theta, -20, 20)   (k3;
                   d = 0 where both are -inf: a token outside both nuclei under top_p < 1)
        loss     = sum_t w_t (pg_t + kl_coef kl_t)

    Args:
        logprobs: `[batch, seq]` log pi_theta(token) under the current weights (requires grad).
        old_logprobs: `[batch, seq]` log pi_old(token) from the engine that sampled it.
        advantages: `[batch, seq]` (or `[batch, 1]`) advantage of each token's episode.
        weights: `[batch, seq]` per-token weight, 0 where loss_mask is 0 (see `loss_token_weights`).
            Positions of weight 0 contribute exactly 0 to the loss and its gradient, even if their
            logprobs are -inf or NaN (padding, tokens outside the nucleus).
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        ref_logprobs: `[batch, seq]` log pi_ref(token), needed when kl_coef > 0.
        clip_ratio_c: dual-clip bound (> 1; verl's default 3.0) on the loss of negative-advantage
            tokens; None disables it.

    Returns:
        (loss, stats): a scalar to call backward on, and detached floats, each a weighted sum over tokens
        (divide by `weight_sum` for a mean): pg_loss, kl, clip_frac, dual_clip_frac, ratio_mean, weight_sum.

    Raises:
        ValueError: kl_coef > 0 without ref_logprobs; clip_ratio_c <= 1.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (got {clip_ratio_c}); use None to disable dual-clip")
    live = weights != 0                                                         # [batch, seq]
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    advantages = advantages.expand_as(logprobs)
    log_ratio = torch.where(live, logprobs - old_logprobs, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)                                                # [batch, seq]
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)                                # pessimistic bound
    dual = torch.zeros_like(live)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (pg > bound)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    pg_loss = torch.where(live, weights * pg, zero).sum()
    loss = pg_loss
    kl = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        # both -inf (the token is outside both nuclei under top_p < 1): no divergence, d = 0, not NaN
        both_zero = torch.isneginf(ref_logprobs) & torch.isneginf(logprobs)
        d = torch.where(live & ~both_zero, ref_logprobs - logprobs, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = (torch.exp(d) - d - 1.0).clamp(-KL_CLAMP, KL_CLAMP)               # >= 0, unbiased
        kl = torch.where(live, weights * k3, zero).sum()
        loss = loss + kl_coef * kl
    with torch.no_grad():
        w = torch.where(live, weights, zero)
        stats = {"pg_loss": float(pg_loss), "kl": float(kl),
                 "clip_frac": float((w * (pg_clipped > pg_unclipped)).sum()),
                 "dual_clip_frac": float((w * dual).sum()),
                 "ratio_mean": float((w * ratio).sum()), "weight_sum": float(w.sum())}
    return loss, stats


def truncated_is_weights(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float,
                         mask: torch.Tensor) -> torch.Tensor:
    """Token-level truncated importance-sampling weights for samples drawn by an older (behaviour) policy.

        w_t = min(pi_prox(x_t) / pi_behaviour(x_t), cap) = min(exp(log pi_prox - log pi_behaviour), cap)

    pi_behaviour is the policy that sampled the token (the engine's recorded logprob, possibly several
    versions old under asynchronous training); pi_prox is the policy the update starts from (the trainer's
    logprob before any weight moves). The PPO ratio is then taken against pi_prox and each token's loss is
    multiplied by w_t (decoupled PPO: AReaL, Fu et al. 2025; truncation: TIS, Yao et al. 2025; verl's
    token-level `rollout_is` with `rollout_is_threshold` = cap). No gradient flows through w_t.

    Args:
        prox_logprobs: `[batch, seq]` log pi_prox(token).
        behaviour_logprobs: `[batch, seq]` log pi_behaviour(token), the engine's.
        cap: the truncation C > 0 (verl's default threshold: 2.0).
        mask: `[batch, seq]` nonzero at the trained tokens.

    Returns:
        `[batch, seq]` detached weights in [0, cap]; 0 off the mask (whatever the logprobs hold there).

    Raises:
        ValueError: cap <= 0, or shapes that differ.
    """
    if cap <= 0:
        raise ValueError(f"the importance-sampling cap must be > 0 (got {cap})")
    if prox_logprobs.shape != behaviour_logprobs.shape or prox_logprobs.shape != mask.shape:
        raise ValueError(f"prox {tuple(prox_logprobs.shape)}, behaviour {tuple(behaviour_logprobs.shape)} and mask "
                         f"{tuple(mask.shape)} must all be [batch, seq]")
    live = mask.bool()
    zero = torch.zeros((), dtype=prox_logprobs.dtype, device=prox_logprobs.device)
    log_w = torch.where(live, prox_logprobs.detach() - behaviour_logprobs, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(live, torch.exp(log_w).clamp(max=cap), zero)


def distill_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                 weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """On-policy distillation: the per-token reverse KL to a teacher on the student's own sampled tokens,
    as a policy-gradient term (Agarwal et al. 2024, GKD; Thinking Machines, "On-Policy Distillation", 2025).

        kl_t   = log pi_old(x_t) - log pi_teacher(x_t)        (x_t sampled by the student: an unbiased
                                                              estimate of KL(pi_student || pi_teacher) at t)
        r_t    = exp(clamp(log pi_theta - log pi_old, -20, 20))
        loss   = sum_t w_t r_t kl_t                           (kl_t detached: a per-token advantage -kl_t)

    On fresh data r_t = 1 and the gradient is sum_t w_t kl_t grad log pi_theta(x_t), the score-function
    gradient of the reverse KL: tokens the teacher finds less likely than the student are pushed down.

    Args:
        logprobs: `[batch, seq]` log pi_theta (requires grad); old_logprobs: `[batch, seq]` the engine's;
        teacher_logprobs: `[batch, seq]` the teacher's logprob of the same tokens under the same temperature
            and top_p; weights: `[batch, seq]` as `ppo_clip_loss` (0 where not trained).

    Returns:
        (loss, kl): the scalar to add (times a coefficient) and the detached weighted sum of kl_t.
    """
    live = (weights != 0) & torch.isfinite(teacher_logprobs)     # a token outside the teacher's nucleus: no term
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = torch.where(live, old_logprobs - teacher_logprobs, zero).detach()                    # [batch, seq]
    ratio = torch.exp(torch.where(live, logprobs - old_logprobs, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss = torch.where(live, weights * ratio * kl, zero).sum()
    return loss, float(torch.where(live, weights * kl, zero).sum())


def sft_loss(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning: the token-level cross-entropy (negative log-likelihood) of the trained tokens,

        loss = - sum_t w_t log pi_theta(x_t)

    With w_t = 1 / N on each of the N loss-mask-1 tokens of the mini-batch (`loss_token_weights` in mode
    token-mean) this is the mean cross-entropy over those tokens, however the mini-batch is cut into
    micro-batches: what TRL's `SFTTrainer` minimises with a completion-only loss (labels -100 off the mask,
    the mean over the remaining tokens of the whole batch). On recorded traces with a reward filter it is
    rejection-sampling fine-tuning (Yuan et al. 2023, "Scaling Relationship on Learning Mathematical
    Reasoning with Large Language Models", arXiv:2308.01825).

    Args:
        logprobs: `[batch, seq]` log pi_theta(token) at temperature 1 (requires grad).
        weights: `[batch, seq]` per-token weight, 0 where the loss mask is 0; positions of weight 0 contribute
            exactly 0 to the loss and its gradient, even when their logprobs are -inf or NaN.

    Returns:
        a scalar tensor to call backward on.

    Raises:
        ValueError: shapes that differ.
    """
    if logprobs.shape != weights.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[batch, seq]")
    live = weights != 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return -torch.where(live, weights * logprobs, zero).sum()
