"""ajet samples -> Trinity-RFT `Experience`s (trinity-rft 0.6), built from ajet's recorded token ids.

Trinity's own `convert_messages_to_experience` re-tokenizes the conversation and recomputes logprobs, losing
the ids the engine actually sampled; ajet builds the multi-turn Experience from its sample instead:

    tokens         [P + R]  prompt_ids + response_ids (sampled tokens AND the tool/user tokens between calls)
    prompt_length  P        the first call's prompt
    logprobs       [R]      the engine's logprobs (0 where not sampled); with Trinity's
                            `algorithm.bypass_old_logprobs` (default) these are the old policy
    action_mask    [R]      ajet's loss mask (bool): False on tool/user tokens
    advantages     [R]      the episode's GRPO advantage on every sampled token (0 elsewhere)
    reward                  the episode reward
    eid                     batch = the step's group prefix, task = GRPO group, run = repeat index
    info                    episode_id, group_id, agent_tag, call_ids

Trinity stacks Experiences into the same layout verl uses (prompt left-padded, response right-padded:
`trinity.common.experience.gather_*`), which tests/test_backbone_conformance_trinity.py checks tensor by tensor.
"""

from __future__ import annotations

from ajet.tracker.sample import Sample


def to_experiences(samples: list[Sample]) -> list:
    """One multi-turn `trinity.common.experience.Experience` per sample (needs `pip install 'ajet[trinity]'`).

    Raises:
        ValueError: a sample without response tokens (Trinity cannot hold an empty response).
    """
    import torch
    from trinity.common.experience import EID, Experience

    out = []
    for s in samples:
        if not s.response_ids:
            raise ValueError(f"sample of episode {s.episode_id} has no response tokens")
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)                    # [R]
        step, _, task = s.group_id.partition(":")
        out.append(Experience(
            eid=EID(batch=step, task=task or s.group_id, run=_repeat_index(s.episode_id)),
            tokens=torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.int32),   # [P + R]
            prompt_length=len(s.prompt_ids),
            logprobs=torch.tensor(s.old_logprobs, dtype=torch.float32) * mask,       # [R]
            action_mask=mask,
            advantages=torch.full((len(s.response_ids),), float(s.advantage)) * mask,  # [R]
            reward=float(s.reward),
            info={"episode_id": s.episode_id, "group_id": s.group_id, "agent_tag": s.agent_tag,
                  "call_ids": list(s.call_ids)},
        ))
    return out


def _repeat_index(episode_id: str) -> int:
    """The repeat of an ajet episode id "a<attempt>-s<step>-t<task>-r<repeat>" (0 if it has none)."""
    tail = episode_id.rpartition("-r")[2]
    return int(tail) if tail.isdigit() else 0
