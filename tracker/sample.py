"""`Sample`: one training sequence built by the context tracker from an episode's calls."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Sample:
    """One root-to-leaf token sequence of an episode, ready for the RL loss.

    The sequence is `prompt_ids + response_ids` where `prompt_ids` is the first call's prompt and
    `response_ids` holds everything after it: sampled tokens (loss_mask 1) interleaved with the
    tokens the environment appended between calls (tool results, user turns, template tokens;
    loss_mask 0).

    Attributes:
        episode_id: the episode this sample comes from.
        group_id: GRPO group key (the task id, times the agent tag when grouped per tag).
        agent_tag: the agent that made the calls.
        call_ids: the recorded calls merged into this sample, in order.
        prompt_ids: `[prompt_len]` token ids never trained on.
        response_ids: `[response_len]` token ids after the prompt.
        loss_mask: `[response_len]` 1 where the engine sampled the token, else 0.
        old_logprobs: `[response_len]` engine logprobs where loss_mask is 1, else 0.0.
        policy_versions: `[response_len]` policy version that sampled each token (-1 where not sampled).
        temperature: sampling temperature of its calls (the trainer scales logits by it, as the engine did).
        reward: the episode reward (shared by all samples of an episode).
        advantage: the episode advantage (filled in by the algorithm; shared by all its samples).
        num_episode_samples: how many samples the episode produced (for per-episode loss weighting).
        flags: provenance notes, e.g. {"forked": "prefix_mismatch"}.
    """

    episode_id: str
    group_id: str
    agent_tag: str
    call_ids: list[str]
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    policy_versions: list[int]
    temperature: float = 1.0
    reward: float = 0.0
    advantage: float = 0.0
    num_episode_samples: int = 1
    flags: dict[str, Any] = field(default_factory=dict)

    @property
    def input_ids(self) -> list[int]:
        """`[prompt_len + response_len]` the full sequence."""
        return self.prompt_ids + self.response_ids

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
