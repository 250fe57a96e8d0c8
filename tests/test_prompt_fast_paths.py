"""The prompt builder's fast paths give exactly what the slow ones give.

`PromptBuilder.render` calls the compiled chat template directly (not `apply_chat_template`, which copies
every message first), `encode` the Rust tokenizer directly, and a continuation renders once when the
template was probed append-only. Each is compared with the plain `transformers` call / the two-render
path on conversations with tools, tool calls, None-valued keys, reasoning fields, and a reply that spells
the end-of-turn token out.
"""

from __future__ import annotations

import pytest

from ajet.chat_template import TOOL_CHAT_TEMPLATE
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


# ---- each guard of the one-render path, against a value built without the prompt builder ----------------
# The expected prompt of a continuation is the parent's prompt ids + its sampled ids + the chat template's
# rendering of the new turns (tests/exact_sample.py, from `apply_chat_template`), or, for a template that
# rewrote the history, the template's rendering of the whole conversation.

def _replace(template: str, old: str, new: str) -> str:
    assert old in template
    return template.replace(old, new)


# the system turn says " (long)" from 7 messages on: the parent's prompt is no prefix of the next one
LONG = _replace(TOOL_CHAT_TEMPLATE, "{{- '<|im_start|>system\\n' + system -}}",
                "{{- '<|im_start|>system\\n' + system + (' (long)' if messages | length > 6 else '') -}}")
# an answered text-only assistant turn is emptied (the probe's reply has tool calls, so the probe passes)
DROP_ANSWERED = _replace(TOOL_CHAT_TEMPLATE, "{%- if m.role == 'assistant' -%}",
                         "{%- if m.role == 'assistant' and not m.tool_calls and not loop.last -%}"
                         "{{- '<|im_start|>assistant\\n<|im_end|>\\n' -}}{%- elif m.role == 'assistant' -%}")
# each tool call closes a turn of its own: a reply with two calls holds two end-of-turn tokens
TURN_PER_CALL = _replace(TOOL_CHAT_TEMPLATE, "'}\\n</tool_call>' -}}",
                         "'}\\n</tool_call>' + ('' if loop.last else '<|im_end|>\\n<|im_start|>assistant\\n') -}}")


def _piecewise(tokenizer, text: str) -> list[int]:
    """Ids of `text` one character at a time: what a model that writes `<|im_end|>` out as text samples."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


def _continue(tokenizer, first, reply, tool_calls, then, piecewise=False, content=None):
    """(fast builder's prompt, slow builder's prompt, parent, next messages) for a continuation: the parent
    sampled `reply` (one character at a time when `piecewise`) and answered `content` (default: `reply`) and
    `tool_calls`; the next request adds `then`."""
    from tests.exact_sample import expected_first_prompt

    fast, slow = PromptBuilder(tokenizer), PromptBuilder(tokenizer)
    slow.single_render = False
    sampled = (_piecewise(tokenizer, reply) if piecewise else tokenizer.encode(reply, add_special_tokens=False))
    sampled.append(tokenizer.eos_token_id)
    reply_msg = {"role": "assistant", "content": reply if content is None else content,
                 **({"tool_calls": tool_calls} if tool_calls else {})}
    parent = LLMCall("c0", "e", "default", 0, first, TOOLS, expected_first_prompt(tokenizer, first, TOOLS), sampled,
                     [0.0] * len(sampled), "stop", reply_msg, SamplingParams(), 0)
    nxt = first + [reply_msg] + then
    return fast.build(nxt, TOOLS, [parent]), slow.build(nxt, TOOLS, [parent]), parent, nxt


def _expected_extension(tokenizer, parent, nxt):
    from tests.exact_sample import expected_bridge

    return parent.prompt_ids + parent.completion_ids + expected_bridge(tokenizer, nxt, TOOLS, len(parent.messages))


FIRST = [{"role": "system", "content": "S"}, {"role": "user", "content": "2?"}]
RESULT = [{"role": "tool", "tool_call_id": "call_1", "content": "2"}]


@pytest.mark.parametrize("where", ["content", "name", "arguments"])
def test_a_reply_that_writes_the_end_of_turn_out_is_not_cut_there(tokenizer, where):
    """Issue 24 item 9: the end-of-turn text written inside the reply (as ordinary tokens) is no end."""
    eot = tokenizer.eos_token
    name = "calc" + eot + "ulate" if where == "name" else "calculate"
    args = '{"expression": "1' + eot + '1"}' if where == "arguments" else '{"expression": "1+1"}'
    content = "I write " + eot + " here." if where == "content" else "Let me see."
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
    text = content + '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + '}\n</tool_call>'
    a, b, parent, nxt = _continue(tokenizer, FIRST, text, [call], RESULT, piecewise=True, content=content)
    expected = _expected_extension(tokenizer, parent, nxt)
    assert a.ids == expected and b.ids == expected and a.parent_call_id == "c0"


def _assert_rendered_in_full(tokenizer, first, reply: str, user: str):
    """A continuation under a template that passed the probe yet rewrites this conversation: both paths render
    the whole conversation, as the template does."""
    fast, slow, _, nxt = _continue(tokenizer, first, reply, None, [{"role": "user", "content": user}])
    assert PromptBuilder(tokenizer).single_render
    expected = tokenizer.encode(tokenizer.apply_chat_template(nxt, tools=TOOLS, tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
    assert fast.ids == slow.ids == expected and fast.render_reason == "template_not_append_only"


def test_a_template_that_changes_the_parents_prompt_renders_in_full(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", LONG)
    first = FIRST + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
                     {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]   # 6 messages
    _assert_rendered_in_full(tokenizer, first, "e", "f")


def test_a_template_that_drops_the_reply_renders_in_full(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", DROP_ANSWERED)
    _assert_rendered_in_full(tokenizer, FIRST, "The answer.", "and?")


def test_a_reply_the_template_closes_twice_ends_at_its_last_end_of_turn(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", TURN_PER_CALL)
    assert not PromptBuilder(tokenizer).single_render           # the probe saw two end-of-turn tokens
    calls = [{**CALL, "id": f"call_{i}"} for i in (1, 2)]
    text = "".join('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+1"}}\n</tool_call>' for _ in calls)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "2"} for c in calls]
    fast, slow, parent, nxt = _continue(tokenizer, FIRST, text, calls, results, content="")
    assert fast.ids == slow.ids and fast.ids == _expected_extension(tokenizer, parent, nxt) and fast.parent_call_id == "c0"


# ---- the byte-level BPE encoder: the tokenizer's own ids, on text built without it ----------------------

def _random_texts(n: int, seed: int = 0) -> list[str]:
    """ASCII texts from pieces where GPT-2's pre-tokenizer decides something: every ASCII character (controls,
    \\x1c-\\x1f, which are not whitespace to it), contractions in both cases, runs of spaces and newlines before
    and after words, digits, punctuation, the special tokens."""
    import random

    rnd = random.Random(seed)
    pieces = [chr(i) for i in range(128)] + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "  ", "\n\n",
                                             " \n ", "\t", "ab", "Tom", "12", "3.5", "-->", "<|im_end|>",
                                             "<|im_start|>"]
    return ["".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from ajet.model import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_byte_level_encoder_gives_the_tokenizers_ids(tokenizer, smollm2_tokenizer, which):
    from pathlib import Path

    tok = tokenizer if which == "tiny" else smollm2_tokenizer
    builder = PromptBuilder(tok)
    assert builder._byte_level is not None            # both are GPT-2-style byte-level BPE tokenizers
    root = Path(__file__).resolve().parent.parent
    sources = [p.read_text() for p in [*sorted((root / "ajet" / "proxy").glob("*.py")), root / "README.md"]]
    texts = _random_texts(3000) + sources + [
        "héllo wörld — “quoted” 日本語 😀 <|im_end|> and ASCII after",   # a piece not ASCII: the tokenizer's own
        "tabs\there\x0b\x0c\r\n   \n\x1c\x1d end", "I'm   sure  it's\n\n  they'll"]
    for text in texts:
        assert builder.encode(text) == tok.encode(text, add_special_tokens=False), repr(text[:80])


def test_byte_level_encoder_refuses_other_pipelines(tokenizer):
    """A tokenizer whose pipeline differs (a normalizer, a Split pre-tokenizer, an added token that strips the
    space beside it) gets no byte-level encoder: `encode` stays the tokenizer's."""
    from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

    from ajet.proxy.byte_bpe import ByteLevelEncoder

    def variant(change) -> Tokenizer:
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        change(backend)
        return backend

    assert ByteLevelEncoder.of(variant(lambda b: None)) is not None
    assert ByteLevelEncoder.of(variant(lambda b: setattr(b, "normalizer", normalizers.NFKC()))) is None
    assert ByteLevelEncoder.of(variant(lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])))) is None
    assert ByteLevelEncoder.of(variant(lambda b: b.add_special_tokens([AddedToken("<x>", lstrip=True)]))) is None


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_decode_gives_the_tokenizers_text(tokenizer, smollm2_tokenizer, which):
    """`PromptBuilder.decode` (the Rust tokenizer's decode, called directly) is `tokenizer.decode(ids,
    skip_special_tokens=True, clean_up_tokenization_spaces=False)` on random ids (special tokens, partial UTF-8
    bytes and all), on encoded text, and on none; a tokenizer whose `_decode` is its own keeps it."""
    import random

    tok = tokenizer if which == "tiny" else smollm2_tokenizer
    builder = PromptBuilder(tok)
    assert builder._decoder is not None
    rnd, n = random.Random(7), len(tok)
    cases = [[rnd.randrange(n) for _ in range(rnd.randint(0, 60))] for _ in range(2000)] + [
        [], tok.encode("héllo 日本語 😀 <|im_end|> it's  x", add_special_tokens=False) + [tok.eos_token_id]]
    for ids in cases:
        assert builder.decode(ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    class Own(type(tok)):
        def _decode(self, token_ids, **kw):
            return "own"

    tok.__class__, cls = Own, tok.__class__
    try:
        assert PromptBuilder(tok).decode([1, 2]) == "own"
    finally:
        tok.__class__ = cls
