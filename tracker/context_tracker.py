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


def merge_calls(calls: list[LLMCall], group_id: str, group_by_agent_tag: bool = False,
                train_greedy_calls: bool = False) -> list[Sample]:
    """Merge one episode's calls (in arrival order) into samples.

    Each sampled token carries the temperature and top_p of the call that sampled it (`Sample.temperatures`,
    `Sample.top_ps`), so calls made at different temperatures merge into one sample and are still scored
    each under its own distribution. Tokens of a greedy call (temperature 0) were not sampled from a
    distribution: they keep loss mask 0 (counted in `flags["greedy_tokens"]`) unless train_greedy_calls.

    Args:
        calls: recorded calls of one episode.
        group_id: GRPO group key stamped on every sample (suffixed with ":<tag>" when group_by_agent_tag).
        train_greedy_calls: keep loss mask 1 on greedy tokens (the trainer then scores them at T=1).

    Returns:
        Samples, agent tags in first-call order, paths in insertion order. Each sample's flags hold
        `fork_reason` (why its first call left the other paths; absent for the first sample of a tag),
        `masked_unsampled_tokens` (response tokens the engine did not sample there: tool results,
        template tokens, re-rendered history) and `shared_prefix_tokens` (sampled tokens trained in an
        earlier sample of the same trie) and `greedy_tokens` (tokens of greedy calls, masked unless
        train_greedy_calls; absent when 0).
    """
    tries: dict[str, TokenTrie] = {}
    sampling = {}
    for call in calls:
        tries.setdefault(call.agent_tag, TokenTrie()).insert(call)
        sampling.setdefault(call.call_id, call.sampling)
    samples: list[Sample] = []
    for tag, trie in tries.items():
        branch_reason = dict(trie.branches)
        for path in trie.paths():
            start = path.sampled.index(1) if 1 in path.sampled else len(path.ids)
            by = path.sampled_by[start:]                                # [response_len] call id or None
            temperatures = [sampling[c].temperature if c else 1.0 for c in by]
            top_ps = [sampling[c].top_p if c else 1.0 for c in by]
            greedy = [int(c is not None and t == 0) for c, t in zip(by, temperatures)]
            loss_mask = [m * (1 - g) for m, g in zip(path.sampled[start:], greedy)] if not train_greedy_calls \
                else path.sampled[start:]
            flags = {"masked_unsampled_tokens": (len(path.ids) - start) - sum(path.sampled[start:]),
                     "shared_prefix_tokens": path.shared_prefix_tokens}
            if any(greedy):
                flags["greedy_tokens"] = sum(greedy)
            reason = next((branch_reason[c] for c in path.call_ids if c in branch_reason), None)
            if reason is not None:
                flags["fork_reason"] = reason
            samples.append(Sample(
                episode_id=calls[0].episode_id, group_id=f"{group_id}:{tag}" if group_by_agent_tag else group_id,
                agent_tag=tag, call_ids=path.call_ids, prompt_ids=path.ids[:start], response_ids=path.ids[start:],
                loss_mask=loss_mask, old_logprobs=path.logprobs[start:], policy_versions=path.policy_versions[start:],
                temperatures=temperatures, top_ps=top_ps, flags=flags))
    for s in samples:
        s.num_episode_samples = len(samples)
    return samples


def fork_reasons(samples: list[Sample]) -> Counter:
    """How many samples forked, by reason (for the per-step diagnostics)."""
    return Counter(s.flags["fork_reason"] for s in samples if "fork_reason" in s.flags)
