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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ajet.llm_call import LLMCall
    from ajet.tracker.sample import Sample

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
    if any(not math.isfinite(lp) for c in calls for lp in c.completion_logprobs):
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
