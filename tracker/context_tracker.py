"""The context tracker: merges an episode's calls into training samples by token prefix.

A call whose prompt ids start with everything an existing sample already holds (its prompt, the
tokens sampled since, the tokens appended between calls) extends that sample: the new tokens between
the sample's end and the call's completion get loss_mask 0, the call's sampled tokens get loss_mask 1.
A call that extends no sample (first call, edited history, a template that rewrote earlier turns)
starts a new sample, a fork. With token-in-token-out prompts (`ajet.proxy.prompt`), a multi-turn tool
conversation becomes one sample whose response holds every sampled token exactly once.
"""

from __future__ import annotations

from ajet.llm_call import LLMCall
from ajet.tracker.sample import Sample


def merge_calls(calls: list[LLMCall], group_id: str) -> list[Sample]:
    """Merge one episode's calls (in arrival order) into samples.

    Args:
        calls: recorded calls of one episode, all with the same `episode_id`.
        group_id: GRPO group key stamped on every sample.
    Returns:
        Samples in creation order; `num_episode_samples` is set on each.
    """
    samples: list[Sample] = []
    for call in calls:
        parent = _longest_prefix_sample(samples, call.prompt_ids)
        if parent is None:
            flags = {} if not samples else {"forked": call.prompt_render_reason or "prefix_mismatch"}
            samples.append(Sample(
                episode_id=call.episode_id, group_id=group_id, agent_tag=call.agent_tag, call_ids=[call.call_id],
                prompt_ids=list(call.prompt_ids), response_ids=list(call.completion_ids),
                loss_mask=[1] * len(call.completion_ids), old_logprobs=list(call.completion_logprobs),
                policy_versions=[call.policy_version] * len(call.completion_ids),
                temperature=call.sampling.temperature, flags=flags))
            continue
        gap = call.prompt_ids[len(parent.prompt_ids) + len(parent.response_ids):]  # tool results, template tokens
        parent.call_ids.append(call.call_id)
        parent.response_ids += gap + call.completion_ids
        parent.loss_mask += [0] * len(gap) + [1] * len(call.completion_ids)
        parent.old_logprobs += [0.0] * len(gap) + list(call.completion_logprobs)
        parent.policy_versions += [-1] * len(gap) + [call.policy_version] * len(call.completion_ids)
    for s in samples:
        s.num_episode_samples = len(samples)
    return samples


def _longest_prefix_sample(samples: list[Sample], prompt_ids: list[int]) -> Sample | None:
    best, best_len = None, -1
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        if n > best_len and n <= len(prompt_ids) and prompt_ids[:n] == s.input_ids:
            best, best_len = s, n
    return best
