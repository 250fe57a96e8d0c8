"""Context tracker: calls that extend one another merge; calls that do not, fork."""

from ajet.llm_call import LLMCall, SamplingParams
from ajet.tracker import merge_calls


def _call(i, prompt, completion, reason=None, temperature=1.0):
    return LLMCall(call_id=f"c{i}", episode_id="ep", agent_tag="default", index=i, messages=[], tools=None,
                   prompt_ids=prompt, completion_ids=completion, completion_logprobs=[-0.1 * (t % 7) for t in completion],
                   finish_reason="stop", response_message={"role": "assistant", "content": ""},
                   sampling=SamplingParams(temperature=temperature), policy_version=3, prompt_render_reason=reason)


def test_extending_calls_merge_into_one_sample():
    c0 = _call(0, [1, 2, 3], [10, 11, 2])
    c1 = _call(1, [1, 2, 3, 10, 11, 2, 50, 51], [12, 2])          # + tool result tokens 50, 51
    c2 = _call(2, [1, 2, 3, 10, 11, 2, 50, 51, 12, 2, 60], [13, 2])
    (s,) = merge_calls([c0, c1, c2], group_id="g")
    assert s.prompt_ids == [1, 2, 3]
    assert s.response_ids == [10, 11, 2, 50, 51, 12, 2, 60, 13, 2]
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
    assert s.old_logprobs[3:5] == [0.0, 0.0] and s.old_logprobs[0] == c0.completion_logprobs[0]
    assert s.policy_versions == [3, 3, 3, -1, -1, 3, 3, -1, 3, 3]
    assert s.call_ids == ["c0", "c1", "c2"] and s.num_episode_samples == 1
    assert s.flags == {"masked_unsampled_tokens": 3, "shared_prefix_tokens": 0}
    # every sampled token appears exactly once
    assert s.num_loss_tokens == sum(len(c.completion_ids) for c in (c0, c1, c2))


def test_non_extending_call_forks_with_reason():
    c0 = _call(0, [1, 2, 3], [10, 2])
    c1 = _call(1, [1, 2, 3, 99, 2, 50], [12, 2], reason="history_differs")   # history edited: 99 != 10
    c2 = _call(2, [1, 2, 3, 10, 2, 50], [13, 2])                              # continues the first one
    s0, s1 = merge_calls([c0, c1, c2], group_id="g")
    assert s0.call_ids == ["c0", "c2"] and s0.response_ids == [10, 2, 50, 13, 2]
    assert s1.call_ids == ["c1"] and s1.prompt_ids == [1, 2, 3, 99, 2, 50] and s1.loss_mask == [1, 1]
    assert s1.flags == {"fork_reason": "history_differs", "masked_unsampled_tokens": 0, "shared_prefix_tokens": 0}
    assert s0.num_episode_samples == s1.num_episode_samples == 2


def test_longest_prefix_wins_and_short_prompt_does_not_extend():
    c0 = _call(0, [1, 2], [5, 2])
    c1 = _call(1, [1, 2, 5, 2, 7], [8, 2])
    c2 = _call(2, [1, 2, 5, 2, 7, 8, 2, 9], [4, 2])
    c3 = _call(3, [1], [6, 2])                                              # shorter than any sample: fork
    s0, s1 = merge_calls([c0, c1, c2, c3], group_id="g")
    assert s0.call_ids == ["c0", "c1", "c2"]
    assert s1.call_ids == ["c3"] and s1.flags["fork_reason"] == "resampled"
    assert s0.temperatures == [1.0] * len(s0.response_ids)
