"""The tool chat template renders OpenAI messages append-only; the parser recovers tool calls."""

import json

import pytest
from transformers import AutoTokenizer

from ajet.chat_template import TOOL_CHAT_TEMPLATE, parse_tool_calls, supports_tools

TOOL = {"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2*3+1?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "2*3"}'}},
        {"id": "c2", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "1"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "6"},
    {"role": "tool", "tool_call_id": "c2", "content": "1"},
    {"role": "assistant", "content": "The answer is 7."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_renders_tools_calls_and_grouped_responses(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in text
    assert "<|im_start|>user\nWhat is 2*3+1?<|im_end|>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "1"}}\n</tool_call><|im_end|>') in text
    # both tool results in one user turn
    assert "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    no_tools = tok.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert no_tools.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>") and "# Tools" not in no_tools


def test_template_is_append_only(tok):
    """Prompt for turn k + the reply the model wrote + end-of-turn is a prefix of every later rendering.

    The assistant messages are rebuilt from generated text with `parse_tool_calls`, as the proxy does,
    so this is the property token-in-token-out prompt building needs.
    """
    generated = {2: '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1"}}\n</tool_call>',
                 5: "The answer is 7."}
    messages = []
    for k, msg in enumerate(CONVERSATION):
        if k in generated:
            prompt = tok.apply_chat_template(messages, tools=[TOOL], tokenize=False, add_generation_prompt=True)
            content, calls = parse_tool_calls(generated[k])
            messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            later = tok.apply_chat_template(messages + CONVERSATION[k + 1:], tools=[TOOL], tokenize=False,
                                            add_generation_prompt=True)
            assert later.startswith(prompt + generated[k] + "<|im_end|>\n")
            ids = tok.apply_chat_template(messages, tools=[TOOL], tokenize=True, return_dict=True)["input_ids"]
            assert tok.decode(ids) == prompt + generated[k] + "<|im_end|>\n"
        else:
            messages.append(msg)
    # the original messages (arguments given as a string and as a dict) render the same text
    assert (tok.apply_chat_template(messages, tools=[TOOL], tokenize=False)
            == tok.apply_chat_template(CONVERSATION, tools=[TOOL], tokenize=False))


def test_supports_tools():
    assert supports_tools(TOOL_CHAT_TEMPLATE)
    assert supports_tools("{% if tools %}{{ tools }}{% endif %}{% if m.role == 'tool' %}{% endif %}")
    assert not supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}") and not supports_tools(None)


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "3+4"}}\n</tool_call>', None,
     [("calculate", {"expression": "3+4"})]),
    ('Let me see.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>',
     "Let me see.", [("a", {}), ("b", {"x": 1})]),
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1"}}', None, [("calculate", {"expression": "1"})]),
    ('<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {"y": [1]}}</tool_call>',
     None, [("a", {}), ("b", {"y": [1]})]),
    ("<tool_call>{not json}</tool_call> then text", "<tool_call>{not json}</tool_call> then text", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("The answer is 7.", "The answer is 7.", []),
    ("   ", None, []),
])
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    for c in got_calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
