"""The prompt builder's fast paths give exactly what the slow ones give.

`PromptBuilder.render` calls the compiled chat template directly (not `apply_chat_template`, which copies
every message first), `encode` the Rust tokenizer directly, and a continuation renders once when the
template was probed append-only. Each is compared with the plain `transformers` call / the two-render
path on conversations with tools, tool calls, None-valued keys, reasoning fields, and a reply that spells
the end-of-turn token out.
"""

from __future__ import annotations

import pytest

from ajet.llm_call import LLMCall, SamplingParams
from ajet.proxy.prompt import PromptBuilder

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "hi", "name": None}],
    [{"role": "user", "content": "2?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "2"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": "because"},
     {"role": "user", "content": "z"}],
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_render_and_encode_equal_transformers(tokenizer, messages, tools):
    builder = PromptBuilder(tokenizer)
    for gen in (True, False):
        text = builder.render(messages, tools, gen)
        assert text == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
        assert builder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def _call(builder: PromptBuilder, messages, reply_text: str, tool_calls=None) -> LLMCall:
    prompt = builder.build(messages, TOOLS, [])
    reply = {"role": "assistant", "content": reply_text, **({"tool_calls": tool_calls} if tool_calls else {})}
    ids = builder.encode(reply_text) + [builder.end_of_turn_id]
    return LLMCall("c0", "e", "default", 0, messages, TOOLS, prompt.ids, ids, [0.0] * len(ids), "stop", reply,
                   SamplingParams(), 0)


@pytest.mark.parametrize("reply", ["The answer.", "I write <|im_end|> literally.", ""])
def test_one_render_continuation_equals_the_two_render_one(tokenizer, reply):
    fast, slow = PromptBuilder(tokenizer), PromptBuilder(tokenizer)
    assert fast.single_render
    slow.single_render = False
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "2?"}]
    parent = _call(fast, first, reply, [CALL])
    nxt = first + [parent.response_message, {"role": "tool", "tool_call_id": "call_1", "content": "2"},
                   {"role": "user", "content": "and?"}]
    a, b = fast.build(nxt, TOOLS, [parent]), slow.build(nxt, TOOLS, [parent])
    assert a == b and a.parent_call_id == "c0"
