"""Token-in-token-out prompt building: a call that continues an earlier call reuses its exact tokens.

When a call's messages are an earlier call's messages, plus that call's assistant reply, plus new
messages (tool results, a user turn), the prompt ids are

    earlier prompt ids + earlier sampled ids (+ end-of-turn if it was not sampled) + rendered new turns

so the model is conditioned on exactly the tokens it sampled (no BPE re-split, no re-serialised tool-call
JSON), and the context tracker can merge the two calls into one sample. Anything else (the first call,
an edited history, a template that rewrites earlier turns) is rendered in full, and the reason is kept.

The parent is found by identity first, then by text (`find_parent`; docs/protocols.md, "How a call finds
its parent"):
- **by id**: every tool-call id the proxy hands out names the call that sampled it. When the request's
  latest assistant turn carries such an id, that call is the candidate parent; the request continues it
  when its messages before the turn are that call's messages and the turn says what the call sampled,
  serialisation aside (arguments re-serialised with other spacing, key order or number formatting, or with keys the
  tool's schema gives a `default` added or dropped at that default, as Claude Code adds
  `"replace_all": false` to `Edit`). The model then sees exactly the tokens it sampled.
- **by text**: for clients that drop or rewrite ids, the latest call whose messages + reply (arguments
  compared as JSON, ids ignored) are a prefix of the request.
- otherwise none: the prompt is rendered in full, and `render_reason` says why (`first_call`,
  `reply_edited`, `history_edited`, `history_differs`, `tools_changed`, `template_not_append_only`).

Thinking: a continuation keeps the parent's sampled tokens, `<think>` blocks included, also under a
template that drops earlier turns' `<think>` when it renders the conversation: the sample is trained on
the context the model actually had (one sample per episode), not on a re-rendered history.

Incremental rendering: a continuation's new tokens are the template's rendering of the turns after the reply,
which the full path reads off a render of the whole conversation (and, for some templates, a second one up to
the reply). The incremental path renders only a short conversation instead, the parent's last message + the
reply + the new turns (no system turn, no tools: `_incremental`), and reads the same bridge off it by the same
rules. It is used only where it was shown to give what the full path gives:
- per template (`_incremental_probe`, at construction): on two probe conversations (15 and 14 messages; text
  replies, tool calls, tool results, thinking and reasoning fields, with and without a system turn) every
  continuation the probe holds gives the full path's bridge; a template that rewrites earlier turns (beyond
  thinking), depends on the conversation's length within the probe, or cannot render a conversation that does
  not start at its beginning never takes it;
- per conversation shape (`_shape`: the roles, content types, tool-call counts, keys, thinking and spelled-out
  end-of-turn of the parent's last message, the reply and the new turns; whether that last message opens the
  conversation), checked against the full path the
  first time the shape occurs and again at every `recheck_every`-th; a shape that differs is rendered in full
  from then on, and a difference on a shape that had agreed turns the incremental path off for the template
  (with a warning): its output then depends on more than the shape holds;
- templates that drop earlier thinking (`drops_thinking`: Qwen3-style) re-render the history at a new user
  turn, and the full path checks that only thinking was dropped there, which depends on every earlier turn: a
  call whose new turns hold anything but tool results, after earlier assistant turns with thinking, takes the
  full path.
A template whose output depends on the conversation's length beyond the probe's, or on message content
beyond what the shape holds, can still differ until a recheck catches it; pass `recheck_every=1` to check
every call (the full path's cost, plus the short render).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from ajet.llm_call import LLMCall
from ajet.proxy.byte_bpe import ByteLevelEncoder

log = logging.getLogger(__name__)

_THINK = re.compile(r"<think>.*?</think>\s*", re.S)   # a thinking block, as templates that drop it write it
_SHAPES_KEPT = 4096   # conversation shapes remembered per builder (then forgotten and checked again)

try:   # the pieces of `apply_chat_template` that `PromptBuilder.render` uses directly
    from transformers.utils.chat_template_utils import (_REASONING_FIELDS, _alias_reasoning_fields,
                                                        _compile_jinja_template)
except ImportError:  # another transformers: render through apply_chat_template
    _compile_jinja_template = None
    _REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain_rust_decode(tokenizer) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` of a list of ints
    is `tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=...)`: a transformers `TokenizersBackend` (the
    fast tokenizers) whose `decode` and `_decode` are transformers' own."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:   # another transformers: decode through the tokenizer
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is PreTrainedTokenizerBase.decode)


@dataclass(frozen=True)
class Prompt:
    """A built prompt.

    Attributes:
        ids: `[prompt_len]` token ids for the engine.
        text: the chat template's rendering of the messages (what `ids` decode to when rendered in full); None
            when built incrementally under a template that drops earlier thinking (unknown without a full render).
        parent_call_id: the call it extends token-for-token, or None when rendered in full.
        render_reason: why it was rendered in full ("first_call", "reply_edited", "history_edited",
            "history_differs", "tools_changed", "template_not_append_only"), or None when it extends a parent.
        parent_by: how the parent was found: "id" (a tool-call id the proxy issued), "text", or "none".
        incremental: whether the new turns were rendered alone (the incremental path), not read off a render of
            the whole conversation.
    """

    ids: list[int]
    text: str | None
    parent_call_id: str | None
    render_reason: str | None
    parent_by: str = "none"
    incremental: bool = False


class _Step(NamedTuple):
    """How a continuation follows its parent: `bridge` is the text after the reply's end (its end-of-turn when
    `closed`), or None when the template rewrote earlier turns (render in full); `full_text` is the rendered
    conversation the bridge was read from."""

    bridge: str | None
    closed: bool
    full_text: str


class PromptTooLong(ValueError):
    """The prompt certainly exceeds the token limit: `min_tokens` is a lower bound on its length, known from
    its text before tokenizing it."""

    def __init__(self, min_tokens: int):
        super().__init__(f"the prompt is at least {min_tokens} tokens")
        self.min_tokens = min_tokens


class PromptBuilder:
    """Renders OpenAI-format messages into prompt ids with the model's chat template.

    Args:
        tokenizer: a `transformers` tokenizer whose `chat_template` accepts `tools=` and whose
            `eos_token` is the end-of-turn token (e.g. `<|im_end|>`).
        recheck_every: a conversation shape is checked against the full path at its first continuation and
            then at every `recheck_every`-th (1: every continuation; see the module docstring).

    Attributes:
        single_render: a checked continuation renders the conversation once (`_append_only_probe`).
        incremental: the incremental path may be used (`_incremental_probe`); turned off for good when a
            recheck finds a difference.
        drops_thinking: the template drops earlier assistant turns' thinking at a new user turn.
    """

    def __init__(self, tokenizer, recheck_every: int = 100):
        if recheck_every < 1:
            raise ValueError(f"recheck_every must be >= 1, not {recheck_every}")
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.eos_token
        self.end_of_turn_id = tokenizer.eos_token_id
        # the longest text one token can stand for, in UTF-8 bytes of its vocabulary string (which is never
        # shorter than the text it decodes to: byte-level BPE maps each byte to one character, SentencePiece
        # writes a space as 3-byte "▁", byte fallback as "<0x..>"), so a text of C characters is at least
        # C / max_token_bytes tokens
        self.max_token_bytes = max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)   # applied first when the tokenizer has one
        self._template_kwargs = dict(tokenizer.special_tokens_map)  # what apply_chat_template passes the template
        # the Rust tokenizer itself, when it encodes as `tokenizer.encode(text, add_special_tokens=False)` does
        self._backend = backend if backend is not None and not getattr(tokenizer, "split_special_tokens", False) \
            else None
        # the same ids, faster on ASCII text, for a GPT-2-style byte-level BPE tokenizer (else None)
        self._byte_level = ByteLevelEncoder.of(self._backend) if self._backend is not None else None
        # the Rust tokenizer's decode, when the tokenizer's own (transformers' `TokenizersBackend._decode`, not
        # overridden) is that call plus an argument check that walks every id (`to_py_obj`)
        self._decoder = backend if backend is not None and _plain_rust_decode(tokenizer) else None
        self.single_render = self._append_only_probe()
        self.recheck_every = recheck_every
        self.drops_thinking = self._drops_thinking_probe()
        self._shapes: dict[tuple, int] = {}   # shape -> incremental uses since its last check; -1: full path
        self.incremental = False
        self.incremental = self._incremental_probe()

    def _append_only_probe(self) -> bool:
        """Whether a continuation can be built from one render (of the whole conversation) instead of two
        (the conversation up to the reply, then the whole): on a probe conversation (system, user, an
        assistant reply with thinking, text and two tool calls, a tool result, a user turn) the template appends
        (rendering up to the reply is a prefix of the whole, the parent's prompt a prefix of that) and
        the reply holds exactly one end-of-turn token, so the first end-of-turn after the parent's prompt
        is where the reply ends. Otherwise every continuation renders twice and checks."""
        calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "probe", "arguments": '{"x": 1}'}}
                 for i in range(2)]
        tools = [{"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}]
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                    {"role": "assistant", "content": "<think>R</think>A", "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_0", "content": "T"}, {"role": "user", "content": "V"}]
        try:
            prev, turn, full = (self.render(messages[:2], tools), self.render(messages[:3], tools, False),
                                self.render(messages, tools))
        except Exception:  # noqa: BLE001 - a template that cannot render the probe: always check
            return False
        reply = turn[len(prev):]
        return (turn.startswith(prev) and full.startswith(turn) and bool(self.end_of_turn)
                and reply.count(self.end_of_turn) == 1)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, from the text's length alone (no tokenizing): the
        tokenizer's normalizer (if any) runs first, as in encoding, then each token covers at most
        `max_token_bytes` bytes. Used to reject an over-long prompt before tokenizing it."""
        if self._normalizer is not None:
            text = self._normalizer.normalize_str(text)
        return -(-len(text) // self.max_token_bytes)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool = True, template: str | None = None) -> str:
        """The chat template applied to `messages` (text, not ids): exactly `apply_chat_template(...,
        tokenize=False)`, minus its per-call copying of every message into plain JSON types (ours are
        plain JSON already: they come from a request body). Falls back to `apply_chat_template` when this
        `transformers` lacks the helpers used. `template`: the template source to use (default: the one the
        tokenizer picks for `tools`)."""
        if template is None:
            template = self.tokenizer.get_chat_template(None, tools)
        if _compile_jinja_template is None:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=template)
        # as apply_chat_template: None-valued keys dropped, reasoning fields aliased, special tokens passed
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if any(key in m for m in chat for key in _REASONING_FIELDS):
            chat = _alias_reasoning_fields(chat)
        return _compile_jinja_template(template).render(
            messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **self._template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Text to ids, as `tokenizer.encode(text, add_special_tokens=False)`; special tokens written in the text
        (`<|im_start|>`) map to their ids."""
        if self._byte_level is not None:
            return self._byte_level.encode(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Completion ids `[n]` to text, special tokens dropped: `tokenizer.decode(ids, skip_special_tokens=True,
        clean_up_tokenization_spaces=False)`, through the Rust tokenizer directly where that is what it runs."""
        if self._decoder is not None:
            return self._decoder.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def build(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              history: list[LLMCall], rendered: dict[str, str | None] | None = None,
              max_tokens: int | None = None) -> Prompt:
        """Prompt ids for `messages`, extending the latest call in `history` that they continue.

        A continuation renders only its new turns when the incremental path applies (module docstring), else
        the whole conversation. `rendered` maps call ids to their `Prompt.text` (a cache the caller keeps per
        episode; saves rendering the parent's messages again). Raises PromptTooLong when the prompt certainly
        has more than `max_tokens` tokens (a lower bound from the rendered text, checked before tokenizing it)."""
        parent, reason, by = find_parent(messages, tools, history)
        if parent is None:
            text = self.render(messages, tools)
            self._check_bound(0, text, max_tokens)
            return Prompt(self.encode(text), text, None, reason)
        k = len(parent.messages)
        prev_text = (rendered or {}).get(parent.call_id)
        key = self._shape(messages, k, tools)
        uses = self._shapes.get(key) if key is not None else None
        if uses is not None and 0 <= uses < self.recheck_every - 1:   # this shape agreed with the full path
            step = self._incremental(messages, k, tools)
            if step is not None:
                self._shapes[key] = uses + 1
                text = None if prev_text is None or self.drops_thinking else prev_text + step.full_text
                return self._extend(parent, text, step, max_tokens, by, incremental=True)
        if prev_text is None:
            prev_text = self.render(parent.messages, tools)   # the parent's prompt
        step = self._continuation(prev_text, messages, k, tools)
        if key is not None and (uses is None or uses >= 0):    # first seen, due for a recheck, or just differed
            self._check_shape(key, uses, step, self._incremental(messages, k, tools), prev_text)
        if step.bridge is None:
            return self._in_full(step.full_text, "template_not_append_only", max_tokens)
        return self._extend(parent, step.full_text, step, max_tokens, by)

    def _continuation(self, prev_text: str, messages: list[dict[str, Any]], k: int,
                      tools: list[dict[str, Any]] | None, template: str | None = None) -> _Step:
        """The full path: how `messages` continue the parent whose messages are `messages[:k]` (rendered as
        `prev_text`) and whose reply is `messages[k]`, read off the rendered conversation (module docstring)."""
        eot = self.end_of_turn
        full_text = self.render(messages, tools, template=template)              # + its reply + the new turns
        if self.single_render and full_text.startswith(prev_text) and not _calls_spell(messages[k], eot):
            # the template appends (probed): the reply ends at the first end-of-turn after the parent's prompt
            cut = full_text.find(eot, len(prev_text))
            # and it renders the reply's text verbatim before it (so the text holds no end-of-turn of its own;
            # a template that rewrites the reply, e.g. drops its <think>, takes the checked path below)
            if cut >= 0 and _text(messages[k].get("content")).strip() in full_text[len(prev_text):cut]:
                return _Step(full_text[cut + len(eot):], True, full_text)
        turn_text = self.render(messages[:k + 1], tools, False, template)      # + its reply
        if not turn_text.startswith(prev_text):
            return _Step(None, False, full_text)
        if not full_text.startswith(turn_text):
            # a template that drops earlier turns' <think> (Qwen3 at a new user turn): the sampled tokens stay
            bridge = _bridge_past_dropped_thinking(turn_text, full_text, eot)   # None: it rewrote more than that
            return _Step(bridge, bridge is not None, full_text)
        reply = turn_text[len(prev_text):]   # the reply as the template renders it, e.g. "text<|im_end|>\n"
        cut = reply.rfind(eot)               # the last one: the reply's text may spell the token out
        # what follows the sampled end-of-turn: separators ("\n"), then the new turns; a template that
        # drops the end-of-turn token gives no cut, and everything after the reply is new
        bridge = full_text[len(prev_text) + cut + len(eot):] if cut >= 0 else full_text[len(turn_text):]
        return _Step(bridge, cut >= 0, full_text)

    def _incremental(self, messages: list[dict[str, Any]], k: int, tools: list[dict[str, Any]] | None) -> _Step | None:
        """The incremental path: `_continuation` on the short conversation parent's last message + reply + new
        turns, rendered without tools (by the template the tokenizer picks for `tools`); its `full_text` is the
        short conversation's rendering past that last message's prompt. None when that does not continue."""
        head = messages[k - 1:k]
        template = self.tokenizer.get_chat_template(None, tools)
        try:
            prev = self.render(head, None, template=template)
            step = self._continuation(prev, head + messages[k:], 1, None, template)
        except Exception:  # noqa: BLE001 - a template that cannot render the short conversation: full path
            return None
        return step._replace(full_text=step.full_text[len(prev):]) if step.bridge is not None else None

    def _shape(self, messages: list[dict[str, Any]], k: int, tools: list[dict[str, Any]] | None) -> tuple | None:
        """What the incremental path's agreement with the full path is remembered by (module docstring): the
        parent's last message, the reply and the new turns, each by `_message_shape`; the conversation's first
        role, whether the parent's last message is its opening one (after a system turn), and whether it has
        tools (the short conversation then holds all of it but the system turn and tools, so that its agreement
        says little about later calls). None where the incremental path is not taken:
        turned off, or new turns other than tool results after earlier thinking under `drops_thinking`."""
        if not self.incremental or k < 1 or self._rethinks(messages, k):
            return None
        eot = self.end_of_turn
        opening = k == 1 or (k == 2 and messages[0].get("role") in ("system", "developer"))
        return (tools is None, messages[0].get("role"), opening,
                tuple(_message_shape(m, eot) for m in messages[k - 1:]))

    def _rethinks(self, messages: list[dict[str, Any]], k: int) -> bool:
        """Whether the template may drop thinking of turns before the reply `messages[k]` in this call (and not
        in its parent's): it drops thinking, one of those turns has some, and a new turn is not a tool result."""
        return (self.drops_thinking and any(m.get("role") != "tool" for m in messages[k + 1:])
                and any(_has_thinking(m) for m in messages[:k] if m.get("role") == "assistant"))

    def _check_shape(self, key: tuple, uses: int | None, full: _Step, inc: _Step | None, prev_text: str) -> None:
        """Remember whether the incremental path gave what the full path gave for shape `key` (`uses`: its
        incremental uses since its last check, None when first seen): it must continue with the same bridge, and,
        for a template that keeps earlier thinking, `prev_text` + its text must be the rendered conversation."""
        same = (full.bridge is not None and inc is not None and inc[:2] == full[:2]
                and (self.drops_thinking or prev_text + inc.full_text == full.full_text))
        if len(self._shapes) >= _SHAPES_KEPT:
            self._shapes.clear()
        self._shapes[key] = 0 if same else -1
        if not same and uses is not None:
            self.incremental = False
            log.warning("prompt: the chat template rendered a continuation of an already checked conversation shape "
                        "differently from the full rendering; incremental prompt building is off for this proxy "
                        "(every continuation now renders the whole conversation)")

    def _in_full(self, full_text: str, reason: str, max_tokens: int | None) -> Prompt:
        self._check_bound(0, full_text, max_tokens)
        return Prompt(self.encode(full_text), full_text, None, reason)

    def _extend(self, parent: LLMCall, text: str | None, step: _Step, max_tokens: int | None, by: str,
                incremental: bool = False) -> Prompt:
        """The parent's prompt ids + its sampled ids (+ end-of-turn when the template closes the reply with
        one and it was not sampled) + the bridge's ids."""
        sampled = parent.completion_ids
        close = step.closed and (not sampled or sampled[-1] != self.end_of_turn_id)  # cut by max_tokens or a stop
        self._check_bound(len(parent.prompt_ids) + len(sampled) + close, step.bridge, max_tokens)
        ids = [*parent.prompt_ids, *sampled, *([self.end_of_turn_id] if close else ()), *self.encode(step.bridge)]
        return Prompt(ids, text, parent.call_id, None, by, incremental)

    def _check_bound(self, known: int, text: str, max_tokens: int | None) -> None:
        """Raise PromptTooLong when `known` tokens plus `text`'s lower bound already exceed `max_tokens`."""
        if max_tokens is not None and known + len(text) // self.max_token_bytes > max_tokens:
            if (n := known + self.min_tokens(text)) > max_tokens:
                raise PromptTooLong(n)

    # ---- probes (at construction) -------------------------------------------------------------------
    def _drops_thinking_probe(self) -> bool:
        """Whether the template renders an assistant turn's thinking (`<think>` in its text, or a
        `reasoning_content` field) differently once a user turn follows it (Qwen3 drops it then). A template
        that cannot render the probe counts as dropping."""
        for reply in ({"role": "assistant", "content": "<think>R</think>A"},
                      {"role": "assistant", "content": "A", "reasoning_content": "R"}):
            turn = [{"role": "user", "content": "U"}, reply]
            try:
                if not self.render(turn + [{"role": "user", "content": "V"}], None).startswith(
                        self.render(turn, None, False)):
                    return True
            except Exception:  # noqa: BLE001
                return True
        return False

    def _incremental_probe(self) -> bool:
        """Whether every continuation in a probe conversation (15 messages: text replies, tool calls and results,
        thinking and a reasoning field, a system turn; then the same without the system turn) gets the same
        bridge from the incremental path as from the full path, where `_shape` would take it. A template that
        cannot render tool calls is probed on text turns only (12 messages); one that cannot render those, or
        whose full path renders a probe continuation in full, never takes the incremental path."""
        def call(i: int, args: str = '{"x": 1}') -> dict[str, Any]:
            return {"id": f"call_{i}", "type": "function", "function": {"name": "probe", "arguments": args}}

        def turn(role: str, content: str, **more) -> dict[str, Any]:
            return {"role": role, "content": content, **more}

        tools = [{"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}]
        with_tools = [
            turn("system", "S"), turn("user", "U1"), turn("assistant", "A1"), turn("user", "U2"),
            turn("assistant", "<think>R2</think>A2", tool_calls=[call(0), call(1, '{"x": 2}')]),
            turn("tool", "T0", tool_call_id="call_0"), turn("tool", "T1", tool_call_id="call_1"),
            {"role": "assistant", "content": None, "tool_calls": [call(2)]}, turn("tool", "T2", tool_call_id="call_2"),
            turn("assistant", "<think>R3</think>A3"), turn("user", "U3"),
            turn("assistant", "A4", reasoning_content="R4"), turn("user", "U4"), turn("assistant", "A5"),
            {"role": "user", "content": [{"type": "text", "text": "U5"}]}]
        text_only = [turn("system", "S"), *(turn(role, f"{role[0].upper()}{i}") for i in range(1, 6)
                                           for role in ("user", "assistant")), turn("user", "U6")]
        text_only[4]["content"] = "<think>R2</think>A2"
        for conversation, probe_tools in ((with_tools, tools), (text_only, None)):
            try:
                return all(self._probe_agrees(messages, probe_tools) for messages in (conversation, conversation[1:]))
            except Exception:  # noqa: BLE001 - a template that cannot render this probe: the next, else never
                continue
        return False

    def _probe_agrees(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        """Whether each continuation of a reply in `messages` by the turns after it gets the same bridge (and,
        for a template that keeps earlier thinking, the same rendered conversation) from the incremental path as
        from the full path. Raises what rendering raises."""
        for k in range(1, len(messages)):
            if messages[k]["role"] != "assistant":
                continue
            prev_text = self.render(messages[:k], tools)
            j = k + 2
            while j <= len(messages) and messages[j - 1]["role"] != "assistant":
                if not self._rethinks(messages[:j], k):
                    full = self._continuation(prev_text, messages[:j], k, tools)
                    inc = self._incremental(messages[:j], k, tools)
                    if full.bridge is None or inc is None or inc[:2] != full[:2] or (
                            not self.drops_thinking and prev_text + inc.full_text != full.full_text):
                        return False
                j += 1
        return True


def find_parent(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                history: list[LLMCall]) -> tuple[LLMCall | None, str | None, str]:
    """The call `messages` continue, why none does, and how it was found: `(call, None, "id" | "text")` or
    `(None, reason, "none")`. By id first (the latest assistant turn carrying a tool-call id one of `history`'s
    calls sampled), then by text (the latest call whose messages + reply are a prefix of `messages`); see
    the module docstring for the rules."""
    if not history:
        return None, "first_call", "none"
    call, id_reason = _parent_by_id(messages, tools, history)
    if call is not None:
        return call, None, "id"
    reason = "history_differs"
    for call in reversed(history):
        k = len(call.messages)
        if len(messages) <= k + 1 or messages[k].get("role") != "assistant":
            continue
        if not all(_same(a, b) for a, b in zip(messages[:k], call.messages)):
            continue
        if not _same(messages[k], call.response_message, ignore_ids=True):
            continue
        if not _same_tools(tools, call.tools):
            reason = "tools_changed"
            continue
        return call, None, "text"
    return None, id_reason or reason, "none"


def _parent_by_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  history: list[LLMCall]) -> tuple[LLMCall | None, str | None]:
    """The call named by the request's latest assistant turn, when that turn carries a tool-call id a call
    of `history` sampled and `messages` continue that call; else None and why: "history_edited" when the
    messages before the turn are not the call's, "reply_edited" when the turn says something else than
    the call sampled, "tools_changed"; (None, None) when the latest assistant turn carries no such id."""
    j = next((i for i in range(len(messages) - 2, -1, -1) if messages[i].get("role") == "assistant"), None)
    if j is None:   # (the last message is the new turn, never a replayed reply)
        return None, None
    ids = {tc.get("id") for tc in messages[j].get("tool_calls") or []} - {None}
    call = next((c for c in reversed(history)
                 if ids & {tc.get("id") for tc in c.response_message.get("tool_calls") or []}), None) if ids else None
    if call is None:
        return None, None
    schemas = _schemas(tools)
    if j != len(call.messages) or not all(_same(a, b, schemas=schemas) for a, b in zip(messages[:j], call.messages)):
        return None, "history_edited"
    if not _same(messages[j], call.response_message, schemas=schemas):
        return None, "reply_edited"
    if not _same_tools(tools, call.tools):
        return None, "tools_changed"
    return call, None


def _bridge_past_dropped_thinking(turn_text: str, full_text: str, end_of_turn: str) -> str | None:
    """What follows the reply in `full_text` (the whole conversation rendered) when the template rendered
    everything up to the reply's end as in `turn_text` (rendered up to the reply, the reply last) except for
    `<think>...</think>` blocks it dropped; else None. The reply ends at the same end-of-turn count in both."""
    if not end_of_turn or end_of_turn not in turn_text:
        return None
    end = -1
    for _ in range(turn_text.count(end_of_turn)):
        end = full_text.find(end_of_turn, end + 1)
        if end < 0:
            return None
    end += len(end_of_turn)
    head = turn_text[:turn_text.rfind(end_of_turn) + len(end_of_turn)]
    return full_text[end:] if _THINK.sub("", full_text[:end]) == _THINK.sub("", head) else None


def _has_thinking(msg: dict[str, Any]) -> bool:
    """Whether a message holds thinking: a `<think>` or `</think>` in its text, or a reasoning field."""
    text = _text(msg.get("content"))
    return "<think>" in text or "</think>" in text or any(msg.get(f) is not None for f in _REASONING_FIELDS)


def _message_shape(msg: dict[str, Any], end_of_turn: str) -> tuple:
    """A message as `PromptBuilder._shape` tells messages apart: role, content type, number of tool calls (up to
    3), its keys with a value, whether it holds thinking, whether its text spells the end-of-turn token out."""
    content = msg.get("content")
    text = _text(content)
    return (msg.get("role"), type(content), min(len(msg.get("tool_calls") or ()), 3),
            frozenset(key for key, value in msg.items() if value is not None), _has_thinking(msg),
            bool(end_of_turn) and end_of_turn in text)


def _same_tools(a: list[dict[str, Any]] | None, b: list[dict[str, Any]] | None) -> bool:
    return a == b or _canon(a) == _canon(b)   # == first: no JSON dumps when equal


def _schemas(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Tool name -> its parameters' JSON schema."""
    return {t.get("function", {}).get("name"): t.get("function", {}).get("parameters") or {} for t in tools or []}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _tool_calls(msg: dict[str, Any], ignore_ids: bool) -> list[tuple]:
    out = []
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function", {})
        args = fn.get("arguments", "{}")
        try:   # arguments compare as JSON (spacing aside); a string that is not JSON, or too deep, as text
            args = _canon(json.loads(args) if isinstance(args, str) else args)
        except (ValueError, RecursionError):
            args = args if isinstance(args, str) else repr(args)
        out.append((None if ignore_ids else tc.get("id"), fn.get("name"), args))
    return out


def _same(a: dict[str, Any], b: dict[str, Any], ignore_ids: bool = False,
          schemas: dict[str, Any] | None = None) -> bool:
    """Two wire messages say the same thing (None-valued keys, part lists and JSON spacing aside). With
    `schemas` (tool name -> parameters schema), tool-call arguments compare by meaning (`_same_args`)."""
    if a == b:   # equal dicts say the same thing in every mode; compared in C, the usual case for a parent's messages
        return True
    if not (a.get("role") == b.get("role") and _text(a.get("content")).strip() == _text(b.get("content")).strip()
            and (ignore_ids or a.get("tool_call_id") == b.get("tool_call_id"))):
        return False
    if schemas is None:
        return _tool_calls(a, ignore_ids) == _tool_calls(b, ignore_ids)
    calls_a, calls_b = a.get("tool_calls") or [], b.get("tool_calls") or []
    return len(calls_a) == len(calls_b) and all(
        x.get("id") == y.get("id") and x.get("function", {}).get("name") == (name := y.get("function", {}).get("name"))
        and _same_args(x.get("function", {}).get("arguments"), y.get("function", {}).get("arguments"),
                       schemas.get(name))
        for x, y in zip(calls_a, calls_b))


def _same_args(a: Any, b: Any, schema: dict[str, Any] | None) -> bool:
    """Tool-call arguments (JSON strings or objects) that differ at most in serialisation: spacing, key
    order, number formatting (`1` and `1.0`), and keys one side leaves out where the other has the value
    the schema gives as the key's `default`. Arguments that are not JSON compare as text."""
    try:
        a, b = (json.loads(x) if isinstance(x, str) else x for x in (a, b))
    except (ValueError, RecursionError):
        return isinstance(a, str) and isinstance(b, str) and a.strip() == b.strip()
    try:
        return _same_value(a, b, schema)
    except RecursionError:
        return False


def _same_value(a: Any, b: Any, schema: Any) -> bool:
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(a, dict) and isinstance(b, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in a.keys() ^ b.keys():   # on one side only: allowed at its schema default
            prop = props.get(key)
            value = a[key] if key in a else b[key]
            if not (isinstance(prop, dict) and "default" in prop and _same_value(value, prop["default"], prop)):
                return False
        return all(_same_value(a[k], b[k], props.get(k)) for k in a.keys() & b.keys())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y, schema.get("items")) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):   # True == 1 in Python, not in JSON
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _calls_spell(msg: dict[str, Any], token: str) -> bool:
    """Whether a message's tool calls (names, arguments) write `token` out literally (so that the first
    `token` after the reply's start may not be its end). Its text needs no such check: the one-render path
    requires the text before the first `token`, which it cannot be when it holds one."""
    return any(token in str(tc.get("function", {}).get(key, "")) for tc in msg.get("tool_calls") or []
               for key in ("name", "arguments"))


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)
