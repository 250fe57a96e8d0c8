"""The recording proxy: an OpenAI-compatible `/v1/chat/completions` endpoint per episode.

Each episode gets `http://127.0.0.1:PORT/ep/<token>/v1` as its base_url, `<token>` (unguessable,
also accepted as `Authorization: Bearer <token>` on `/v1/...`) as its api_key. A request's path is a
straight line: find the episode -> validate the body -> choose sampling params -> build the prompt ids
(token-in-token-out) -> generate -> parse tool calls -> record an `LLMCall` -> answer.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`: bad input is a 4xx
naming what is wrong (never echoing more than ~200 characters of it), an engine failure a 503 with
`Retry-After`, and only a bug in the proxy itself a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ajet.chat_template import parse_tool_calls
from ajet.engine import Engine
from ajet.llm_call import LLMCall, SamplingParams
from ajet.proxy.prompt import PromptBuilder
from ajet.proxy.schema import ChatCompletionRequest, NamedToolChoice, short_repr

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20   # 8 MiB


@dataclass
class EpisodeEndpoint:
    """What a workflow needs to reach the proxy for one episode."""

    episode_id: str
    base_url: str
    api_key: str


@dataclass
class _Episode:
    episode_id: str
    token: str
    calls: list[LLMCall] = field(default_factory=list)
    open: bool = True


class ProxyError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type, offending param, code.

    `retry_after` (seconds) becomes a `Retry-After` header; a 503 always carries one (1 s unless given),
    so clients with retries (the OpenAI SDK) back off and try again.
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after if retry_after is not None or status != 503 else 1

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """The JSON body `{"error": {"message", "type", "param", "code"}}` with this status."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(body, status_code=self.status, headers=headers or None)


class ProxyServer:
    """Serves the proxy with uvicorn in a background thread (its own event loop) on `host`.

    Args:
        engine: generates completions (see `ajet.engine.Engine`).
        tokenizer: the policy's tokenizer with a tool-capable chat template.
        defaults: sampling parameters from the config.
        sampling_policy: "config" (config temperature/top_p win; client max_tokens capped by config) or
            "client" (client values win where given).
        max_model_len: prompt + completion limit, tokens; longer prompts get a 400.
        model_name: the name `/v1/models` lists.
        host: bind address; 127.0.0.1 unless you need the proxy reachable from elsewhere.
        max_body_bytes: largest request body, bytes (Content-Length and the bytes actually sent);
            larger ones get a 413. Default 8 MiB.
        accepted_models: the `model` names accepted besides `model_name`; None (the default) accepts any
            name. With a set, other names get a 404 `model_not_found` listing the accepted ones.
        retry_after_s: the `Retry-After` (seconds) of the 503 answered when the engine fails.
    """

    def __init__(self, engine: Engine, tokenizer, defaults: SamplingParams, sampling_policy: str = "config",
                 max_model_len: int = 4096, model_name: str = "ajet-policy", host: str = "127.0.0.1",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, accepted_models: Iterable[str] | None = None,
                 retry_after_s: int = 1):
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.defaults = defaults
        self.sampling_policy = sampling_policy
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.host = host
        self.max_body_bytes = max_body_bytes
        if isinstance(accepted_models, str):
            accepted_models = [accepted_models]
        self.accepted_models = None if accepted_models is None else {model_name, *accepted_models}
        self.retry_after_s = retry_after_s
        self.port: int | None = None
        self._episodes: dict[str, _Episode] = {}   # token -> episode
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> ProxyServer:
        """Bind a free port on `host` and serve in a daemon thread. Raises RuntimeError if it won't start."""
        # proto IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # Nagle holds each response body behind its headers for a delayed ACK (~40 ms a request)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", loop="asyncio", access_log=False,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="ajet-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"proxy did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- episodes ---------------------------------------------------------------------------------
    def open_episode(self, episode_id: str) -> EpisodeEndpoint:
        """Register an episode; its calls are recorded until `close_episode`."""
        token = "ajet-" + secrets.token_urlsafe(24)
        with self._lock:
            self._episodes[token] = _Episode(episode_id, token)
        return EpisodeEndpoint(episode_id, f"{self.url}/ep/{token}/v1", token)

    def close_episode(self, endpoint: EpisodeEndpoint) -> list[LLMCall]:
        """Stop accepting calls for the episode (later ones get 404) and return its calls in order."""
        with self._lock:
            ep = self._episodes.pop(endpoint.api_key)
        ep.open = False
        return ep.calls

    def _episode(self, token: str | None) -> _Episode:
        with self._lock:
            ep = self._episodes.get(token or "")
        if ep is None:
            raise ProxyError(404 if token else 401,
                             "unknown or finished episode: use the base_url and api_key ajet gave this episode"
                             if token else "missing episode token: pass the episode's api_key as the Bearer token",
                             "invalid_request_error" if token else "authentication_error",
                             code="episode_not_found" if token else "invalid_api_key")
        return ep

    # ---- HTTP -------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="ajet proxy", docs_url=None, redoc_url=None)

        @app.exception_handler(ProxyError)
        async def _proxy_error(_req: Request, exc: ProxyError):
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(req: Request, exc: StarletteHTTPException):  # unknown path, wrong method
            return ProxyError(exc.status_code, f"{exc.detail}: {req.method} {_cut(req.url.path, 200)}",
                              code=str(exc.detail).lower().replace(" ", "_")).response(exc.headers)

        app.add_middleware(_CatchAll)   # any other exception: a 500 OpenAI-style body, connection kept

        @app.post("/ep/{token}/v1/chat/completions")
        async def chat_by_path(token: str, request: Request):
            return await self.chat_completions(self._episode(token), request)

        @app.post("/ep/{token}/agent/{tag}/v1/chat/completions")
        async def chat_by_agent(token: str, tag: str, request: Request):
            return await self.chat_completions(self._episode(token), request, agent_tag=tag)

        @app.post("/v1/chat/completions")
        async def chat_by_key(request: Request):
            return await self.chat_completions(self._episode(_bearer(request)), request)

        @app.get("/ep/{token}/v1/models")
        async def models_by_path(token: str):
            self._episode(token)
            return self._models()

        @app.get("/v1/models")
        async def models_by_key(request: Request):
            self._episode(_bearer(request))
            return self._models()

        @app.post("/ep/{token}/v1/responses")
        @app.post("/v1/responses")
        async def responses(token: str | None = None):
            raise ProxyError(404, "ajet's proxy serves the Chat Completions API, not the Responses API: "
                                  "use client.chat.completions.create(...) (LangChain: use_responses_api=False)",
                             code="unsupported_endpoint")

        return app

    def _models(self) -> dict[str, Any]:
        names = [self.model_name] + sorted((self.accepted_models or set()) - {self.model_name})
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "ajet"} for n in names]}

    def _check_model(self, model: str) -> None:
        """Raise a 404 `model_not_found` unless `model` is accepted (any name when no set is configured)."""
        if self.accepted_models is not None and model not in self.accepted_models:
            raise ProxyError(404, f"the model {short_repr(model, 100)} does not exist on this proxy; accepted: "
                                  + ", ".join(sorted(self.accepted_models)), param="model", code="model_not_found")

    async def chat_completions(self, ep: _Episode, request: Request, agent_tag: str = "default"):
        """Handle one chat completion for episode `ep` (see the module docstring for the steps).

        `agent_tag` names which agent of a multi-agent workflow called; token-in-token-out looks for the
        call's parent among that agent's calls only, and the tracker merges each agent's calls apart.
        """
        t0 = time.perf_counter()
        req = await _parse(request, self.max_body_bytes)
        self._check_model(req.model)
        _reject_unsupported(req)
        sampling = self._sampling(req)
        messages, tools = req.wire_messages(), req.wire_tools()
        prompt = self.prompts.build(messages, tools, [c for c in ep.calls if c.agent_tag == agent_tag])
        forced = _forced_tool_call(req)          # tool_choice required/named: the call's opening is given
        prompt_ids = prompt.ids + self.prompts.encode(forced) if forced else prompt.ids
        if len(prompt_ids) + 1 > self.max_model_len:
            raise ProxyError(400, f"the prompt is {len(prompt_ids)} tokens; this model's context holds "
                                  f"{self.max_model_len}: shorten the conversation", param="messages",
                             code="context_length_exceeded")
        t1 = time.perf_counter()
        try:
            completion = await self.engine.generate(prompt_ids, sampling)
        except ValueError as exc:
            raise ProxyError(400, str(exc), param="messages", code="context_length_exceeded") from exc
        except Exception as exc:  # noqa: BLE001 - an engine failure is the server's fault, not the client's
            log.warning("proxy: engine failed: %r", exc)
            raise ProxyError(503, f"the inference engine failed ({type(exc).__name__}: {_cut(str(exc), 200)}); "
                                  "retry later", "server_error", code="engine_error",
                             retry_after=self.retry_after_s) from exc
        t2 = time.perf_counter()

        text = forced + self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        content, tool_calls = parse_tool_calls(text) if tools and req.tool_choice != "none" else (text, [])
        finish = "tool_calls" if tool_calls else completion.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if not ep.open:
            raise ProxyError(404, "the episode finished while this call was running", code="episode_not_found")
        call = LLMCall(
            call_id=f"call-{ep.episode_id}-{len(ep.calls)}", episode_id=ep.episode_id, agent_tag=agent_tag,
            index=len(ep.calls), messages=messages, tools=tools, prompt_ids=prompt_ids,
            completion_ids=completion.token_ids, completion_logprobs=completion.logprobs, finish_reason=finish,
            response_message=message, sampling=sampling, policy_version=completion.policy_version,
            timings={"prepare_s": t1 - t0, "generate_s": t2 - t1, "total_s": time.perf_counter() - t0},
            prompt_parent=prompt.parent_call_id, prompt_render_reason=prompt.render_reason, forced_text=forced,
        )
        ep.calls.append(call)
        body = self._completion_body(call, req, text_logprobs=bool(req.logprobs))
        if req.stream:
            return StreamingResponse(_sse(body, req), media_type="text/event-stream")
        return JSONResponse(body)

    def _sampling(self, req: ChatCompletionRequest) -> SamplingParams:
        d = self.defaults
        asked_max = req.max_completion_tokens or req.max_tokens
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if self.sampling_policy == "client":
            return SamplingParams(
                temperature=d.temperature if req.temperature is None else max(req.temperature, 1e-3),
                top_p=d.top_p if req.top_p is None else req.top_p,
                max_tokens=asked_max or d.max_tokens, seed=req.seed, stop=stop)
        return SamplingParams(temperature=d.temperature, top_p=d.top_p,
                              max_tokens=min(asked_max or d.max_tokens, d.max_tokens), seed=req.seed, stop=stop)

    def _completion_body(self, call: LLMCall, req: ChatCompletionRequest, text_logprobs: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": call.response_message, "finish_reason": call.finish_reason,
                                  "logprobs": None}
        if text_logprobs:
            choice["logprobs"] = {"content": [
                {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(call.completion_ids, call.completion_logprobs)]}
        n_prompt, n_completion = len(call.prompt_ids), len(call.completion_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": req.model, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                          "total_tokens": n_prompt + n_completion}}


class _CatchAll:
    """ASGI middleware: an unexpected exception in a handler (a bug; bad input never gets here) becomes a 500
    OpenAI-style body and is logged. Unlike an `exception_handler(Exception)`, which Starlette answers and then
    re-raises (uvicorn then drops the keep-alive connection under the client's next request), the exception
    stops here. One raised after the response started is re-raised: the client sees a cut-off response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the catch-all
            if started:
                raise
            log.error("proxy: unexpected %s in %s %s", type(exc).__name__, scope.get("method"), scope.get("path"),
                      exc_info=exc)
            response = ProxyError(500, f"internal error in the ajet proxy ({type(exc).__name__}); see the proxy's log",
                                  "server_error", code="internal_error").response()
            await response(scope, receive, send)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes. Raises ProxyError 413 when the Content-Length or the bytes
    actually sent (a chunked body has no Content-Length) exceed it, 400 for a malformed Content-Length."""
    too_large = ProxyError(413, f"the request body is larger than this proxy's limit of {limit} bytes: "
                                "shorten the conversation or raise max_body_bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not re.fullmatch(r"\s*[0-9]{1,20}\s*", declared):
            raise ProxyError(400, "the Content-Length header is not a non-negative integer", code="invalid_request")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (key or value) holding a lone UTF-16 surrogate, else None.
    JSON `\\ud800` escapes decode to such strings, which cannot be encoded as UTF-8 (tokenizer, response)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                if not _utf8_ok(k):
                    return _cut(p, 200)
                stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
        elif isinstance(v, str) and not _utf8_ok(v):
            return _cut(path, 200)
    return None


def _cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (plus "..." when cut)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


async def _parse(request: Request, max_body_bytes: int) -> ChatCompletionRequest:
    """The validated request. Raises ProxyError: 413 for an oversized body, 400 for anything malformed (not
    JSON, not an object, lone surrogates, a schema violation: the message names the field and quotes at most
    ~200 characters of the offending value)."""
    raw = await _read_body(request, max_body_bytes)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, >4300-digit ints, nesting
        raise ProxyError(400, f"the request body is not valid JSON: {_cut(str(exc), 200)}",
                         code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ProxyError(400, "the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate_path(data)) is not None:
        raise ProxyError(400, f"{where}: the string holds a lone UTF-16 surrogate (\\ud800-\\udfff escape), "
                              "which is not valid Unicode text", param=where, code="invalid_value")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _cut(".".join(str(p) for p in err["loc"]), 200)
        extra = err["type"] == "extra_forbidden"
        msg = "unsupported parameter" if extra else _cut(err["msg"].removeprefix("Value error, "), 300)
        got = "" if extra or err["type"] == "missing" else f" (got {short_repr(err['input'], 200)})"
        raise ProxyError(400, f"{param}: {msg}{got}", param=param,
                         code="unsupported_parameter" if extra else "invalid_value") from exc


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    """A field ajet cannot honour is a 400 naming it, never silently dropped."""
    if req.n not in (None, 1):
        raise ProxyError(400, "n > 1 is not supported: send n separate requests", param="n", code="unsupported_value")
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise ProxyError(400, "tool_choice asks for a tool call but the request has no `tools`", param="tool_choice",
                         code="invalid_value")
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.get("name")
        if name not in {t.function.name for t in req.tools}:
            raise ProxyError(400, f"tool_choice names function {name!r}, which is not in `tools`",
                             param="tool_choice", code="invalid_value")
    if req.frequency_penalty or req.presence_penalty:
        raise ProxyError(400, "frequency/presence penalties would change the sampling distribution the policy is "
                              "trained on: remove them", param="frequency_penalty", code="unsupported_value")
    if req.top_logprobs:
        raise ProxyError(400, "top_logprobs is not supported yet: use logprobs=true", param="top_logprobs",
                         code="unsupported_value")
    if req.response_format and req.response_format.get("type") not in ("text", "json_object"):
        raise ProxyError(400, "response_format: only 'text' and 'json_object' are accepted",
                         param="response_format", code="unsupported_value")


def _forced_tool_call(req: ChatCompletionRequest) -> str:
    """The opening of a tool call that `tool_choice` makes certain, as a grammar-constrained decoder would
    force it: "required" fixes `<tool_call>` and the name key; a named function also fixes its name and
    the arguments' opening brace, and, when its schema has exactly one property, which is required, that
    key (plus the opening quote for a string). These tokens end the prompt (loss mask 0); the model
    samples the rest."""
    if req.tool_choice == "required":
        return '<tool_call>\n{"name": "'
    if not isinstance(req.tool_choice, NamedToolChoice):
        return ""
    name = req.tool_choice.function["name"]
    text = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": {'
    params = next(t.function.parameters for t in req.tools if t.function.name == name) or {}
    props, required = params.get("properties") or {}, params.get("required") or []
    if len(props) == 1 and list(props) == list(required):
        key = required[0]
        text += json.dumps(key) + ": " + ('"' if props[key].get("type") == "string" else "")
    return text


async def _sse(body: dict[str, Any], req: ChatCompletionRequest):
    """OpenAI SSE chunks for a finished completion: role, content, tool_calls, finish, usage, [DONE]."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    choice = body["choices"][0]
    msg = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, usage=None) -> str:
        choices = [] if usage is not None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        return "data: " + json.dumps({**base, "choices": choices, **({"usage": usage} if usage else {})}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if msg.get("content"):
        yield chunk({"content": msg["content"]})
    for i, tc in enumerate(msg.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                     "function": {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}}]})
    yield chunk({}, choice["finish_reason"])
    if req.stream_options and req.stream_options.include_usage:
        yield chunk({}, usage=body["usage"])
    yield "data: [DONE]\n\n"
    await asyncio.sleep(0)
