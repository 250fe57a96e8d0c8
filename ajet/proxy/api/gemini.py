"""The Gemini API (`POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens`; also
under `/v1/`, which the SDKs use for some base URLs) as an adapter to the turn type
(https://ai.google.dev/api/generate-content).

The body is validated as it comes (`GeminiRequest`, `CountTokensRequest`: pydantic models of every field the
proxy reads), so a value of the wrong type anywhere is a 400 naming its path, never an error inside the adapter.
Request -> turn: `systemInstruction` becomes the system message; each `contents` entry's parts become chat
messages: a user turn's `text` parts the user message and its `functionResponse` parts tool messages (before
the text, in order; a response that is one string field, e.g. `{"output": "..."}`, is that string, any other
the JSON of the object), a model turn's `text` parts the assistant text and its `functionCall` parts tool calls
(`args` as the JSON arguments, `id` as the call id); `thought` parts are dropped. `tools[].functionDeclarations`
(`parameters`, with OpenAPI's upper-case types lowered, or `parametersJsonSchema`) become function tools; other
tools (google search, code execution, ...) are left out and counted. `toolConfig.functionCallingConfig.mode`
AUTO / ANY / NONE / VALIDATED map to auto / required (named when it allows one function) / none / auto.
`generationConfig` `temperature`, `topP`, `maxOutputTokens`, `stopSequences`, `candidateCount`, `seed` are
honoured; non-zero penalties are a 400 (they change the distribution the policy is trained on), and so is `topK`
under `sampling_policy: client` (under `config`, the default, the config's sampling replaces the client's:
`topK` is ignored, as Gemini CLI sends `topK: 64` on every call);
`responseMimeType: application/json` and a response schema are accepted, not constrained (as `strict` tools).

Turn -> answer: a `GenerateContentResponse` (`candidates[].content.parts`: the text, then one `functionCall`
per tool call with the id the proxy issued; `finishReason` STOP or MAX_TOKENS; `usageMetadata`), streamed as
server-sent events (`?alt=sse`), one partial response per write, the last with the function calls, finish
reason and usage. Errors have Google's shape `{"error": {"code", "message", "status"}}`. The episode token is
the API key (`x-goog-api-key`, `?key=`) or in the base URL (`.../ep/<token>`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator
from pydantic.alias_generators import to_camel
from starlette.responses import Response

from ajet.proxy.api import Api
from ajet.proxy.schema import ChatCompletionRequest, FunctionName, json_schema_object, short_repr
from ajet.proxy.turn import Choice, OpenEpisode, Prepared, Turn
from ajet.proxy.wire import ProxyError, json_response, validated

# google.rpc.Code names by HTTP status (https://cloud.google.com/apis/design/errors)
_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


class _Camel(BaseModel):
    """camelCase fields (as the REST API and the SDKs send them), snake_case accepted too; others a 400."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class _Open(_Camel):
    """A nested object: unknown fields are kept and ignored (fields the API may add), as chat messages'."""

    model_config = ConfigDict(extra="allow", alias_generator=to_camel, populate_by_name=True)


class FunctionCall(_Open):
    """A model turn's `functionCall` part (https://ai.google.dev/api/caching#FunctionCall)."""

    name: str = Field(min_length=1)
    id: str | None = None
    args: dict[str, Any] | None = None


class FunctionResponse(_Open):
    """A user turn's `functionResponse` part: the result of the call `id` (or, without ids, `name`)."""

    name: str = Field(min_length=1)
    id: str | None = None
    response: dict[str, Any]


class Part(_Open):
    """One part of a `Content`. The kinds the proxy reads are fields; any other kind (inlineData, fileData,
    executableCode, ...) is kept as an extra and refused where the turn is read (`_to_chat`)."""

    text: str | None = None
    thought: StrictBool | None = None
    thought_signature: str | None = None
    function_call: FunctionCall | None = None
    function_response: FunctionResponse | None = None


class Content(_Open):
    """One turn of `contents`: `role` user (the default), model, or function (a turn of function responses)."""

    role: Literal["user", "model", "function"] | None = None
    parts: list[Part]


def _instruction(v: Any) -> Any:
    """`systemInstruction` given as a plain string (the SDKs' shorthand) as its one text part."""
    return {"parts": [{"text": v}]} if isinstance(v, str) else v


class SystemInstruction(_Open):
    """`systemInstruction`: text parts (its role, if any, is ignored)."""

    role: str | None = None
    parts: list[Part] = []


class FunctionDeclaration(_Open):
    """A function tool: `parameters` in OpenAPI's subset (upper-case types), or `parametersJsonSchema`; either is
    a JSON-schema object."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _openapi_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return json_schema_object(_lower_types(v))

    _json_schema_object = field_validator("parameters_json_schema")(json_schema_object)


class Tool(_Open):
    """A `tools` entry: `functionDeclarations`; any other key is a hosted tool (googleSearch, codeExecution,
    ...), left out and counted."""

    function_declarations: list[FunctionDeclaration] | None = None


def _upper(v: Any) -> Any:
    return v.upper() if isinstance(v, str) else v


class FunctionCallingConfig(_Open):
    """`toolConfig.functionCallingConfig`: the mode (upper-cased; None = AUTO) and the functions it may call."""

    mode: Annotated[Literal["AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED"] | None,
                    BeforeValidator(_upper)] = None   # None: AUTO
    allowed_function_names: list[str] | None = None


class ToolConfig(_Open):
    """`toolConfig` of a Gemini request."""

    function_calling_config: FunctionCallingConfig | None = None


class SafetySetting(_Open):
    """One entry of `safetySettings`: accepted and not applied (the engine has no safety filter)."""

    category: str | None = None
    threshold: str | None = None


class GenerationConfig(_Camel):
    """`generationConfig`: sampling settings with their allowed ranges (temperature 0-2, topP in (0, 1],
    1-8 candidates); a value out of range is a 400 naming it."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: float | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    stop_sequences: list[str] | None = None
    candidate_count: int | None = Field(None, ge=1, le=8)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # accepted, not constrained / ignored
    response_mime_type: str | None = None
    response_schema: Any = None
    response_json_schema: Any = None
    thinking_config: dict[str, Any] | None = None
    response_modalities: list[str] | None = None


class GeminiRequest(_Camel):
    """`generateContent` body (https://ai.google.dev/api/generate-content#request-body), every field typed: a
    value of the wrong type anywhere is a 400 naming its path (e.g. `tools.0.functionDeclarations: Input should be
    a valid list`)."""

    contents: list[Content] = Field(min_length=1)
    system_instruction: Annotated[SystemInstruction | None, BeforeValidator(_instruction)] = None
    tools: list[Tool] | None = None
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None
    # hosted-service fields: accepted and ignored
    safety_settings: list[SafetySetting] | None = None
    labels: dict[str, str] | None = None
    cached_content: str | None = None   # refused in `parse`: a hosted cache the proxy does not have


class _WrappedRequest(GeminiRequest):
    """`countTokens`' `generateContentRequest`: a `generateContent` body with its `model`."""

    model: str | None = None


class CountTokensRequest(GeminiRequest):
    """`countTokens` body: `contents` (and, as a convenience, the other `generateContent` fields), or a whole
    `generateContentRequest`."""

    contents: list[Content] | None = None
    generate_content_request: _WrappedRequest | None = None


@dataclass
class _Context:
    request: GeminiRequest
    model: str
    hosted_tools: list[str] = field(default_factory=list)


class GeminiApi(Api):
    """The Gemini API adapter (see the module docstring)."""

    name = "gemini"
    id_prefix = "gen_"
    routes = tuple((f"/{version}/models/{{model}}:{action}", "POST", kind) for version in ("v1beta", "v1")
                   for action, kind in (("generateContent", "serve"), ("streamGenerateContent", "serve"),
                                        ("countTokens", "count_tokens")))
    error_paths = (":generateContent", ":streamGenerateContent", ":countTokens")

    def error_response(self, err: ProxyError) -> Response:
        headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
        return json_response(_error_body(err), err.status, headers)

    def error_event(self, err: ProxyError) -> str:
        return f"data: {orjson.dumps(_error_body(err)).decode()}\n\n"

    def count_body(self, n: int) -> dict[str, Any]:
        return {"totalTokens": n}

    # ---- request -> turn --------------------------------------------------------------------------
    def parse_request(self, data: dict[str, Any], ep: OpenEpisode, route: dict[str, Any],
                      count_only: bool = False) -> tuple[ChatCompletionRequest, _Context]:
        """The turn for a body of `route` (`path_params` holds the model; a `:streamGenerateContent` path
        streams). `countTokens` may wrap the body in `generateContentRequest`."""
        req: GeminiRequest = validated(CountTokensRequest if count_only else GeminiRequest, data)
        at = ""                    # where the request's fields are in the body (errors name them from the body's root)
        if isinstance(req, CountTokensRequest):
            req, at = _count_request(req)
        gen = req.generation_config or GenerationConfig()
        if req.cached_content is not None:
            raise ProxyError(400, f"{at}cachedContent: hosted context caches are not supported: send the contents",
                             param=f"{at}cachedContent", code="unsupported_parameter")
        if gen.top_k is not None and getattr(self.proxy, "sampling_policy", "config") == "client":
            raise ProxyError(400, f"{at}generationConfig.topK: ajet's engine samples with temperature and topP only "
                                  "(topK would change the distribution the policy is trained on): remove it",
                             param=f"{at}generationConfig.topK", code="unsupported_parameter")
        if gen.presence_penalty or gen.frequency_penalty:
            which = "presencePenalty" if gen.presence_penalty else "frequencyPenalty"
            raise ProxyError(400, f"{at}generationConfig.{which}: presence/frequency penalties would change the "
                                  "sampling distribution the policy is trained on: remove them",
                             param=f"{at}generationConfig.{which}", code="unsupported_value")
        messages = []
        if req.system_instruction is not None and req.system_instruction.parts:
            messages.append({"role": "system", "content": _texts(req.system_instruction.parts,
                                                                 f"{at}systemInstruction.parts")})
        for k, content in enumerate(req.contents):
            messages += _to_chat(content, f"{at}contents.{k}")
        if not messages or messages[-1]["role"] == "assistant":
            raise ProxyError(400, f"{at}contents: end with a user turn (a final model turn, a prefill, is not "
                                  "supported)", param=f"{at}contents", code="invalid_value")
        tools, hosted = _tools(req.tools or [])
        _check_allowed_names(req.tool_config, tools, at)
        if hosted:
            self.hosted_tools_left_out += len(hosted)
        model = route.get("path_params", {}).get("model", "")
        chat: dict[str, Any] = {"model": model, "messages": messages,
                                "stream": ":streamGenerateContent" in route.get("path", "")}
        if tools:
            chat["tools"] = tools
            chat.update(_tool_choice(req.tool_config))
        for name, value in (("max_tokens", gen.max_output_tokens), ("temperature", gen.temperature),
                            ("top_p", gen.top_p), ("stop", gen.stop_sequences), ("n", gen.candidate_count),
                            ("seed", gen.seed)):
            if value is not None:
                chat[name] = value
        turn = validated(ChatCompletionRequest, chat)
        if turn.stream and (turn.n or 1) > 1:
            raise ProxyError(400, f"{at}generationConfig.candidateCount: a streamed response has one candidate",
                             param=f"{at}generationConfig.candidateCount", code="unsupported_value")
        return turn, _Context(req, model, hosted)

    def parse(self, data: dict[str, Any], ep: OpenEpisode, count_only: bool = False):
        return self.parse_request(data, ep, {}, count_only)

    # ---- turn -> answer ---------------------------------------------------------------------------
    def body(self, turn: Turn, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
        n_in = len(choices[0].call.prompt_ids)
        n_out = sum(len(c.completion.token_ids) for c in choices)
        return {"candidates": [_candidate(c, _parts(c)) for c in choices], "usageMetadata": _usage(n_in, n_out),
                "modelVersion": prep.context.model, "responseId": turn.response_id}

    async def events(self, turn: Turn, prep: Prepared, events: asyncio.Queue, first):
        """One `data:` event per wake-up with the text sampled since; the last adds the function calls, the
        finish reason and the usage."""
        base = {"modelVersion": prep.context.model, "responseId": turn.response_id}
        async for deltas, finished in self.steps(turn, events, first):
            parts = [{"text": d} for d in deltas]
            if finished is None:
                if parts:
                    yield _sse({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}], **base})
                continue
            parts += [p for p in _parts(finished) if "functionCall" in p]
            n_in = len(finished.call.prompt_ids) if finished.call is not None else len(prep.prompt_ids or [])
            yield _sse({"candidates": [_candidate(finished, parts)],
                        "usageMetadata": _usage(n_in, len(finished.completion.token_ids)), **base})
        if (err := turn.error()) is not None:
            yield self.error_event(err)


def _error_body(err: ProxyError) -> dict[str, Any]:
    status = _STATUS.get(err.status, "INVALID_ARGUMENT" if err.status < 500 else "INTERNAL")
    return {"error": {"code": err.status, "message": err.message, "status": status}}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {orjson.dumps(data).decode()}\n\n"


def _usage(n_in: int, n_out: int) -> dict[str, int]:
    return {"promptTokenCount": n_in, "candidatesTokenCount": n_out, "totalTokenCount": n_in + n_out}


def _candidate(c: Choice, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": {"role": "model", "parts": parts}, "index": c.index,
            "finishReason": "MAX_TOKENS" if c.completion.finish_reason == "length" else "STOP"}


def _parts(c: Choice) -> list[dict[str, Any]]:
    """A choice's message as parts: its text, then one `functionCall` per tool call (arguments that are not a
    JSON object become `{}`; the recorded call keeps what the model wrote)."""
    parts: list[dict[str, Any]] = []
    if c.message.get("content"):
        parts.append({"text": c.message["content"]})
    for tc in c.message.get("tool_calls") or []:
        try:
            args = json.loads(tc["function"]["arguments"])
        except (ValueError, RecursionError):
            args = None
        parts.append({"functionCall": {"id": tc["id"], "name": tc["function"]["name"],
                                       "args": args if isinstance(args, dict) else {}}})
    return parts


def _count_request(req: CountTokensRequest) -> tuple[GeminiRequest, str]:
    """The request a `countTokens` body counts, and where it is in the body: its `generateContentRequest`, or
    itself. Raises ProxyError 400 for neither `contents` nor `generateContentRequest`, or both."""
    wrapped = req.generate_content_request
    if wrapped is None:
        if req.contents is None:
            raise ProxyError(400, "contents: Field required (or send a generateContentRequest)", param="contents",
                             code="invalid_value")
        return req, ""
    others = sorted(req.model_fields_set - {"generate_content_request"})
    if others:
        name = req.model_fields[others[0]].alias or others[0]
        raise ProxyError(400, f"{name}: send either generateContentRequest or the request's fields, not both",
                         param=name, code="invalid_value")
    return wrapped, "generateContentRequest."


def _texts(parts: list[Part], where: str) -> str:
    """The text of a list of text parts (joined as written). Raises ProxyError 400 for another part."""
    texts = []
    for k, part in enumerate(parts):
        if part.text is None or part.function_call is not None or part.function_response is not None:
            raise ProxyError(400, f"{where}.{k}: only text parts are supported here", param=f"{where}.{k}",
                             code="unsupported_value")
        texts.append(part.text)
    return "".join(texts)


def _to_chat(content: Content, where: str) -> list[dict[str, Any]]:
    """One `Content` -> chat messages (see the module docstring). Raises ProxyError 400 for a part the turn's
    role cannot hold (a function call in a user turn, a function response in a model turn, media)."""
    role = content.role or "user"
    texts, calls, out = [], [], []
    for k, part in enumerate(content.parts):
        if part.thought:
            continue
        if part.text is not None:
            texts.append(part.text)
        elif part.function_call is not None and role == "model":
            fc = part.function_call
            calls.append({"id": fc.id or fc.name, "type": "function",
                          "function": {"name": fc.name, "arguments": json.dumps(fc.args or {}, ensure_ascii=False)}})
        elif part.function_response is not None and role != "model":
            fr = part.function_response
            out.append({"role": "tool", "tool_call_id": fr.id or fr.name, "content": _response_text(fr.response)})
        else:
            kinds = sorted(k2 for k2, v in part if v is not None and k2 not in ("thought", "thought_signature"))
            if not kinds:               # an empty part, or one carrying only a thought signature
                continue
            here = f"{where}.parts.{k}"
            raise ProxyError(400, f"{here}: part {short_repr([to_camel(k2) for k2 in kinds])} is not supported in "
                                  f"a {role} turn (text, functionCall in model turns, functionResponse in user turns "
                                  "are)",
                             param=here, code="unsupported_value")
    if role == "model":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _response_text(response: Any) -> str:
    """A function response as the tool message's text: the string of a one-field object (`{"output": "..."}`),
    else the object as JSON."""
    if isinstance(response, dict) and len(response) == 1 and isinstance(next(iter(response.values())), str):
        return next(iter(response.values()))
    return json.dumps(response, ensure_ascii=False)


def _tools(tools: list[Tool]) -> tuple[list[dict[str, Any]], list[str]]:
    """`functionDeclarations` -> chat function tools, and the kinds of the other (hosted) tools left out."""
    out, hosted = [], []
    for t in tools:
        hosted += sorted(t.model_extra or {})
        for d in t.function_declarations or []:
            schema = d.parameters_json_schema if d.parameters_json_schema is not None else d.parameters
            fn = {"name": d.name, "description": d.description,
                  "parameters": schema if schema is not None else {"type": "object", "properties": {}}}
            out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out, hosted


def _lower_types(schema: Any) -> Any:
    """An OpenAPI schema as Gemini writes it (`"type": "OBJECT"`) with JSON Schema's lower-case types."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def _check_allowed_names(config: ToolConfig | None, tools: list[dict[str, Any]], at: str = "") -> None:
    """Raises ProxyError 400 naming the first of `allowedFunctionNames` that no function declaration has (`at`:
    where the request is in the body)."""
    fc = config.function_calling_config if config is not None else None
    if fc is None or not fc.allowed_function_names or not tools:
        return
    declared = {t["function"]["name"] for t in tools}
    for k, name in enumerate(fc.allowed_function_names):
        if name not in declared:
            where = f"{at}toolConfig.functionCallingConfig.allowedFunctionNames.{k}"
            raise ProxyError(400, f"{where}: no function declaration is named {short_repr(name)}", param=where,
                             code="invalid_value")


def _tool_choice(config: ToolConfig | None) -> dict[str, Any]:
    """`toolConfig.functionCallingConfig` as the chat `tool_choice` (see the module docstring)."""
    fc = (config.function_calling_config if config is not None else None) or FunctionCallingConfig()
    allowed = fc.allowed_function_names or []
    if fc.mode == "ANY":
        if len(allowed) == 1:
            return {"tool_choice": {"type": "function", "function": {"name": allowed[0]}}}
        return {"tool_choice": "required"}
    if fc.mode == "NONE":
        return {"tool_choice": "none"}
    return {"tool_choice": "auto"}     # AUTO, VALIDATED, MODE_UNSPECIFIED
