"""A replayed turn finds its parent by the tool-call id the proxy issued, then by text (issue 22 item 1).

Real clients against a real proxy over a ScriptedEngine: the Anthropic SDK replays a Claude-Code-like
`Edit` call with the schema default `"replace_all": false` added and its keys reordered (one sample, parent
found by id); the OpenAI SDK replays a call with its arguments reformatted (`2` as `2.0`, other spacing);
a client that really edits the turn forks with `reply_edited`; a client that drops the ids falls back to
text; and the trainer counts all of it per step.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from ajet.proxy.prompt import _same_args
from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import scripted_proxy
from ajet.tracker import merge_calls

EDIT = {"name": "Edit", "description": "Replace text in a file.",
        "input_schema": {"type": "object", "required": ["file_path", "old_string", "new_string"], "properties": {
            "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
            "replace_all": {"type": "boolean", "default": False, "description": "Replace every occurrence."}}}}
EDIT_REPLY = ('I will fix it.<tool_call>\n{"name": "Edit", "arguments": {"file_path": "a.py", "old_string": "x = 1", '
              '"new_string": "x = 2"}}\n</tool_call>')
REPLIES = [EDIT_REPLY, EDIT_REPLY.replace("x = 2", "x = 3"), "Done."]


@pytest.fixture
def proxy(tokenizer):
    with scripted_proxy(tokenizer, REPLIES, max_tokens=256) as proxy_and_engine:
        yield proxy_and_engine


def _as_claude_code_replays(content) -> list[dict]:
    """The assistant turn as Claude Code sends it back: tool_use input with the schema default added, keys
    reordered (the model never wrote `replace_all`)."""
    blocks = []
    for b in content:
        d = b.model_dump(exclude_none=True)
        if d["type"] == "tool_use":
            d["input"] = {"replace_all": False, **dict(reversed(list(d["input"].items())))}
        blocks.append(d)
    return blocks


def _edit_episode(server, edit_reply=None):
    ep = server.open_episode("ep")
    client = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
    messages = [{"role": "user", "content": "Fix a.py, then b.py."}]
    for _ in range(3):
        m = client.messages.create(model="m", max_tokens=256, system="You edit files.", tools=[EDIT], messages=messages)
        if m.stop_reason != "tool_use":
            break
        blocks = _as_claude_code_replays(m.content)
        if edit_reply is not None:
            blocks = edit_reply(blocks)
        messages += [{"role": "assistant", "content": blocks},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id,
                                                   "content": "ok"}]}]
    return server.close_episode(ep)


def test_claude_code_edit_replayed_with_a_schema_default_is_one_sample(proxy):
    server, engine = proxy
    calls = _edit_episode(server)
    assert len(calls) == 3 and '"replace_all": false' in calls[2].messages[2]["tool_calls"][0]["function"]["arguments"]
    assert [c.prompt_parent_by for c in calls] == ["none", "id", "id"]
    sample, _ = assert_one_exact_sample(calls, engine)   # the model sees what it sampled, not the re-serialised call
    assert '"replace_all": false' not in server.tokenizer.decode(sample.response_ids)


def test_a_replayed_turn_whose_content_changed_forks_with_its_reason(proxy):
    server, engine = proxy

    def edit(blocks):   # the client rewrites what the model asked for, keeping the id
        return [{**b, "input": {**b["input"], "new_string": "x = 99"}} if b["type"] == "tool_use" else b
                for b in blocks]

    calls = _edit_episode(server, edit)
    assert [c.prompt_render_reason for c in calls] == ["first_call", "reply_edited", "reply_edited"]
    assert [c.prompt_parent_by for c in calls] == ["none"] * 3
    samples = merge_calls(calls, "g")
    assert len(samples) == 3 and [s.flags.get("fork_reason") for s in samples] == [None, "reply_edited", "reply_edited"]


def test_a_default_left_out_at_another_value_is_a_change(proxy):
    server, _ = proxy

    def edit(blocks):
        return [{**b, "input": {**b["input"], "replace_all": True}} if b["type"] == "tool_use" else b for b in blocks]

    calls = _edit_episode(server, edit)
    assert calls[1].prompt_render_reason == "reply_edited" and calls[1].prompt_parent is None


def test_openai_client_reformatting_arguments_continues_by_id_and_without_ids_falls_back_to_text(tokenizer):
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": [1, 2]}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "array", "items": {"type": "number"}}}}}}]
    with scripted_proxy(tokenizer, [reply, reply, "4"]) as (server, engine):
        for keep_ids in (True, False):
            engine.prompts.clear()
            engine.sampled.clear()
            ep = server.open_episode("ep")
            client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
            messages = [{"role": "user", "content": "add"}]
            for _ in range(3):
                msg = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
                if not msg.tool_calls:
                    break
                tc = msg.tool_calls[0]
                args = (json.dumps({"b": [1.0, 2], "a": 2.0}, indent=1) if keep_ids   # by id: serialisation only
                        else tc.function.arguments)                                     # by text: exact arguments
                call_id = tc.id if keep_ids else f"toolu_{len(messages)}"               # an id of the client's own
                messages += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "add", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": "3"}]
            calls = server.close_episode(ep)
            assert [c.prompt_parent_by for c in calls] == ["none"] + (["id"] * 2 if keep_ids else ["text"] * 2)
            assert_one_exact_sample(calls, engine)


@pytest.mark.parametrize("a,b,same", [
    ('{"x": 1}', '{ "x" : 1.0 }', True),
    ('{"x": 1, "y": "s"}', '{"y": "s", "x": 1}', True),
    ('{"x": 1}', '{"x": 1, "flag": false}', True),        # schema default added
    ('{"x": 1, "flag": false}', '{"x": 1}', True),        # schema default dropped
    ('{"x": 1}', '{"x": 1, "flag": true}', False),        # not the default
    ('{"x": 1}', '{"x": 1, "other": false}', False),      # no default in the schema
    ('{"x": 1}', '{"x": true}', False),                   # a bool is not a number
    ('{"x": 1}', '{"x": 2}', False),
    ('{"x": [1, 2]}', '{"x": [2, 1]}', False),
    ("not json", " not json ", True),
])
def test_arguments_compare_by_meaning(a, b, same):
    schema = {"type": "object", "properties": {"x": {}, "flag": {"type": "boolean", "default": False}, "other": {}}}
    assert _same_args(a, b, schema) is same
