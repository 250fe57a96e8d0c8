"""The sampling distribution, defined once for the engine that samples and the trainer that scores.

A token is drawn from softmax(logits / temperature) restricted to the nucleus (the smallest set of most
likely tokens whose mass reaches top_p; Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration") and renormalised. Its recorded old logprob and the trainer's new logprob are both taken
under exactly this processed distribution (vLLM calls it `processed_logprobs`), so the PPO ratio is 1 on
fresh data whatever temperature and top_p each call used.

Greedy decoding (temperature 0) is not a distribution: callers record it as such and pass temperature 1
here only to report a logprob; greedy tokens are never trained on as sampled.
"""

from __future__ import annotations

import torch


def nucleus_keep(scaled_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens are in each row's nucleus.

    Args:
        scaled_logits: `[..., vocab]` logits already divided by the temperature.
        top_p: `[...]` nucleus mass of each row, in (0, 1]; rows with top_p >= 1 keep every token.

    Returns:
        `[..., vocab]` bool, True for kept tokens: the most likely tokens, in order, up to and including
        the first one at which the cumulative probability reaches top_p (always at least one token).
    """
    probs = torch.softmax(scaled_logits.float(), dim=-1)                        # [..., V]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p                                # mass of strictly likelier tokens
    keep_sorted = mass_before < top_p.unsqueeze(-1)                             # the first token always stays
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return keep | (top_p >= 1.0).unsqueeze(-1)


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """log p(token) under the distribution tokens are sampled from: logits / T, nucleus-truncated, renormalised.

    Args:
        logits: `[..., vocab]` raw model logits (any float dtype; computed in float32).
        temperature: `[...]` (or broadcastable, e.g. `[batch, 1]` for `[batch, seq, vocab]` logits) > 0.
        top_p: `[...]` like temperature, in (0, 1]; None or all >= 1 skips the truncation (no sort).

    Returns:
        `[..., vocab]` float32 logprobs; -inf outside the nucleus. Differentiable through the kept logits
        (the nucleus itself is chosen without gradient).

    Raises:
        ValueError: a temperature <= 0 (greedy calls must not be scored as a distribution).
    """
    if bool((temperature <= 0).any()):
        raise ValueError("temperature must be > 0: greedy (temperature 0) tokens have no sampling distribution")
    scaled = logits.float() / temperature.unsqueeze(-1)                         # [..., V]
    if top_p is not None and bool((top_p < 1.0).any()):
        with torch.no_grad():
            keep = nucleus_keep(scaled.detach(), top_p.expand(scaled.shape[:-1]))
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """`[...]` entropy (nats) of each row of `[..., vocab]` logprobs; -inf entries (outside the nucleus) add 0."""
    p = logprobs.exp()
    return -(p * logprobs.masked_fill(p == 0, 0.0)).sum(-1)
