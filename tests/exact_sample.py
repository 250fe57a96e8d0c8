"""The check every real-client test ends with: an episode's calls chain token for token into one sample."""

from ajet.tracker import merge_calls


def assert_one_exact_sample(calls, engine):
    """The calls chain token for token (each prompt extends the previous prompt + what the engine sampled);
    their one sample trains exactly the engine's sampled tokens (`engine.sampled`, in call order).

    Returns (sample, bridges): bridges are the token ids between consecutive calls (tool results, user
    turns, template tokens; loss mask 0)."""
    assert [c.prompt_parent for c in calls] == [None] + [c.call_id for c in calls[:-1]]
    assert calls[0].prompt_render_reason == "first_call" and all(c.prompt_render_reason is None for c in calls[1:])
    (sample,) = merge_calls(calls, "g")
    seq, mask, bridges = list(calls[0].prompt_ids), [], []
    for i, sampled in enumerate(engine.sampled):
        seq += sampled
        mask += [1] * len(sampled)
        if i + 1 < len(calls):
            nxt = calls[i + 1].prompt_ids
            assert nxt[:len(seq)] == seq
            bridges.append(nxt[len(seq):])
            seq += bridges[-1]
            mask += [0] * len(bridges[-1])
    assert sample.prompt_ids == calls[0].prompt_ids
    assert sample.input_ids == seq and sample.loss_mask == mask
    assert sample.num_loss_tokens == sum(map(len, engine.sampled)) and "fork_reason" not in sample.flags
    return sample, bridges
