"""Guards against silent failures in the learning signal: what the trainer checks before an update.

Each is a pure function of recorded data, so any loop (the synchronous trainer, an asynchronous one) can
call it; the trainer leaves the offending episode out of the update with the returned reason (recorded in
the ledger, `rollout/not_trained/<reason>`) and counts each guard per step (`guards/*` in metrics.jsonl,
charted by `ajet view`). The failures they catch, from the peers' issue trackers:

    out_of_vocab_token   an engine sampled an id the trainer's tokenizer has no token for (a padded
                         embedding row; rLLM PR #751: a run crashed on it); the episode is dropped
    non_finite_logprob   NaN or +-inf engine logprob of a sampled token: the PPO ratio would be NaN or 0
    empty_loss_samples   a sample with no loss token (everything masked) trains nothing (rLLM #352);
                         counted, it adds nothing to the loss
    stale_policy         a call served by weights more than `max_staleness` updates behind the trainer's
                         (ART #661: training on stale weights); dropped or only counted, by config

and one the backbones check inside the update, on every optimizer step:

    nonfinite_skipped    a NaN or +-inf loss or gradient norm: the optimizer step is skipped (gradients zeroed,
                         weights and optimizer state unchanged), counted (`train/nonfinite_skipped`) and said in a
                         loud line on stderr (`report_nonfinite`); `ajet gateway` never serves such an update
                         (ajet/gateway/gate.py). verl's FSDP engine skips such a step itself (its
                         `optimizer_step`); ajet's verl and Trinity backbones count it from verl's figures
"""

from __future__ import annotations

import logging
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ajet.llm_call import LLMCall
    from ajet.tracker.sample import Sample

log = logging.getLogger(__name__)
NONFINITE_SKIPPED = "nonfinite_skipped"
OUT_OF_VOCAB = "out_of_vocab_token"
NON_FINITE_LOGPROB = "non_finite_logprob"
STALE_POLICY = "stale_policy"


def sampled_token_reason(calls: list[LLMCall], vocab_size: int) -> str | None:
    """Why an episode's sampled tokens cannot be trained on, or None when they can.

    Args:
        calls: the episode's recorded calls (`completion_ids`, `completion_logprobs`: `[completion_len]`).
        vocab_size: number of ids the trainer's tokenizer knows (valid ids are 0 .. vocab_size - 1).

    Returns:
        OUT_OF_VOCAB when a sampled id is outside [0, vocab_size); else NON_FINITE_LOGPROB when an engine
        logprob of a sampled token is NaN or +-inf; else None.
    """
    if any(not 0 <= t < vocab_size for c in calls for t in c.completion_ids):
        return OUT_OF_VOCAB
    if any(lp is None or not math.isfinite(lp) for c in calls for lp in c.completion_logprobs):   # None: stored NaN
        return NON_FINITE_LOGPROB
    return None


def empty_loss_samples(samples: list[Sample]) -> int:
    """How many of `samples` have no loss-masked token (they add nothing to the update)."""
    return sum(1 for s in samples if s.num_loss_tokens == 0)


def policy_lag(calls: list[LLMCall], policy_version: int) -> int:
    """How many updates behind `policy_version` (the weights the update starts from) the oldest call of
    `calls` was served; 0 for an episode without calls or served entirely by the current weights."""
    return max((policy_version - c.policy_version for c in calls), default=0)


def stale_policy_reason(calls: list[LLMCall], policy_version: int, max_staleness: int | None) -> str | None:
    """STALE_POLICY when a call of the episode was served by weights more than `max_staleness` updates
    behind `policy_version` (None: no bound, never stale); else None."""
    if max_staleness is None:
        return None
    return STALE_POLICY if policy_lag(calls, policy_version) > max_staleness else None


def nonfinite_figure(stats: dict[str, Any]) -> str | None:
    """The first loss or gradient-norm figure of one optimizer step's `stats` that is NaN or +-inf, as
    "name=value" (keys named `loss`, `grad_norm` or ending in `_loss`, `/loss`, `/grad_norm`, e.g. verl's
    `actor/pg_loss`); None when all are finite (or absent)."""
    for k, v in stats.items():
        name = k.rsplit("/", 1)[-1]
        if (name in ("loss", "grad_norm") or name.endswith("_loss")) and isinstance(v, (int, float)) \
                and not math.isfinite(v):
            return f"{k}={v}"
    return None


def report_nonfinite(where: str, figure: str) -> None:
    """The loud line of a skipped optimizer step (stderr and the log): what was non-finite and where."""
    line = (f"NON-FINITE {figure} in {where}: optimizer step SKIPPED (gradients zeroed; weights and optimizer state "
            f"unchanged; counted in train/{NONFINITE_SKIPPED}). Look for a huge or NaN reward or advantage, or a "
            f"learning rate too high")
    print(line, file=sys.stderr, flush=True)
    log.warning(line)


def grad_norm_of(metrics: dict[str, Any]) -> float | None:
    """An update's gradient norm figure: `grad_norm`, else the first key ending in `/grad_norm` (verl and Trinity:
    `actor/grad_norm`; not a per-adapter `train/<adapter>/grad_norm` when the plain one is there); None if absent."""
    if "grad_norm" in metrics:
        return metrics["grad_norm"]
    return next((v for k, v in metrics.items() if k.endswith("/grad_norm")), None)


def not_a_new_version(metrics: dict[str, Any]) -> str | None:
    """Why an update whose figures are `metrics` must not become a new served policy, or None: an optimizer step
    was skipped for a non-finite loss or gradient norm, or no step moved the weights (no optimizer step, or a zero
    gradient norm: every advantage 0)."""
    skipped = metrics.get(NONFINITE_SKIPPED, 0)
    if skipped:
        return f"{int(skipped)} optimizer step(s) had a non-finite loss or gradient norm and were skipped"
    if metrics.get("optimizer_steps", 1) == 0:
        return "the update made no optimizer step (no sample with a loss token)"
    norm = grad_norm_of(metrics)
    if norm is not None and norm == 0:
        return "the update's gradient was zero (every advantage 0): the weights did not move"
    return None
