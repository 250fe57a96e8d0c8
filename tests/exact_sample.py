"""The check every real-client test ends with: an episode's calls chain token for token into one sample.

The expected tokens are built independently of the proxy's prompt builder: the first prompt and every
bridge (the tokens between one call's sampled tokens and the next call's) come from `transformers`'
`apply_chat_template` over the messages the client sent, tokenized by the tokenizer itself; only the sampled
tokens come from the engine."""

from ajet.tracker import merge_calls


def expected_bridge(tokenizer, messages, tools, k: int) -> list[int]:
    """The ids after the reply at `messages[k]` (its end-of-turn token is sampled, or appended): the chat
    template's rendering of `messages` past the reply's last end-of-turn, for an append-only template."""
    eot = tokenizer.eos_token
    turn = tokenizer.apply_chat_template(messages[:k + 1], tools=tools, tokenize=False, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert full.startswith(turn) and eot in turn, "expected_bridge needs an append-only template"
    return tokenizer.encode(full[turn.rindex(eot) + len(eot):], add_special_tokens=False)


def expected_first_prompt(tokenizer, messages, tools) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_one_exact_sample(calls, engine):
    """The calls chain token for token: call 0's prompt is the template's rendering of its messages, and each
    next prompt is the previous prompt + what the engine sampled (+ end-of-turn when it sampled none) + the
    template's rendering of the new turns; their one sample trains exactly the engine's sampled tokens
    (`engine.sampled`, in call order; `engine.tokenizer` renders).

    Returns (sample, bridges): bridges are the token ids between consecutive calls (tool results, user
    turns, template tokens; loss mask 0)."""
    tok = engine.tokenizer
    assert [c.prompt_parent for c in calls] == [None] + [c.call_id for c in calls[:-1]]
    assert calls[0].prompt_render_reason == "first_call" and all(c.prompt_render_reason is None for c in calls[1:])
    (sample,) = merge_calls(calls, "g")
    seq = expected_first_prompt(tok, calls[0].messages, calls[0].tools)
    assert calls[0].prompt_ids == seq
    mask, bridges = [], []
    for i, sampled in enumerate(engine.sampled):
        seq = seq + sampled
        mask += [1] * len(sampled)
        if i + 1 < len(calls):
            nxt = calls[i + 1]
            if not sampled or sampled[-1] != tok.eos_token_id:   # cut short: the proxy closes the turn
                seq, mask = seq + [tok.eos_token_id], mask + [0]
            bridges.append(expected_bridge(tok, nxt.messages, nxt.tools, len(calls[i].messages)))
            seq = seq + bridges[-1]
            mask += [0] * len(bridges[-1])
            assert nxt.prompt_ids == seq, f"call {i + 1}'s prompt is not call {i}'s + its sampled ids + the new turns"
    assert sample.prompt_ids == calls[0].prompt_ids
    assert sample.input_ids == seq and sample.loss_mask == mask
    assert sample.num_loss_tokens == sum(map(len, engine.sampled)) and "fork_reason" not in sample.flags
    return sample, bridges
