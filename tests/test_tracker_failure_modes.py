"""Failure modes of merging by tokens, one test each, through the real proxy and the real OpenAI SDK.

Every test checks the same invariant: each token the engine sampled is trained exactly once, with its
engine logprob, and no other token is trained.
"""

import json

import openai
import pytest
from transformers import AutoTokenizer

from ajet.chat_template import TOOL_CHAT_TEMPLATE
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.tracker import merge_calls
from ajet.workflow import Tuner
from tests.scripted_engine import ScriptedEngine

TOOL = {"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture()
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _run(tok, replies, conversation):
    """Serve `replies`, let `conversation(client, endpoint)` talk; return (calls, samples, engine)."""
    engine = ScriptedEngine(tok, replies)
    proxy = ProxyServer(engine, tok, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("ep")
        conversation(openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0), ep)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    samples = merge_calls(calls, "g")
    _assert_sampled_tokens_trained_once(calls, samples)
    return calls, samples, engine


def _assert_sampled_tokens_trained_once(calls, samples):
    trained = sorted((v, lp) for s in samples for m, v, lp in zip(s.loss_mask, s.response_ids, s.old_logprobs) if m)
    sampled = sorted((t, lp) for c in calls for t, lp in zip(c.completion_ids, c.completion_logprobs))
    assert trained == sampled


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _piecewise(tok, text):
    """A non-canonical tokenization of `text`: one character at a time."""
    return [i for ch in text for i in _ids(tok, ch)]


def _chat(client, messages, **kw):
    r = client.chat.completions.create(model="m", messages=messages, **kw)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    return r.choices[0].message


def test_bpe_resplit_of_generated_text_is_kept_as_sampled(tok):
    text = "The quick brown fox"
    odd = _piecewise(tok, text)
    assert odd != _ids(tok, text) and tok.decode(odd) == text        # same text, other tokens
    reply = odd + [tok.eos_token_id]

    def talk(client, _):
        msgs = [{"role": "user", "content": "go"}]
        _chat(client, msgs)
        msgs.append({"role": "user", "content": "again"})
        _chat(client, msgs)

    calls, (sample,), _ = _run(tok, [reply, "ok"], talk)
    assert calls[1].prompt_parent == calls[0].call_id
    assert sample.response_ids[: len(reply)] == reply              # never re-tokenized


def test_special_token_spelled_out_in_text(tok):
    spelled = _piecewise(tok, "x <|im_end|> y")                      # the characters, not the special token
    assert tok.eos_token_id not in spelled

    def talk(client, _):
        msgs = [{"role": "user", "content": "say it"}]
        assert "<|im_end|>" in _chat(client, msgs).content
        msgs.append({"role": "user", "content": "thanks"})
        _chat(client, msgs)

    calls, (sample,), _ = _run(tok, [spelled + [tok.eos_token_id], "bye"], talk)
    assert calls[1].prompt_parent == calls[0].call_id
    bridge = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].completion_ids):]
    assert tok.decode(bridge) == "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"


def _two_user_turns(client, _):
    msgs = [{"role": "user", "content": "a"}]
    _chat(client, msgs)
    msgs.append({"role": "user", "content": "b"})
    _chat(client, msgs)


def test_template_that_drops_end_of_turn(tok):
    tok.chat_template = TOOL_CHAT_TEMPLATE.replace("{%- endfor -%}{{- '<|im_end|>\\n' -}}",
                                                   "{%- endfor -%}{{- '\\n' -}}")
    assert tok.chat_template != TOOL_CHAT_TEMPLATE

    calls, (sample,), engine = _run(tok, ["one", "two"], _two_user_turns)
    assert calls[1].prompt_parent == calls[0].call_id
    # the sampled end-of-turn stays in context and is trained, though the template would not show it
    first = engine.sampled[0]
    assert first[-1] == tok.eos_token_id and sample.response_ids[: len(first)] == first
    assert sample.loss_mask[len(first) - 1] == 1


def test_separator_after_end_of_turn_is_masked(tok):
    calls, (sample,), engine = _run(tok, ["one", "two"], _two_user_turns)
    n = len(engine.sampled[0])
    newline = _ids(tok, "\n")
    assert sample.response_ids[n: n + len(newline)] == newline and sample.loss_mask[n: n + len(newline)] == [0] * len(newline)


def test_parallel_tool_responses_rendered_as_one_turn(tok):
    two_calls = ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+2"}}\n</tool_call>')

    def talk(client, _):
        msgs = [{"role": "user", "content": "1+1 and 2+2?"}]
        msg = _chat(client, msgs, tools=[TOOL])
        assert len(msg.tool_calls) == 2
        msgs += [{"role": "tool", "tool_call_id": tc.id, "content": str(v)} for tc, v in zip(msg.tool_calls, (2, 4))]
        _chat(client, msgs, tools=[TOOL])

    calls, (sample,), engine = _run(tok, [two_calls, "2 and 4"], talk)
    n = len(engine.sampled[0])
    bridge_len = len(calls[1].prompt_ids) - len(calls[0].prompt_ids) - n
    assert tok.decode(sample.response_ids[n: n + bridge_len]) == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert sample.loss_mask[n: n + bridge_len] == [0] * bridge_len


# Qwen3-style: <think> blocks of assistant turns before the last user turn are stripped
QWEN3_STYLE = TOOL_CHAT_TEMPLATE.replace(
    "{%- set c = text(m.content) -%}",
    "{%- set c = text(m.content) -%}{%- if '</think>' in c and loop.index0 < last_user -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}").replace(
    "{%- for m in rest -%}",
    "{%- set ns = namespace(last=0) -%}{%- for m in rest -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}{%- set last_user = ns.last -%}{%- for m in rest -%}", 1)


# DeepSeek-R1-style: every earlier assistant turn loses its <think> block
R1_STYLE = TOOL_CHAT_TEMPLATE.replace(
    "{%- set c = text(m.content) -%}",
    "{%- set c = text(m.content) -%}{%- if '</think>' in c -%}{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}")
# rewrites earlier turns beyond thinking: the system turn counts the user turns (so rendering up to a reply
# extends the reply's prompt, and a new user turn changes the system turn)
COUNTING = TOOL_CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>system\\n' + system -}}",
    "{{- '<|im_start|>system\\n' + system + ' (' + (messages | selectattr('role', 'equalto', 'user') | list | length"
    " | string) + ')' -}}")
THINKING_REPLY = "<think>let me think</think>A1"


@pytest.mark.parametrize("template", [QWEN3_STYLE, R1_STYLE], ids=["qwen3_style", "r1_style"])
@pytest.mark.parametrize("next_turn", ["user", "tool"])
def test_a_template_that_drops_earlier_thinking_keeps_the_sampled_tokens(tok, template, next_turn):
    """The decision (docs/protocols.md): a continuation keeps what the model sampled, <think> included, though
    the template would drop it from a re-rendered history: one sample, whose context is what the model had."""
    tok.chat_template = template
    calc = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}
    first = THINKING_REPLY + '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>' if next_turn == "tool" \
        else THINKING_REPLY

    def talk(client, _):
        msgs = [{"role": "user", "content": "q1"}]
        m = _chat(client, msgs, tools=[calc])
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "7"} if next_turn == "tool"
                    else {"role": "user", "content": "q2"})
        _chat(client, msgs, tools=[calc])

    calls, samples, engine = _run(tok, [first, "A2"], talk)
    rerendered = tok.apply_chat_template(calls[1].messages, tools=[calc], tokenize=False, add_generation_prompt=True)
    assert "let me think" not in rerendered or template is QWEN3_STYLE and next_turn == "tool"  # what it would drop
    assert calls[1].prompt_parent == calls[0].call_id and len(samples) == 1
    assert calls[1].prompt_ids[:len(calls[0].prompt_ids) + len(engine.sampled[0])] == \
        calls[0].prompt_ids + engine.sampled[0]                           # the sampled think, token for token
    # what follows is the template's own rendering of the new turn (built here from the template alone)
    tail = "q2<|im_end|>\n<|im_start|>assistant\n" if next_turn == "user" else \
        "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(calls[1].prompt_ids[len(calls[0].prompt_ids) + len(engine.sampled[0]):]).endswith(tail)
    assert rerendered.endswith(tail)


def test_a_template_that_rewrites_earlier_turns_forks_with_reason(tok):
    tok.chat_template = COUNTING

    def talk(client, _):
        msgs = [{"role": "user", "content": "q1"}]
        _chat(client, msgs)
        msgs.append({"role": "user", "content": "q2"})
        _chat(client, msgs)

    calls, samples, _ = _run(tok, [THINKING_REPLY, "A2"], talk)
    assert calls[1].prompt_parent is None and calls[1].prompt_render_reason == "template_not_append_only"
    assert tok.decode(calls[1].prompt_ids) == tok.apply_chat_template(calls[1].messages, tokenize=False,
                                                                       add_generation_prompt=True)
    assert len(samples) == 2 and samples[1].flags["fork_reason"] == "template_not_append_only"


def test_client_side_history_edit_trains_only_what_was_sampled(tok):
    def talk(client, _):
        msgs = [{"role": "user", "content": "q"}]
        _chat(client, msgs)
        msgs[-1]["content"] = "an edited answer the model never wrote"
        msgs.append({"role": "user", "content": "next"})
        _chat(client, msgs)

    calls, samples, _ = _run(tok, ["the real answer", "fine"], talk)
    assert calls[1].prompt_render_reason == "history_differs"
    edited = samples[1]
    assert edited.flags["fork_reason"] == "history_differs"
    assert "edited answer" in tok.decode(edited.prompt_ids)           # context only, never trained


def test_context_compaction_forks_and_keeps_both_branches(tok):
    def talk(client, _):
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "long task"}]
        _chat(client, msgs)
        msgs.append({"role": "user", "content": "step 2"})
        _chat(client, msgs)
        compacted = [msgs[0], {"role": "user", "content": "Summary so far: done 2 steps. Continue."}]
        _chat(client, compacted)

    calls, samples, _ = _run(tok, ["r1", "r2", "r3"], talk)
    assert [s.call_ids for s in samples] == [[calls[0].call_id, calls[1].call_id], [calls[2].call_id]]
    assert samples[1].flags["fork_reason"] == "history_differs"


def test_interleaved_sub_agent_calls_merge_per_agent(tok):
    def talk(client, ep):
        sub = Tuner(base_url=ep.base_url, api_key=ep.api_key, model="m", episode_id="ep").agent("searcher")
        sub_client = openai.OpenAI(base_url=sub.base_url, api_key=sub.api_key, max_retries=0)
        main = [{"role": "system", "content": "planner"}, {"role": "user", "content": "task"}]
        side = [{"role": "system", "content": "searcher"}, {"role": "user", "content": "find x"}]
        _chat(client, main)
        _chat(sub_client, side)
        main.append({"role": "user", "content": "result of search"})
        side.append({"role": "user", "content": "find y"})
        _chat(client, main)
        _chat(sub_client, side)

    calls, samples, _ = _run(tok, ["plan", "x", "done", "y"], talk)
    assert [c.agent_tag for c in calls] == ["default", "searcher", "default", "searcher"]
    assert [(s.agent_tag, s.call_ids) for s in samples] == [
        ("default", [calls[0].call_id, calls[2].call_id]), ("searcher", [calls[1].call_id, calls[3].call_id])]
    assert merge_calls(calls, "g", group_by_agent_tag=True)[1].group_id == "g:searcher"


def test_interleaved_conversations_on_one_tag_find_their_own_parent(tok):
    def talk(client, _):
        a = [{"role": "system", "content": "agent A"}, {"role": "user", "content": "1"}]
        b = [{"role": "system", "content": "agent B"}, {"role": "user", "content": "2"}]
        _chat(client, a)
        _chat(client, b)
        a.append({"role": "user", "content": "3"})
        _chat(client, a)

    calls, samples, _ = _run(tok, ["ra", "rb", "ra2"], talk)
    assert calls[2].prompt_parent == calls[0].call_id
    assert sorted(len(s.call_ids) for s in samples) == [1, 2]
    assert json.dumps(samples[0].call_ids) == json.dumps([calls[0].call_id, calls[2].call_id])
