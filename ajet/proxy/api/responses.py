"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) as an adapter to the turn type.

Request -> turn: `instructions` becomes the system message; `input` (a string, or items: messages with
roles system/developer/user/assistant, `function_call`, `function_call_output`, `reasoning`; an
`item_reference` stands for the item of that id the episode already has) becomes chat messages, an
assistant message and the function calls that follow it merging into one assistant turn
(exactly the message the proxy recorded, so token-in-token-out finds its parent); `previous_response_id`
prepends the stored conversation of that response (kept per episode, so a chained conversation is exact
by construction); function `tools` (namespaced lists flattened) become chat tools, hosted tools (web
search, file search, ...) that the policy cannot run are left out and counted.

Turn -> answer: a `response` object whose `output` holds a `message` item (the text) and one
`function_call` item per tool call; streamed as the Responses event sequence (response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta ..., function call
arguments, output_item.done, response.completed with usage). Hosted-service fields (metadata,
prompt_cache_key, include, reasoning, store, ...) are accepted and ignored (docs/protocols.md). A malformed
field is a 400 naming its path in the request (`input.2.name: ...`): the body and each item the adapter
reads (`FunctionCallItem`, `FunctionCallOutputItem`, `FunctionTool`, `FunctionChoice`) are pydantic models.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from ajet.proxy.api import Api, validated_at
from ajet.proxy.schema import ChatCompletionRequest, FunctionName, json_schema_object, short_repr
from ajet.proxy.turn import Choice, OpenEpisode, Prepared, Turn
from ajet.proxy.wire import ProxyError, validated

log = logging.getLogger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


class TextFormat(BaseModel):
    """`text.format`: `{"type": "text" | "json_object" | ...}` (other keys, e.g. a json_schema's, kept)."""

    model_config = ConfigDict(extra="allow")
    type: str


class TextConfig(BaseModel):
    """`text`: the output format (`format`, an object) and hosted options (`verbosity`, ...: kept, ignored)."""

    model_config = ConfigDict(extra="allow")
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class _Open(BaseModel):
    """A nested object: unknown fields (status, namespace, ...) are kept and ignored."""

    model_config = ConfigDict(extra="allow")


class FunctionCallItem(_Open):
    """An input `function_call` item (a call the policy made earlier)."""

    type: Literal["function_call"]
    call_id: str | None = None
    id: str | None = None
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] | None = None


class FunctionCallOutputItem(_Open):
    """An input `function_call_output` item (`output`: a string or content parts, read by `_text`)."""

    type: Literal["function_call_output"]
    call_id: str
    output: Any = None


class FunctionTool(_Open):
    """A `tools` entry of type function."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    _json_schema_object = field_validator("parameters")(json_schema_object)


class FunctionChoice(_Open):
    """`tool_choice: {"type": "function", "name"}`."""

    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` body. Unknown fields are a 400 naming them; the hosted-service ones listed
    last are accepted and ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool | None = False
    text: TextConfig | None = None
    # refused when set to something ajet cannot do (see `_reject`)
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    # hosted-service fields: accepted and ignored
    stream_options: dict[str, Any] | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    client_metadata: dict[str, Any] | None = None
    max_tool_calls: int | None = None


@dataclass
class _Context:
    """What the answer needs besides the turn: the request as given, and the conversation (without the
    instructions) this response continues."""

    request: ResponsesRequest
    conversation: list[dict[str, Any]]
    hosted_tools: list[str] = field(default_factory=list)


class ResponsesApi(Api):
    """The Responses API adapter (see the module docstring)."""

    name = "responses"
    id_prefix = "resp_"
    routes = (("/v1/responses", "POST", "serve"), ("/v1/responses/{response_id}", "GET", "stored"))


    # ---- request -> turn --------------------------------------------------------------------------
    def parse(self, data: dict[str, Any], ep: OpenEpisode) -> tuple[ChatCompletionRequest, _Context]:
        req: ResponsesRequest = validated(ResponsesRequest, data)
        _reject(req)
        conversation: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = ep.responses.get(req.previous_response_id)
            if stored is None:
                raise ProxyError(400, f"previous response {short_repr(req.previous_response_id, 100)} not found in "
                                      "this episode", param="previous_response_id", code="previous_response_not_found")
            conversation = list(stored["conversation"])
        items = ([{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str)
                 else _resolve_references(req.input, ep))
        conversation += _items_to_messages(items)
        tools, hosted = _flatten_tools(req.tools or [])
        if hosted:
            self.hosted_tools_left_out += len(hosted)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        if not messages:
            raise ProxyError(400, "input: the request has no input items", param="input", code="invalid_value")
        chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
        if tools:
            chat["tools"] = tools
            if req.tool_choice is not None:
                chat["tool_choice"] = _tool_choice(req.tool_choice)
            if req.parallel_tool_calls is not None:
                chat["parallel_tool_calls"] = req.parallel_tool_calls
        for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                            ("top_p", req.top_p)):
            if value is not None:
                chat[name] = value
        if req.text is not None and req.text.format.type == "json_object":
            if not any("json" in (m.get("content") or "").lower() for m in messages):
                raise ProxyError(400, "text.format: the instructions or input must contain the word 'json' in some "
                                      "form, to use 'text.format' of type 'json_object'", param="text.format",
                                 code="invalid_value")
            chat["response_format"] = {"type": "json_object"}
        return validated(ChatCompletionRequest, chat), _Context(req, conversation, hosted)

    # ---- turn -> answer ---------------------------------------------------------------------------
    def recorded(self, ep: OpenEpisode, turn: Turn, prep: Prepared, choices: list[Choice]) -> None:
        """Keep the response (its body, and its conversation for `previous_response_id`), and its input and
        output items by id (for `item_reference`)."""
        (choice,) = choices
        body = self._response(turn, prep, choice)
        ep.responses[turn.response_id] = {"body": body, "conversation": prep.context.conversation + [choice.message]}
        request_input = prep.context.request.input
        for item in (request_input if isinstance(request_input, list) else []) + body["output"]:
            if isinstance(item, dict) and isinstance(item.get("id"), str) and item.get("type") != "item_reference":
                ep.items[item["id"]] = item

    def stored(self, ep: OpenEpisode, response_id: str) -> dict[str, Any]:
        """The body of response `response_id` of episode `ep`. Raises ProxyError 404 if there is none."""
        stored = ep.responses.get(response_id)
        if stored is None:
            raise ProxyError(404, f"no response {short_repr(response_id, 100)} in this episode",
                             param="response_id", code="response_not_found")
        return stored["body"]

    def body(self, turn: Turn, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
        return self._response(turn, prep, choices[0])

    def _response(self, turn: Turn, prep: Prepared, choice: Choice | None) -> dict[str, Any]:
        """The `response` object; `choice` None gives the in-progress one (no output yet)."""
        r: ResponsesRequest = prep.context.request
        body = {"id": turn.response_id, "object": "response", "created_at": turn.created,
                "status": "in_progress", "error": None, "incomplete_details": None, "model": r.model,
                "instructions": r.instructions, "output": [], "parallel_tool_calls": r.parallel_tool_calls is not False,
                "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "temperature": r.temperature,
                "top_p": r.top_p, "max_output_tokens": r.max_output_tokens,
                "previous_response_id": r.previous_response_id, "metadata": r.metadata or {},
                "text": r.text.model_dump() if r.text else {"format": {"type": "text"}},
                "truncation": r.truncation or "disabled",
                "store": r.store is not False, "background": False, "reasoning": r.reasoning or {},
                "service_tier": "default", "user": r.user, "usage": None}
        if choice is not None:
            body["output"] = _output_items(turn, choice)
            if choice.completion.finish_reason == "length":
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            else:
                body["status"] = "completed"
            n_in, n_out = len(choice.call.prompt_ids), len(choice.completion.token_ids)
            body["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": n_in + n_out}
        return body

    async def events(self, turn: Turn, prep: Prepared, events: asyncio.Queue, first):
        """The Responses event sequence, each event `event: <type>` + `data: {"type", "sequence_number", ...}`."""
        seq = itertools.count()

        def ev(kind: str, **fields) -> str:
            data = orjson.dumps({"type": kind, "sequence_number": next(seq), **fields}).decode()
            return f"event: {kind}\ndata: {data}\n\n"

        started = self._response(turn, prep, None)
        out = [ev("response.created", response=started), ev("response.in_progress", response=started)]
        msg_id, text_open = _message_id(turn), False

        def open_text() -> list[str]:
            item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
            return [ev("response.output_item.added", output_index=0, item=item),
                    ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})]

        async for deltas, finished in self.steps(turn, events, first):
            for delta in deltas:
                if not text_open:
                    out += open_text()
                    text_open = True
                out.append(ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                              delta=delta, logprobs=[]))
            if finished is not None:
                out += self._finish_events(ev, turn, finished, text_open)
            if out:
                yield "".join(out)
                out = []
        if (err := turn.error()) is not None:
            out.append(ev("error", code=err.code, message=err.message, param=err.param))
        else:
            out.append(ev("response.completed", response=self._response(turn, prep, turn.task.result()[0])))
        yield "".join(out)

    @staticmethod
    def _finish_events(ev, turn: Turn, choice: Choice, text_open: bool) -> list[str]:
        """Close the text item (if any) and send each function call as added / arguments / done."""
        items = _output_items(turn, choice)
        out = []
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                part = item["content"][0]
                out += [ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]),
                        ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                        ev("response.output_item.done", output_index=index, item=item)]
                continue
            out += [ev("response.output_item.added", output_index=index,
                       item={**item, "arguments": "", "status": "in_progress"}),
                    ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"]),
                    ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"]),
                    ev("response.output_item.done", output_index=index, item=item)]
        return out


def _reject(req: ResponsesRequest) -> None:
    """Fields ajet cannot honour: a 400 naming them."""
    for name, value, why in (("background", req.background, "background responses are not supported"),
                             ("conversation", req.conversation, "hosted conversations are not supported: send the "
                                                                "input, or use previous_response_id"),
                             ("prompt", req.prompt, "hosted prompt templates are not supported"),
                             ("top_logprobs", req.top_logprobs, "logprobs are served by /v1/chat/completions only")):
        if value:
            raise ProxyError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    kind = req.text.format.type if req.text is not None else "text"
    if kind not in ("text", "json_object"):
        raise ProxyError(400, f"text.format type {short_repr(kind)} is not supported (ajet samples without a grammar): "
                              "use 'json_object' and describe the schema in the prompt",
                         param="text.format.type", code="unsupported_value")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or the concatenated text of its parts. Raises ProxyError 400 for an
    image, file or audio part (the policy reads text only) and for a part whose text is not a string."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ProxyError(400, f"{where}: must be a string or a list of content parts", param=where, code="invalid_value")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ProxyError(400, f"{where}.{k}: content part type {short_repr(kind)} is not supported (text only)",
                             param=f"{where}.{k}.type", code="unsupported_value")
        key = "refusal" if kind == "refusal" else "text"
        text = part.get(key)
        if text is not None and not isinstance(text, str):
            raise ProxyError(400, f"{where}.{k}.{key}: must be a string (got {short_repr(text)})",
                             param=f"{where}.{k}.{key}", code="invalid_value")
        texts.append(text or "")
    return "".join(texts)


def _resolve_references(items: list[Any], ep: OpenEpisode) -> list[Any]:
    """`items` with each `{"type": "item_reference", "id"}` replaced by the item of that id: an output item of
    one of the episode's responses, or an input item with an id sent earlier in the episode (what clients that
    keep the default `store: true` send instead of the item). Raises ProxyError 400 `item_not_found` for an id
    the episode never saw."""
    out = []
    for k, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            ref = item.get("id")
            found = ep.items.get(ref) if isinstance(ref, str) else None
            if found is None:
                raise ProxyError(400, f"input.{k}.id: no item {short_repr(ref, 100)} in this episode (an item_reference "
                                      "names an output or input item of an earlier response of the same episode)",
                                 param=f"input.{k}.id", code="item_not_found")
            item = found
        out.append(item)
    return out


def _items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages. A `function_call` joins the assistant message just before
    it (the output of one response: its text, then its calls); `reasoning` items are dropped (the policy
    has no thinking template)."""
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        where = f"input.{k}"
        if not isinstance(item, dict):
            raise ProxyError(400, f"{where}: an input item must be an object", param=where, code="invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ProxyError(400, f"{where}.role: must be system, developer, user or assistant (got "
                                      f"{short_repr(role)})", param=f"{where}.role", code="invalid_value")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            fc: FunctionCallItem = validated_at(FunctionCallItem, item, where)
            call = {"id": fc.call_id or fc.id, "type": "function",
                    "function": {"name": fc.name, "arguments": fc.arguments or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last.get("content") == "":
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            fo: FunctionCallOutputItem = validated_at(FunctionCallOutputItem, item, where)
            out.append({"role": "tool", "tool_call_id": fo.call_id,
                        "content": fo.output if isinstance(fo.output, str) else _text(fo.output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise ProxyError(400, f"{where}.type: input item type {short_repr(kind)} is not supported", param=f"{where}.type",
                             code="unsupported_value")
    return out


def _flatten_tools(tools: list[Any], where: str = "tools") -> tuple[list[dict[str, Any]], list[str]]:
    """Responses tools -> chat function tools, and the types of the hosted tools left out. Grouped or
    namespaced lists (an entry with its own `tools`) are flattened. Raises ProxyError 400 for an entry that
    is not an object, a group whose `tools` is not a list, a malformed function tool (`FunctionTool`)."""
    out, hosted = [], []
    for k, t in enumerate(tools):
        here = f"{where}.{k}"
        if not isinstance(t, dict):
            raise ProxyError(400, f"{here}: a tool must be an object (got {short_repr(t)})", param=here,
                             code="invalid_value")
        if "tools" in t:
            if not isinstance(t["tools"], list):
                raise ProxyError(400, f"{here}.tools: must be a list of tools (got {short_repr(t['tools'])})",
                                 param=f"{here}.tools", code="invalid_value")
            inner, inner_hosted = _flatten_tools(t["tools"], f"{here}.tools")
            out += inner
            hosted += inner_hosted
        elif t.get("type") == "function":
            fn: FunctionTool = validated_at(FunctionTool, t, here)
            spec = {"name": fn.name, "description": fn.description, "parameters": fn.parameters, "strict": fn.strict}
            out.append({"type": "function", "function": {k2: v for k2, v in spec.items() if v is not None}})
        else:
            hosted.append(str(t.get("type")))
    return out, hosted


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": validated_at(FunctionChoice, choice, "tool_choice").name}}
    if choice.get("type") == "allowed_tools":
        return choice.get("mode", "auto")
    raise ProxyError(400, f"tool_choice type {short_repr(choice.get('type'))} names a hosted tool, which the policy "
                          "cannot run", param="tool_choice", code="unsupported_value")


def _message_id(turn: Turn) -> str:
    return "msg_" + turn.response_id.removeprefix("resp_")


def _output_items(turn: Turn, choice: Choice) -> list[dict[str, Any]]:
    """A choice as Responses output items: the text as a `message`, then one `function_call` per call."""
    items = []
    msg = choice.message
    if msg.get("content"):
        items.append({"type": "message", "id": _message_id(turn), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": msg["content"], "annotations": [], "logprobs": []}]})
    for tc in msg.get("tool_calls") or []:
        items.append({"type": "function_call", "id": "fc_" + tc["id"].removeprefix("call_"), "call_id": tc["id"],
                      "name": tc["function"]["name"], "arguments": tc["function"]["arguments"], "status": "completed"})
    return items

