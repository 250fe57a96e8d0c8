"""The Gemini API (`POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens`; also
under `/v1/`, which the SDKs use for some base URLs) as an adapter to the turn type
(https://ai.google.dev/api/generate-content).

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
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from starlette.responses import Response

from ajet.proxy.api import Api
from ajet.proxy.schema import ChatCompletionRequest, short_repr
from ajet.proxy.turn import Choice, Episode, Prepared, Turn
from ajet.proxy.wire import ProxyError, json_response, validated

# google.rpc.Code names by HTTP status (https://cloud.google.com/apis/design/errors)
_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


class _Camel(BaseModel):
    """camelCase fields (as the REST API and the SDKs send them), snake_case accepted too; others a 400."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class GenerationConfig(_Camel):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: float | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    stop_sequences: list[str] | None = None
    candidate_count: int | None = Field(None, ge=1, le=8)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # accepted, not constrained / ignored
    response_mime_type: str | None = None
    response_schema: Any = None
    response_json_schema: Any = None
    thinking_config: dict[str, Any] | None = None
    response_modalities: list[str] | None = None


class GeminiRequest(_Camel):
    """`generateContent` body."""

    contents: list[dict[str, Any]] = Field(min_length=1)
    system_instruction: dict[str, Any] | str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_config: dict[str, Any] | None = None
    generation_config: GenerationConfig | None = None
    # hosted-service fields: accepted and ignored
    safety_settings: list[dict[str, Any]] | None = None
    labels: dict[str, str] | None = None
    cached_content: str | None = None   # refused in `parse`: a hosted cache the proxy does not have


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
    def parse_request(self, data: dict[str, Any], ep: Episode, route: dict[str, Any],
                      count_only: bool = False) -> tuple[ChatCompletionRequest, _Context]:
        """The turn for a body of `route` (`path_params` holds the model; a `:streamGenerateContent` path
        streams). `countTokens` may wrap the body in `generateContentRequest`."""
        if count_only and isinstance(data.get("generateContentRequest"), dict):
            data = {k: v for k, v in data["generateContentRequest"].items() if k != "model"}
        req: GeminiRequest = validated(GeminiRequest, data)
        gen = req.generation_config or GenerationConfig()
        if req.cached_content is not None:
            raise ProxyError(400, "cachedContent: hosted context caches are not supported: send the contents",
                             param="cachedContent", code="unsupported_parameter")
        if gen.top_k is not None and getattr(self.proxy, "sampling_policy", "config") == "client":
            raise ProxyError(400, "generationConfig.topK: ajet's engine samples with temperature and topP only (topK "
                                  "would change the distribution the policy is trained on): remove it",
                             param="generationConfig.topK", code="unsupported_parameter")
        if gen.presence_penalty or gen.frequency_penalty:
            raise ProxyError(400, "generationConfig: presence/frequency penalties would change the sampling "
                                  "distribution the policy is trained on: remove them",
                             param="generationConfig.presencePenalty", code="unsupported_value")
        messages = []
        if req.system_instruction:
            system = req.system_instruction
            text = system if isinstance(system, str) else _texts(system.get("parts"), "systemInstruction.parts")
            messages.append({"role": "system", "content": text})
        for k, content in enumerate(req.contents):
            messages += _to_chat(content, f"contents.{k}")
        if not messages or messages[-1]["role"] == "assistant":
            raise ProxyError(400, "contents: end with a user turn (a final model turn, a prefill, is not supported)",
                             param="contents", code="invalid_value")
        tools, hosted = _tools(req.tools or [])
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
            raise ProxyError(400, "generationConfig.candidateCount: a streamed response has one candidate",
                             param="generationConfig.candidateCount", code="unsupported_value")
        return turn, _Context(req, model, hosted)

    def parse(self, data: dict[str, Any], ep: Episode, count_only: bool = False):
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


def _texts(parts: Any, where: str) -> str:
    """The text of a list of text parts (joined as written). Raises ProxyError 400 for another part."""
    if not isinstance(parts, list):
        raise ProxyError(400, f"{where}: must be a list of parts", param=where, code="invalid_value")
    texts = []
    for k, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise ProxyError(400, f"{where}.{k}: only text parts are supported here", param=f"{where}.{k}",
                             code="unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def _to_chat(content: Any, where: str) -> list[dict[str, Any]]:
    """One `Content` -> chat messages (see the module docstring)."""
    if not isinstance(content, dict):
        raise ProxyError(400, f"{where}: must be an object with `parts`", param=where, code="invalid_value")
    role = content.get("role") or "user"
    parts = content.get("parts")
    if role not in ("user", "model", "function"):
        raise ProxyError(400, f"{where}.role: must be user or model (got {short_repr(role)})", param=f"{where}.role",
                         code="invalid_value")
    if not isinstance(parts, list):
        raise ProxyError(400, f"{where}.parts: must be a list of parts", param=f"{where}.parts", code="invalid_value")
    texts, calls, out = [], [], []
    for k, part in enumerate(parts):
        here = f"{where}.parts.{k}"
        if not isinstance(part, dict):
            raise ProxyError(400, f"{here}: a part must be an object", param=here, code="invalid_value")
        if part.get("thought"):
            continue
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part.get("functionCall"), dict) and role == "model":
            fc = part["functionCall"]
            calls.append({"id": fc.get("id") or fc.get("name"), "type": "function",
                          "function": {"name": fc.get("name"),
                                       "arguments": json.dumps(fc.get("args") or {}, ensure_ascii=False)}})
        elif isinstance(part.get("functionResponse"), dict) and role != "model":
            fr = part["functionResponse"]
            out.append({"role": "tool", "tool_call_id": fr.get("id") or fr.get("name") or "",
                        "content": _response_text(fr.get("response"))})
        elif set(part) <= {"thoughtSignature", "thought_signature"}:
            continue
        else:
            kinds = sorted(set(part) - {"thoughtSignature", "thought_signature"})
            raise ProxyError(400, f"{here}: part {short_repr(kinds)} is not supported in a {role} turn (text, "
                                  "functionCall in model turns, functionResponse in user turns are)",
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


def _tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """`functionDeclarations` -> chat function tools, and the kinds of the other (hosted) tools left out."""
    out, hosted = [], []
    for t in tools:
        decls = t.get("functionDeclarations", t.get("function_declarations")) if isinstance(t, dict) else None
        if decls is None:
            hosted += [str(k) for k in t] if isinstance(t, dict) else ["?"]
            continue
        for d in decls:
            schema = d.get("parametersJsonSchema", d.get("parameters_json_schema"))
            if schema is None:
                schema = _lower_types(d.get("parameters") or {"type": "object", "properties": {}})
            fn = {"name": d.get("name"), "description": d.get("description"), "parameters": schema}
            out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out, hosted


def _lower_types(schema: Any) -> Any:
    """An OpenAPI schema as Gemini writes it (`"type": "OBJECT"`) with JSON Schema's lower-case types."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def _tool_choice(config: dict[str, Any] | None) -> dict[str, Any]:
    fc = (config or {}).get("functionCallingConfig") or (config or {}).get("function_calling_config") or {}
    mode = str(fc.get("mode") or "AUTO").upper()
    allowed = fc.get("allowedFunctionNames") or fc.get("allowed_function_names") or []
    if mode == "ANY":
        if len(allowed) == 1:
            return {"tool_choice": {"type": "function", "function": {"name": allowed[0]}}}
        return {"tool_choice": "required"}
    if mode == "NONE":
        return {"tool_choice": "none"}
    if mode in ("AUTO", "VALIDATED", "MODE_UNSPECIFIED"):
        return {"tool_choice": "auto"}
    raise ProxyError(400, f"toolConfig.functionCallingConfig.mode: must be AUTO, ANY, NONE or VALIDATED (got "
                          f"{short_repr(mode)})", param="toolConfig.functionCallingConfig.mode", code="invalid_value")
