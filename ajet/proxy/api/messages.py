"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as an adapter.

Request -> turn: `system` (a string or text blocks) becomes the system message; each message's blocks
become chat messages: `text` the content, `tool_use` an assistant tool call (its `input` as the JSON
arguments), `tool_result` a tool message, `thinking` dropped (a policy without a thinking template
produces none); `tools` with `input_schema` become function tools (server tools such as web search,
which the policy cannot run, are left out and counted); `tool_choice` auto / any / tool / none and
`disable_parallel_tool_use` map to their chat equivalents; `stop_sequences`, `max_tokens`,
`temperature`, `top_p` are honoured; `top_k` is a 400 (the engine samples without it).

Turn -> answer: a `message` with `text` and `tool_use` content blocks, `stop_reason` (end_turn,
max_tokens, stop_sequence, tool_use) and `usage`; streamed as message_start, content_block_start /
content_block_delta (text_delta, input_json_delta) / content_block_stop, message_delta, message_stop.
Errors have Anthropic's shape `{"type": "error", "error": {"type", "message"}}`; a malformed field is a 400
naming its path in the request (`messages.1.content.2.name: ...`): the body and each block the adapter reads
(`ToolUseBlock`, `ToolResultBlock`, `CustomTool`, `ToolChoice`) are pydantic models.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from starlette.responses import Response

from ajet.proxy.api import Api, validated_at
from ajet.proxy.schema import ChatCompletionRequest, FunctionName, json_schema_object, short_repr
from ajet.proxy.turn import Choice, OpenEpisode, Prepared, Turn
from ajet.proxy.wire import ProxyError, validated


class _Open(BaseModel):
    """A nested object: unknown fields (cache_control, citations, ...) are kept and ignored."""

    model_config = ConfigDict(extra="allow")


class ToolUseBlock(_Open):
    """An assistant message's `tool_use` block."""

    type: Literal["tool_use"]
    id: str | None = None
    name: str = Field(min_length=1)
    input: dict[str, Any] | None = None


class ToolResultBlock(_Open):
    """A user message's `tool_result` block (`content`: a string or text blocks, read by `_text_blocks`)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = None
    is_error: StrictBool | None = None


class CustomTool(_Open):
    """A `tools` entry the policy can call (one with `input_schema`; server tools are left out)."""

    type: Literal["custom"] | None = None
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]

    _json_schema_object = field_validator("input_schema")(json_schema_object)


class ToolChoice(_Open):
    """`tool_choice` of a Messages request: auto, any, a named tool, or none."""

    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None     # the tool `type: "tool"` names
    disable_parallel_tool_use: StrictBool | None = None


class MessagesRequest(BaseModel):
    """`POST /v1/messages` body. Unknown fields are a 400 naming them; the hosted-feature ones listed last
    are accepted and ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)    # required by `parse` except for count_tokens
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stream: StrictBool | None = False
    # hosted features: accepted and ignored
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    mcp_servers: list[dict[str, Any]] | None = None
    thread: Any = None      # refused in the shape the SDKs recover from (see `parse`)


@dataclass
class _Context:
    request: MessagesRequest
    server_tools: list[str] = field(default_factory=list)


class MessagesApi(Api):
    """The Anthropic Messages adapter (see the module docstring)."""

    name = "messages"
    id_prefix = "msg_"
    routes = (("/v1/messages", "POST", "serve"), ("/v1/messages/count_tokens", "POST", "count_tokens"))
    error_paths = ("/v1/messages",)


    def error_response(self, err: ProxyError) -> Response:
        return err.anthropic_response()

    def error_event(self, err: ProxyError) -> str:
        return _event("error", err.anthropic_body())

    # ---- request -> turn --------------------------------------------------------------------------
    def parse(self, data: dict[str, Any], ep: OpenEpisode, count_only: bool = False) -> tuple[ChatCompletionRequest, _Context]:
        req: MessagesRequest = validated(MessagesRequest, data)
        if req.max_tokens is None and not count_only:
            raise ProxyError(400, "max_tokens: Field required", param="max_tokens", code="invalid_value")
        if req.thread is not None:   # server-side threads (beta): the SDKs then resend the full history unthreaded
            raise ProxyError(400, "thread: server-side message threads are not supported; send the full history",
                             param="thread", code="thread_unsupported_request",
                             details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]})
        if req.top_k is not None:
            raise ProxyError(400, "top_k: ajet's engine samples with temperature and top_p only (top_k would change the "
                                  "distribution the policy is trained on): remove it", param="top_k",
                             code="unsupported_parameter")
        messages = []
        if req.system:
            messages.append({"role": "system", "content": _text_blocks(req.system, "system")})
        for k, m in enumerate(req.messages):
            messages += _to_chat(m, f"messages.{k}")
        if messages[-1]["role"] == "assistant":
            raise ProxyError(400, "messages: a final assistant message (prefill) is not supported: end with a user "
                                  "turn", param=f"messages.{len(req.messages) - 1}", code="invalid_value")
        tools, server = [], []
        for k, t in enumerate(req.tools or []):
            if t.get("type") not in (None, "custom") or "input_schema" not in t:
                server.append(str(t.get("type") or t.get("name")))
                continue
            tool: CustomTool = validated_at(CustomTool, t, f"tools.{k}")
            fn = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
            tools.append({"type": "function", "function": {k2: v for k2, v in fn.items() if v is not None}})
        if server:
            self.hosted_tools_left_out += len(server)
        chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
        if tools:
            chat["tools"] = tools
            choice = req.tool_choice or ToolChoice()
            if choice.type == "tool" and choice.name is None:
                raise ProxyError(400, "tool_choice.name: Field required (the tool that type \"tool\" calls)",
                                 param="tool_choice.name", code="invalid_value")
            chat["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"any": "required"}.get(choice.type, choice.type))
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        for name, value in (("max_tokens", req.max_tokens), ("temperature", req.temperature), ("top_p", req.top_p),
                            ("stop", req.stop_sequences)):
            if value is not None:
                chat[name] = value
        return validated(ChatCompletionRequest, chat), _Context(req, server)

    # ---- turn -> answer ---------------------------------------------------------------------------
    def body(self, turn: Turn, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
        (c,) = choices
        reason, sequence = self._stop(turn, prep, c)
        return {"id": turn.response_id, "type": "message", "role": "assistant", "model": prep.req.model,
                "content": _blocks(c), "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(len(c.call.prompt_ids), len(c.completion.token_ids))}

    def _stop(self, turn: Turn, prep: Prepared, c: Choice) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence of a finished choice."""
        if c.message.get("tool_calls"):
            return "tool_use", None
        if c.completion.finish_reason == "length":
            return "max_tokens", None
        asked = prep.context.request.stop_sequences or []
        if asked:
            text = turn.forced + self.proxy.decode(c.completion.token_ids)
            hits = [(text.find(s), s) for s in asked if s and s in text]
            if hits:
                return "stop_sequence", min(hits)[1]
        return "end_turn", None

    async def events(self, turn: Turn, prep: Prepared, events: asyncio.Queue, first):
        """message_start, the content blocks as they are sampled, message_delta, message_stop."""
        start = {"id": turn.response_id, "type": "message", "role": "assistant", "model": prep.req.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": _usage(len(prep.prompt_ids) if prep.prompt_ids is not None      # a retry's replay:
                                 else len(turn.task.result()[0].call.prompt_ids), 0)}   # the first attempt's
        out = [_event("message_start", {"type": "message_start", "message": start})]
        text_open = False
        async for deltas, finished in self.steps(turn, events, first):
            for delta in deltas:
                if not text_open:
                    out.append(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                              "content_block": {"type": "text", "text": ""}}))
                    text_open = True
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                          "delta": {"type": "text_delta", "text": delta}}))
            if finished is not None:
                out += self._finish_events(turn, prep, finished, text_open)
            if out:
                yield "".join(out)
                out = []
        if (err := turn.error()) is not None:
            out.append(self.error_event(err))
        yield "".join(out)

    def _finish_events(self, turn: Turn, prep: Prepared, c: Choice, text_open: bool) -> list[str]:
        out, index = [], 0
        if text_open:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
            index = 1
        for block in _blocks(c):
            if block["type"] != "tool_use":
                continue
            out += [_event("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {**block, "input": {}}}),
                    _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": json.dumps(block["input"])}}),
                    _event("content_block_stop", {"type": "content_block_stop", "index": index})]
            index += 1
        reason, sequence = self._stop(turn, prep, c)
        out += [_event("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": {"output_tokens": len(c.completion.token_ids)}}),
                _event("message_stop", {"type": "message_stop"})]
        return out


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {orjson.dumps(data).decode()}\n\n"


def _usage(n_in: int, n_out: int) -> dict[str, int]:
    return {"input_tokens": n_in, "output_tokens": n_out, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def _blocks(c: Choice) -> list[dict[str, Any]]:
    """A choice's message as content blocks: its text, then one `tool_use` per tool call (arguments that
    are not a JSON object become `{}`; the recorded call keeps what the model wrote)."""
    blocks: list[dict[str, Any]] = []
    if c.message.get("content"):
        blocks.append({"type": "text", "text": c.message["content"]})
    for tc in c.message.get("tool_calls") or []:
        try:
            args = json.loads(tc["function"]["arguments"])
        except (ValueError, RecursionError):
            args = None
        blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                       "input": args if isinstance(args, dict) else {}})
    return blocks


def _text_blocks(content: Any, where: str) -> str:
    """Text of a string or of text blocks (joined by a blank line). Raises ProxyError 400 for anything else:
    another block type, a block whose `text` is not a string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProxyError(400, f"{where}: must be a string or a list of text blocks (got {short_repr(content)})",
                         param=where, code="invalid_value")
    texts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ProxyError(400, f"{where}.{k}: only text blocks are supported here (got "
                                  f"{short_repr(block.get('type') if isinstance(block, dict) else block)})",
                             param=f"{where}.{k}", code="unsupported_value")
        texts.append(_block_text(block, f"{where}.{k}"))
    return "\n\n".join(texts)


def _block_text(block: dict[str, Any], where: str) -> str:
    """A text block's `text` (missing or null: ""). Raises ProxyError 400 when it is not a string."""
    text = block.get("text")
    if text is not None and not isinstance(text, str):
        raise ProxyError(400, f"{where}.text: must be a string (got {short_repr(text)})", param=f"{where}.text",
                         code="invalid_value")
    return text or ""


def _to_chat(m: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages: a user message's `tool_result` blocks become tool messages
    (in order) and its text one user message; an assistant message's text and `tool_use` blocks one
    assistant message; thinking blocks are dropped. Raises ProxyError 400 for an empty block list, and for
    a user message with nothing left once its thinking blocks are dropped."""
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise ProxyError(400, f"{where}.role: must be user or assistant (got {short_repr(role)})",
                         param=f"{where}.role", code="invalid_value")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise ProxyError(400, f"{where}.content: must be a string or a non-empty list of blocks (got "
                              f"{short_repr(content)})", param=f"{where}.content", code="invalid_value")
    out: list[dict[str, Any]] = []
    texts, calls = [], []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.content.{k}"
        if kind == "text":
            texts.append(_block_text(block, here))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            use: ToolUseBlock = validated_at(ToolUseBlock, block, here)
            calls.append({"id": use.id, "type": "function",
                          "function": {"name": use.name, "arguments": json.dumps(use.input or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            res: ToolResultBlock = validated_at(ToolResultBlock, block, here)
            text = (res.content if isinstance(res.content, str)
                    else _text_blocks([] if res.content is None else res.content, f"{here}.content"))
            out.append({"role": "tool", "tool_call_id": res.tool_use_id, "content": text})
        else:
            raise ProxyError(400, f"{here}: block type {short_repr(kind)} is not supported in a {role} message "
                                  "(text, tool_use, tool_result and thinking are)", param=f"{here}.type",
                             code="unsupported_value")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts) if texts else None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if texts:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    if not out:
        raise ProxyError(400, f"{where}.content: a user message needs a text or tool_result block (thinking blocks "
                              "are dropped)", param=f"{where}.content", code="invalid_value")
    return out
