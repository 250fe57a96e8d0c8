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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ajet.llm_call import LLMCall

_THINK = re.compile(r"<think>.*?</think>\s*", re.S)   # a thinking block, as templates that drop it write it

try:   # the pieces of `apply_chat_template` that `PromptBuilder.render` uses directly
    from transformers.utils.chat_template_utils import (_REASONING_FIELDS, _alias_reasoning_fields,
                                                        _compile_jinja_template)
except ImportError:  # another transformers: render through apply_chat_template
    _compile_jinja_template = None


@dataclass(frozen=True)
class Prompt:
    """A built prompt.

    Attributes:
        ids: `[prompt_len]` token ids for the engine.
        text: the chat template's rendering of the messages (what `ids` decode to when rendered in full).
        parent_call_id: the call it extends token-for-token, or None when rendered in full.
        render_reason: why it was rendered in full ("first_call", "reply_edited", "history_edited",
            "history_differs", "tools_changed", "template_not_append_only"), or None when it extends a parent.
        parent_by: how the parent was found: "id" (a tool-call id the proxy issued), "text", or "none".
    """

    ids: list[int]
    text: str
    parent_call_id: str | None
    render_reason: str | None
    parent_by: str = "none"


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
    """

    def __init__(self, tokenizer):
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
        self.single_render = self._append_only_probe()

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
               add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` (text, not ids): exactly `apply_chat_template(...,
        tokenize=False)`, minus its per-call copying of every message into plain JSON types (ours are
        plain JSON already: they come from a request body). Falls back to `apply_chat_template` when this
        `transformers` lacks the helpers used."""
        if _compile_jinja_template is None:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        # as apply_chat_template: None-valued keys dropped, reasoning fields aliased, special tokens passed
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if any(key in m for m in chat for key in _REASONING_FIELDS):
            chat = _alias_reasoning_fields(chat)
        template = _compile_jinja_template(self.tokenizer.get_chat_template(None, tools))
        return template.render(messages=chat, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **self._template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Text to ids; special tokens written in the text (`<|im_start|>`) map to their ids."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              history: list[LLMCall], rendered: dict[str, str] | None = None,
              max_tokens: int | None = None) -> Prompt:
        """Prompt ids for `messages`, extending the latest call in `history` that they continue.

        `rendered` maps call ids to their `Prompt.text` (a cache the caller keeps per episode; saves
        rendering the parent's messages again). Raises PromptTooLong when the prompt certainly has more
        than `max_tokens` tokens (a lower bound from the rendered text, checked before tokenizing it)."""
        parent, reason, by = find_parent(messages, tools, history)
        if parent is None:
            text = self.render(messages, tools)
            self._check_bound(0, text, max_tokens)
            return Prompt(self.encode(text), text, None, reason)
        k = len(parent.messages)
        prev_text = (rendered or {}).get(parent.call_id) or self.render(parent.messages, tools)  # the parent's prompt
        full_text = self.render(messages, tools)                                 # + its reply + the new turns
        if self.single_render and full_text.startswith(prev_text) and not _calls_spell(messages[k], self.end_of_turn):
            # the template appends (probed): the reply ends at the first end-of-turn after the parent's prompt
            cut = full_text.find(self.end_of_turn, len(prev_text))
            # and it renders the reply's text verbatim before it (so the text holds no end-of-turn of its own;
            # a template that rewrites the reply, e.g. drops its <think>, takes the checked path below)
            if cut >= 0 and _text(messages[k].get("content")).strip() in full_text[len(prev_text):cut]:
                return self._extend(parent, full_text, full_text[cut + len(self.end_of_turn):], True, max_tokens, by)
        turn_text = self.render(messages[:k + 1], tools, add_generation_prompt=False)  # + its reply
        if not turn_text.startswith(prev_text):
            return self._in_full(full_text, "template_not_append_only", max_tokens)
        if not full_text.startswith(turn_text):
            # a template that drops earlier turns' <think> (Qwen3 at a new user turn): the sampled tokens stay
            bridge = _bridge_past_dropped_thinking(turn_text, full_text, self.end_of_turn)
            if bridge is None:   # it rewrote more than the thinking
                return self._in_full(full_text, "template_not_append_only", max_tokens)
            return self._extend(parent, full_text, bridge, True, max_tokens, by)
        reply = turn_text[len(prev_text):]   # the reply as the template renders it, e.g. "text<|im_end|>\n"
        cut = reply.rfind(self.end_of_turn)  # the last one: the reply's text may spell the token out
        # what follows the sampled end-of-turn: separators ("\n"), then the new turns; a template that
        # drops the end-of-turn token gives no cut, and everything after the reply is new
        bridge = full_text[len(prev_text) + cut + len(self.end_of_turn):] if cut >= 0 else full_text[len(turn_text):]
        return self._extend(parent, full_text, bridge, cut >= 0, max_tokens, by)

    def _in_full(self, full_text: str, reason: str, max_tokens: int | None) -> Prompt:
        self._check_bound(0, full_text, max_tokens)
        return Prompt(self.encode(full_text), full_text, None, reason)

    def _extend(self, parent: LLMCall, full_text: str, bridge: str, closed: bool, max_tokens: int | None,
                by: str) -> Prompt:
        """The parent's prompt ids + its sampled ids (+ end-of-turn when the template closes the reply with
        one and it was not sampled) + the bridge's ids."""
        sampled = list(parent.completion_ids)
        if closed and (not sampled or sampled[-1] != self.end_of_turn_id):
            sampled.append(self.end_of_turn_id)    # cut by max_tokens or a stop string: close the turn
        self._check_bound(len(parent.prompt_ids) + len(sampled), bridge, max_tokens)
        return Prompt(list(parent.prompt_ids) + sampled + self.encode(bridge), full_text, parent.call_id, None, by)

    def _check_bound(self, known: int, text: str, max_tokens: int | None) -> None:
        """Raise PromptTooLong when `known` tokens plus `text`'s lower bound already exceed `max_tokens`."""
        if max_tokens is not None and known + len(text) // self.max_token_bytes > max_tokens:
            if (n := known + self.min_tokens(text)) > max_tokens:
                raise PromptTooLong(n)


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
