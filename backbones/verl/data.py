"""ajet samples -> verl's `DataProto`, the batch verl's actor trains on.

verl lays a batch out as its agent loop does (`verl.experimental.agent_loop`): every row is one sequence,
the prompt LEFT-padded to the batch's longest prompt, the response RIGHT-padded to the longest response:

    prompts         [B, P]    first call's prompt ids, left-padded with pad_id
    responses       [B, R]    everything after the prompt: sampled tokens and the tokens the environment
                              appended between calls (tool results, user turns), right-padded
    input_ids       [B, P+R]  cat(prompts, responses)
    attention_mask  [B, P+R]  1 on real tokens (tool tokens included), 0 on padding
    position_ids    [B, P+R]  cumsum(attention_mask) - 1, clipped at 0 (verl's compute_position_id_with_mask)
    response_mask   [B, R]    ajet's loss mask: 1 where the engine sampled the token, 0 on tool/user tokens
    old_log_probs   [B, R]    the engine's logprobs of the sampled tokens (0 elsewhere)
    rollout_log_probs [B, R]  the same (verl's name for the engine's logprobs)
    advantages      [B, R]    the episode's GRPO advantage on every response token, times response_mask
                              (verl's compute_grpo_outcome_advantage multiplies by the mask too)

A multi-turn episode is ONE row when its calls merged (tool results inside `responses` with mask 0), and
one row per branch when it forked; `non_tensor_batch["uid"]` holds the GRPO group and `["episode_id"]` the
episode of each row. `meta_info["temperature"]` (mandatory in verl) is the rollout temperature.

`verl_batch_tensors` needs only torch (the core env tests it); `to_data_proto` wraps it in verl's class.
"""

from __future__ import annotations

from typing import Any

import torch

from ajet.tracker.sample import Sample


def verl_batch_tensors(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """The tensors of verl's actor batch for `samples` (layout in the module docstring).

    Args:
        samples: ajet samples with `advantage` set (one row each, in order).
        pad_id: the tokenizer's pad token id.

    Returns:
        {name: tensor}: ids and masks int64, logprobs and advantages float32; shapes `[B, P]`, `[B, R]`,
        `[B, P+R]` with P / R the longest prompt / response.

    Raises:
        ValueError: no samples, or a sample whose per-token lists disagree in length.
    """
    if not samples:
        raise ValueError("verl_batch_tensors needs at least one sample")
    for s in samples:
        n = len(s.response_ids)
        if not (len(s.loss_mask) == len(s.old_logprobs) == n):
            raise ValueError(f"sample of episode {s.episode_id}: response_ids ({n}), loss_mask ({len(s.loss_mask)}) "
                             f"and old_logprobs ({len(s.old_logprobs)}) must have one entry per response token")
    B = len(samples)
    P = max(len(s.prompt_ids) for s in samples)
    R = max(max(len(s.response_ids) for s in samples), 1)
    prompts = torch.full((B, P), pad_id, dtype=torch.long)
    responses = torch.full((B, R), pad_id, dtype=torch.long)
    prompt_attn = torch.zeros((B, P), dtype=torch.long)
    response_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    old_log_probs = torch.zeros((B, R), dtype=torch.float32)
    advantages = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        prompts[i, P - p:] = torch.tensor(s.prompt_ids, dtype=torch.long)         # left padding
        prompt_attn[i, P - p:] = 1
        if r:
            responses[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)     # right padding
            response_attn[i, :r] = 1
            response_mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.long)
            old_log_probs[i, :r] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        advantages[i] = s.advantage * response_mask[i].float()
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)               # [B, P+R]
    position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)     # [B, P+R]
    old_log_probs = old_log_probs * response_mask                                  # 0 where not sampled
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask,
        "old_log_probs": old_log_probs, "rollout_log_probs": old_log_probs.clone(), "advantages": advantages,
    }


def verl_non_tensors(samples: list[Sample]) -> dict[str, Any]:
    """`non_tensor_batch` of the batch: numpy object arrays `[B]` of GRPO group (`uid`, verl's name),
    episode id and agent tag of each row."""
    import numpy as np

    return {"uid": np.array([s.group_id for s in samples], dtype=object),
            "episode_id": np.array([s.episode_id for s in samples], dtype=object),
            "agent_tag": np.array([s.agent_tag for s in samples], dtype=object)}


def batch_temperature(samples: list[Sample]) -> float:
    """The one sampling temperature of the loss tokens of `samples`: verl's actor scales a whole batch's
    logits by `meta_info["temperature"]` and applies no nucleus (top_p) truncation.

    Raises:
        ValueError: the loss tokens were sampled at different temperatures, greedily (temperature 0), or with
            top_p < 1 (their engine logprobs are not verl's); the message says which setting to change.
    """
    temps = sorted({t for s in samples for t, m in zip(s.temperatures, s.loss_mask) if m})
    tops = sorted({p for s in samples for p, m in zip(s.top_ps, s.loss_mask) if m})
    if len(temps) > 1 or (temps and temps[0] <= 0):
        raise ValueError(f"verl trains a batch at one temperature > 0, but these samples' tokens were sampled at "
                         f"{temps}: set rollout.sampling_policy: config so every call uses rollout.temperature")
    if tops and tops != [1.0]:
        raise ValueError(f"verl's actor scores tokens without nucleus truncation, but these were sampled with top_p "
                         f"{tops}: set rollout.top_p: 1 (and rollout.sampling_policy: config)")
    return temps[0] if temps else 1.0


def to_data_proto(samples: list[Sample], pad_id: int, meta_info: dict[str, Any] | None = None):
    """verl's `DataProto` for `samples` (needs the `verl` package: `pip install 'ajet[verl]'`).

    Args:
        samples: ajet samples with `advantage` set.
        pad_id: the tokenizer's pad token id.
        meta_info: extra entries for `DataProto.meta_info` (e.g. global_token_num, micro_batch_size).

    Returns:
        `DataProto` with `batch` = `verl_batch_tensors`, `non_tensor_batch` = `verl_non_tensors` and
        `meta_info["temperature"]` = `batch_temperature`.
    """
    from verl import DataProto

    meta = {"temperature": batch_temperature(samples), **(meta_info or {})}
    return DataProto.from_dict(tensors=verl_batch_tensors(samples, pad_id), non_tensors=verl_non_tensors(samples),
                               meta_info=meta)
