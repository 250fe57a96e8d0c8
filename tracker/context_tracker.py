"""The context tracker: an episode's calls -> training samples, through one token trie per agent tag.

Calls whose token sequences extend one another merge into one sample: the tokens between calls (tool
results, user turns, template tokens) get loss_mask 0, the engine's sampled tokens loss_mask 1 with
their logprobs and policy version. A call that does not extend the others forks into its own sample
(see `TokenTrie`). With token-in-token-out prompts (`ajet.proxy.prompt`), a multi-turn tool
conversation becomes one sample whose response holds every sampled token exactly once.
"""

from __future__ import annotations

from collections import Counter

from ajet.llm_call import LLMCall
from ajet.tracker.sample import Sample
from ajet.tracker.token_trie import TokenTrie


def merge_calls(calls: list[LLMCall], group_id: str, group_by_agent_tag: bool = False) -> list[Sample]:
    """Merge one episode's calls (in arrival order) into samples.

    Args:
        calls: recorded calls of one episode.
        group_id: GRPO group key stamped on every sample (suffixed with ":<tag>" when group_by_agent_tag).
    Returns:
        Samples, agent tags in first-call order, paths in insertion order. Each sample's flags hold
        `fork_reason` (why its first call left the other paths; absent for the first sample of a tag),
        `masked_unsampled_tokens` (response tokens the engine did not sample there: tool results,
        template tokens, re-rendered history) and `shared_prefix_tokens` (sampled tokens trained in an
        earlier sample of the same trie).
    """
    tries: dict[str, TokenTrie] = {}
    temperature: dict[str, float] = {}
    for call in calls:
        tries.setdefault(call.agent_tag, TokenTrie()).insert(call)
        temperature.setdefault(call.call_id, call.sampling.temperature)
    samples: list[Sample] = []
    for tag, trie in tries.items():
        branch_reason = dict(trie.branches)
        for path in trie.paths():
            start = path.sampled.index(1) if 1 in path.sampled else len(path.ids)
            flags = {"masked_unsampled_tokens": (len(path.ids) - start) - sum(path.sampled[start:]),
                     "shared_prefix_tokens": path.shared_prefix_tokens}
            reason = next((branch_reason[c] for c in path.call_ids if c in branch_reason), None)
            if reason is not None:
                flags["fork_reason"] = reason
            samples.append(Sample(
                episode_id=calls[0].episode_id, group_id=f"{group_id}:{tag}" if group_by_agent_tag else group_id,
                agent_tag=tag, call_ids=path.call_ids, prompt_ids=path.ids[:start], response_ids=path.ids[start:],
                loss_mask=path.sampled[start:], old_logprobs=path.logprobs[start:],
                policy_versions=path.policy_versions[start:],
                temperature=temperature[path.call_ids[0]] if path.call_ids else 1.0, flags=flags))
    for s in samples:
        s.num_episode_samples = len(samples)
    return samples


def fork_reasons(samples: list[Sample]) -> Counter:
    """How many samples forked, by reason (for the per-step diagnostics)."""
    return Counter(s.flags["fork_reason"] for s in samples if "fork_reason" in s.flags)
