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
        temperatures: `[response_len]` temperature of the call that sampled each token (0 for a greedy
            call; 1.0 on unsampled tokens). The trainer scores each token under its own call's
            distribution (`ajet.sampling_dist.processed_logprobs`), as the engine sampled it.
        top_ps: `[response_len]` nucleus mass of the call that sampled each token (1.0 on unsampled tokens).
        reward: the episode reward (shared by all samples of an episode).
        advantage: the episode advantage (filled in by the algorithm; shared by all its samples).
        num_episode_samples: how many samples the episode produced (for per-episode loss weighting).
        flags: provenance notes, e.g. {"forked": "prefix_mismatch"}.

    Raises:
        ValueError: a per-token list whose length is not `response_len`.
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
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    reward: float = 0.0
    advantage: float = 0.0
    num_episode_samples: int = 1
    flags: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        self.temperatures = self.temperatures or [1.0] * n    # default: every token sampled at T=1, top_p=1
        self.top_ps = self.top_ps or [1.0] * n
        for name in ("loss_mask", "old_logprobs", "policy_versions", "temperatures", "top_ps"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Sample.{name} has {len(getattr(self, name))} entries; response_ids has {n}")

    @property
    def input_ids(self) -> list[int]:
        """`[prompt_len + response_len]` the full sequence."""
        return self.prompt_ids + self.response_ids

    @property
    def num_loss_tokens(self) -> int:
        """How many tokens the loss trains on (loss mask 1), tokens."""
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        """The sample as a JSON-serialisable dict of its fields (as the trajectory store keeps it)."""
        return asdict(self)
