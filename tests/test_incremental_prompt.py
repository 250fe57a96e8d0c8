"""Incremental prompt building gives the full path's prompt ids, for every chat template the tests use.

A continuation's new turns are rendered alone (the parent's last message + the reply + the new turns) instead
of read off a render of the whole conversation (`ajet/proxy/prompt.py`, "Incremental rendering"). Each episode
below is built twice, by a builder that may take the incremental path and by one that never does, and every
prompt must be the same ids; where the template allows, both must also be what `apply_chat_template` gives
(built here without the prompt builder: the parent's prompt ids + its sampled ids + the template's rendering of
the whole conversation past the reply's end). Each test also checks that the incremental path was taken, so
that a path that silently falls back is caught.

Templates: the tool template of the tiny model and of SmolLM2 (its 49k BPE), SmolLM2's own text-only template,
the Qwen3-style and DeepSeek-R1-style templates that drop earlier thinking, a Qwen3-like one that re-renders
thinking after the last real user query, a Llama-3-like layout (tools in the first user turn, no separator
after the end-of-turn), the two templates with an unusual end-of-turn (none after a reply; one per tool call),
the two custom templates `tests/test_model.py` loads (message contents alone, no roles or end-of-turn; a constant
text), and the templates that rewrite earlier turns (which never take the incremental path).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ajet.chat_template import TOOL_CHAT_TEMPLATE, parse_tool_calls
from ajet.llm_call import LLMCall, SamplingParams
from ajet.model import load_tokenizer, resolve_model_path
from ajet.proxy.prompt import PromptBuilder
from tests.test_prompt_fast_paths import DROP_ANSWERED, LONG, TURN_PER_CALL
from tests.test_tracker_failure_modes import COUNTING, QWEN3_STYLE, R1_STYLE


def _replace(template: str, old: str, new: str, count: int = -1) -> str:
    assert old in template
    return template.replace(old, new, count)


# no end-of-turn after an assistant turn (the sampled one stays in the prompt)
DROP_EOT = _replace(TOOL_CHAT_TEMPLATE, "{%- endfor -%}{{- '<|im_end|>\\n' -}}", "{%- endfor -%}{{- '\\n' -}}")
# Qwen3-like: thinking (a <think> block in the text or a reasoning_content field) is re-rendered as
# "<think>\n...\n</think>\n\n" for assistant turns after the last user turn that is not a wrapped tool response,
# and dropped before it
QWEN3_QUERY_STYLE = _replace(_replace(
    TOOL_CHAT_TEMPLATE, "{%- set c = text(m.content) -%}",
    "{%- set c = text(m.content) -%}"
    "{%- set r = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if '</think>' in c -%}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > last_query and r -%}{%- set c = '<think>\\n' + r + '\\n</think>\\n\\n' + c -%}{%- endif -%}"),
    "{%- for m in rest -%}",
    "{%- set ns = namespace(q=-1) -%}{%- for m in rest -%}{%- if m.role == 'user' and not "
    "text(m.content).startswith('<tool_response>') -%}{%- set ns.q = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- set last_query = ns.q -%}{%- for m in rest -%}", 1)
# Llama-3-like layout: a blank line after each role header, no separator after the end-of-turn, the tools in
# the first user turn, tool results as "ipython" turns, tool calls as JSON objects
LLAMA_STYLE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{- c -}}{%- elif c -%}{%- for p in c -%}{{- p.text -}}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
    "{%- set ns = namespace(first_user=true) -%}"
    "{{- '<|im_start|>system\\n\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- text(messages[0].content) -}}{%- set rest = messages[1:] -%}"
    "{%- else -%}{{- 'Cutting Knowledge Date: December 2023' -}}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- for m in rest -%}"
    "{%- if m.role == 'user' -%}{{- '<|im_start|>user\\n\\n' -}}"
    "{%- if ns.first_user and tools -%}{{- 'Functions:\\n' -}}{%- for t in tools -%}{{- t | tojson + '\\n' -}}"
    "{%- endfor -%}{%- set ns.first_user = false -%}{%- endif -%}{{- text(m.content) + '<|im_end|>' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n\\n' + text(m.content) -}}"
    "{%- for tc in (m.tool_calls or []) -%}{{- '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' + "
    "(tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) + '}' -}}"
    "{%- endfor -%}{{- '<|im_end|>' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_start|>ipython\\n\\n' + text(m.content) + '<|im_end|>' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n\\n' + text(m.content) + '<|im_end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n\\n' -}}{%- endif -%}")
# a new user turn is marked when the conversation's first user turn says "SPECIAL": what a new turn renders as
# depends on a message far from it, which the probe never shows; only checking the shape against the full
# path finds it
SPECIAL = _replace(TOOL_CHAT_TEMPLATE, "{{- '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' -}}",
                   "{{- '<|im_start|>' + m.role + '\\n' + ('[!] ' if m.role == 'user' and not loop.first and "
                   "text(rest[0].content) == 'SPECIAL' else '') + text(m.content) + '<|im_end|>\\n' -}}")

# the custom templates tests/test_model.py loads: message contents alone (no roles, no end-of-turn), a constant text
CONTENT_ONLY = "{% for m in messages %}{{ m.content }}{% endfor %}"
CONSTANT = "{{ 'x' }}"

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} a path.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
    "required": ["path"]}}} for name in ("read", "edit")]


def _tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# (what the model samples, what the client sends next: the tool results of its calls by content, then turns)
AGENT = [
    ("<think>Look first.</think>" + _tool_call("read", path="a.py"), ["def f(): return 1"], []),
    (_tool_call("read", path="a.py") + "\n" + _tool_call("read", path="b.py"), ["A", "B"], []),
    ("Found it.\n" + _tool_call("edit", path="a.py", text="return 2"), ["ok"], []),
    ("<think>Done?</think>Done: f returns 2.", [], [{"role": "user", "content": "Also add a test."}]),
    ("Sure, one moment", [], [{"role": "user", "content": [{"type": "text", "text": "Go on."}]}]),  # cut short
    ("<think>ok</think>" + _tool_call("edit", path="t.py", text="assert f() == 2"), ["ok"],
     [{"role": "user", "content": "and the docs?"}]),
    ("No docs to change.", [], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"}]),
    ("Bye.", [], []),
]
CHAT = [("Hello! How can I help?", [], [{"role": "user", "content": "What is 6 * 7?"}]),
        ("6 * 7 = 42.", [], [{"role": "user", "content": "And 6 * 8?"}]),
        ("48.", [], [{"role": "user", "content": "Thanks."}]),
        ("You are welcome.", [], [{"role": "user", "content": "Bye."}]),
        ("Bye.", [], [])]


def _episode(builders, first, script, tools, by_id=True):
    """Run `script` through each builder (the first is the incremental one); returns the prompts per builder
    and the recorded calls (built from the first builder's prompts). A reply is sampled as its text's ids + the
    end-of-turn id (none when the text ends "moment": cut by max_tokens); the client replays the parsed reply
    (its tool-call ids kept when `by_id`, else new ones), then its tool results, then its turns."""
    tok = builders[0].tokenizer
    messages, calls, prompts = list(first), [], [[] for _ in builders]
    for i, (reply, results, turns) in enumerate(script):
        built = [b.build(messages, tools, calls, {c.call_id: p.text for c, p in zip(calls, prompts[0])})
                 for b in builders]
        for out, p in zip(prompts, built):
            out.append(p)
        sampled = tok.encode(reply, add_special_tokens=False) + ([] if reply.endswith("moment") else [tok.eos_token_id])
        content, tool_calls = parse_tool_calls(reply) if tools else (reply, [])
        message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        calls.append(LLMCall(f"c{i}", "e", "default", i, list(messages), tools, built[0].ids, sampled,
                             [0.0] * len(sampled), "stop", message, SamplingParams(), 0))
        replay = message if by_id else {**message, "tool_calls": [{**tc, "id": f"client_{i}_{j}"}
                                                                    for j, tc in enumerate(tool_calls)] or None}
        messages = messages + [replay] + [{"role": "tool", "tool_call_id": tc["id"], "content": r}
                                          for tc, r in zip(replay.get("tool_calls") or [], results)] + turns
    return prompts, calls


def _expected(tok, calls, i: int) -> list[int]:
    """Call i's prompt ids from `apply_chat_template` alone: the first call's rendering; a later call's parent
    prompt + sampled ids (+ end-of-turn when it was cut) + the rendering of its messages past the reply's
    end-of-turn (the reply ends at the same end-of-turn count in the conversation rendered up to the reply as in
    the whole: a template that drops thinking drops no end-of-turn)."""
    call = calls[i]
    full = tok.apply_chat_template(call.messages, tools=call.tools, tokenize=False, add_generation_prompt=True)
    if i == 0:
        return tok.encode(full, add_special_tokens=False)
    parent, eot = calls[i - 1], tok.eos_token
    k = len(parent.messages)
    turn = tok.apply_chat_template(call.messages[:k + 1], tools=call.tools, tokenize=False, add_generation_prompt=False)
    end = -1
    for _ in range(turn.count(eot)):
        end = full.index(eot, end + 1)
    sampled = parent.completion_ids + ([] if parent.completion_ids[-1] == tok.eos_token_id else [tok.eos_token_id])
    return parent.prompt_ids + sampled + tok.encode(full[end + len(eot):], add_special_tokens=False)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2-135m-instruct")     # its own template has no tools: the tool template


@pytest.fixture(scope="module")
def smollm2_own():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


def _builders(tok, template: str | None = None, **kw) -> tuple[PromptBuilder, PromptBuilder]:
    if template is not None:
        tok.chat_template = template
    incremental, full = PromptBuilder(tok, **kw), PromptBuilder(tok)
    full.incremental = False
    return incremental, full


FIRST = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix f."}]
TEMPLATES = {"tool": TOOL_CHAT_TEMPLATE, "qwen3_style": QWEN3_STYLE, "r1_style": R1_STYLE,
             "qwen3_query_style": QWEN3_QUERY_STYLE, "llama_style": LLAMA_STYLE, "no_eot_after_reply": DROP_EOT,
             "eot_per_tool_call": TURN_PER_CALL, "content_only": CONTENT_ONLY, "constant": CONSTANT}
INDEPENDENT = {"tool", "qwen3_style", "r1_style", "qwen3_query_style", "llama_style"}   # `_expected` applies


@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
@pytest.mark.parametrize("by_id", [True, False], ids=["by_id", "by_text"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_agent_episode_incremental_equals_full_render(tiny, name, by_id, system):
    """Two episodes of the agent script: the first checks each conversation shape against the full path, the
    second takes the incremental path for every continuation but the new turns after earlier thinking under a
    template that drops it (calls 4-7)."""
    inc, full = _builders(tiny, TEMPLATES[name])
    assert inc.incremental
    first = FIRST if system else FIRST[1:]
    for episode in range(2):
        (got, want), calls = _episode([inc, full], first, AGENT, TOOLS, by_id)
        assert [p.ids for p in got] == [p.ids for p in want]
        assert [p.parent_call_id for p in got] == [None] + [c.call_id for c in calls[:-1]]   # one chain, no fork
        assert not any(p.incremental for p in want)
        if name in INDEPENDENT:
            assert [p.ids for p in got] == [_expected(tiny, calls, i) for i in range(len(calls))]
        taken = {i for i, p in enumerate(got) if p.incremental}
        assert taken == (set() if episode == 0 else {1, 2, 3} if inc.drops_thinking else set(range(1, len(AGENT))))


def test_smollm2_tokenizer_incremental_equals_full_render(smollm2):
    """SmolLM2's 49k BPE (merges across the bridge's text), with the tool template it is given."""
    inc, full = _builders(smollm2)
    for episode in range(2):
        (got, want), calls = _episode([inc, full], FIRST, AGENT, TOOLS)
        assert [p.ids for p in got] == [p.ids for p in want] == [_expected(smollm2, calls, i) for i in range(8)]
    assert [p.incremental for p in got] == [False] + [True] * 7


def test_smollm2_own_text_template(smollm2_own):
    """SmolLM2's own template (string contents only, no tools): probed on text turns."""
    inc, full = _builders(smollm2_own)
    assert inc.incremental and "tools" not in smollm2_own.chat_template
    (got, want), calls = _episode([inc, full], FIRST[:1] + [{"role": "user", "content": "Hi"}], CHAT, None)
    assert [p.ids for p in got] == [p.ids for p in want] == [_expected(smollm2_own, calls, i) for i in range(5)]
    assert [p.incremental for p in got] == [False, False, False, True, True]   # calls 1, 2 check their shapes


@pytest.mark.parametrize("template", [COUNTING, LONG, DROP_ANSWERED], ids=["counting", "long", "drop_answered"])
def test_templates_that_rewrite_earlier_turns_never_take_it(tiny, template):
    inc, full = _builders(tiny, template)
    assert not inc.incremental
    (got, want), _ = _episode([inc, full], FIRST, AGENT, TOOLS)
    assert [p.ids for p in got] == [p.ids for p in want] and not any(p.incremental for p in got)
    assert any(p.render_reason == "template_not_append_only" for p in got)


def test_reasoning_dropping_template_takes_the_full_path_after_earlier_thinking(tiny):
    """Qwen3-style: at a new user turn the template drops the thinking of the assistant turns since the last
    one, and the full path checks that it dropped only thinking, which depends on those earlier turns, not only on
    the last reply. In the second episode an earlier reply wrote text before its <think>, which the template
    drops too: the full path renders that call in full (template_not_append_only), where the incremental path,
    whose shape agreed in the first episode, would have continued."""
    inc, full = _builders(tiny, QWEN3_STYLE)
    assert inc.incremental and inc.drops_thinking
    for before in ("", "Let me see. "):
        script = [(before + "<think>hmm</think>" + _tool_call("read", path="a.py"), ["x = 1"], []),
                  ("It is 1.", [], [{"role": "user", "content": "Thanks, and b?"}]), ("b is 2.", [], [])]
        (got, want), calls = _episode([inc, full], FIRST, script, TOOLS)
        assert [p.ids for p in got] == [p.ids for p in want] and not got[2].incremental
        rendered = tiny.apply_chat_template(calls[2].messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert "Let me see." not in rendered and (tiny.decode(got[2].ids) == rendered) == bool(before)
        assert got[2].render_reason == ("template_not_append_only" if before else None)


def test_a_shape_that_differs_from_the_full_render_takes_the_full_path(tiny):
    """A template whose new user turns depend on the conversation's first user turn passes the probe; the first
    call of each shape is checked against the full path, and the shape that differs is rendered in full from
    then on."""
    inc, full = _builders(tiny, SPECIAL)
    assert inc.incremental
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "SPECIAL"}]
    (got, want), calls = _episode([inc, full], first, CHAT, TOOLS)
    assert [p.ids for p in got] == [p.ids for p in want] == [_expected(tiny, calls, i) for i in range(5)]
    assert "[!] And 6 * 8?" in tiny.decode(got[2].ids) and not any(p.incremental for p in got)
    (got, want), _ = _episode([inc, full], first[:1] + [{"role": "user", "content": "plain"}], CHAT, TOOLS)
    assert [p.ids for p in got] == [p.ids for p in want]   # the same shape: still the full path


def test_recheck_every_call_follows_a_length_dependent_template(tiny):
    """A template that changes the system turn from 20 messages on (past the probe's 15) continues as the full
    path does when every use is rechecked; the first difference turns the incremental path off."""
    late = _replace(LONG, "messages | length > 6", "messages | length > 20")
    inc, full = _builders(tiny, late, recheck_every=1)
    assert inc.incremental
    (got, want), calls = _episode([inc, full], FIRST, [("ok", [], [{"role": "user", "content": "next"}])] * 12, TOOLS)
    assert [p.ids for p in got] == [p.ids for p in want] and not inc.incremental
    assert [p.render_reason for p, c in zip(got, calls) if len(c.messages) == 22] == ["template_not_append_only"]


@pytest.mark.parametrize("name", ["tool", "qwen3_style"])
def test_an_edited_history_is_rendered_in_full(tiny, name):
    """An edit of a message the parent saw (the user's first turn, an earlier reply) finds no parent: the whole
    conversation is rendered, never the incremental path."""
    inc, full = _builders(tiny, TEMPLATES[name])
    _, calls = _episode([inc], FIRST, AGENT[:3], TOOLS)
    messages = calls[-1].messages + [calls[-1].response_message, {"role": "tool", "tool_call_id": "x", "content": "ok"}]
    for i, edited in ((1, {"role": "user", "content": "Fix g."}),
                      (2, {**messages[2], "content": "I looked already."})):
        changed = messages[:i] + [edited] + messages[i + 1:]
        got, want = (b.build(changed, TOOLS, calls) for b in (inc, full))
        rendered = tiny.apply_chat_template(changed, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert got == want and got.parent_call_id is None and not got.incremental
        assert got.render_reason in ("history_edited", "history_differs", "reply_edited")
        assert got.ids == tiny.encode(rendered, add_special_tokens=False)
