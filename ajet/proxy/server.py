"""The recording proxy: an OpenAI-compatible `/v1/chat/completions` endpoint per episode.

Each episode gets `http://127.0.0.1:PORT/ep/<token>/v1` as its base_url, `<token>` (unguessable,
also accepted as `Authorization: Bearer <token>` on `/v1/...`) as its api_key. A request's path is a
straight line: find the episode -> validate the body -> (a client retry? answer from the first attempt)
-> build the prompt ids (token-in-token-out) -> choose sampling params -> generate the `n` choices in a
task -> parse tool calls -> record one `LLMCall` per choice -> answer (streamed as tokens are sampled
when `stream` is set).

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`: bad input is a 4xx
naming what is wrong (never echoing more than ~200 characters of it), an engine failure a 503 with
`Retry-After`, and only a bug in the proxy itself a 500.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import uvicorn
import orjson
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ajet.chat_template import TOOL_CALL_END, parse_tool_calls
from ajet.engine import Engine
from ajet.llm_call import Completion, LLMCall, SamplingParams, TokenDelta
from ajet.proxy.prompt import Prompt, PromptBuilder, PromptTooLong
from ajet.proxy.stream import IncrementalContent, chunk, cut_at_stop, sse, tool_call_chunks
from ajet.proxy.schema import ChatCompletionRequest, NamedToolChoice, short_repr
from ajet.proxy.strict import StrictTools

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20   # 8 MiB
MAX_JSON_DEPTH = 100                 # nesting levels a request body may have (deeper: a 400, never a RecursionError)
PREPARE_WORKERS = 2                  # threads that parse, render and tokenize requests off the event loop


@dataclass
class EpisodeEndpoint:
    """What a workflow needs to reach the proxy for one episode."""

    episode_id: str
    base_url: str
    api_key: str


@dataclass
class _Choice:
    """One generated choice of a request, and the call it was recorded as."""

    index: int
    completion: Completion
    params: SamplingParams
    message: dict[str, Any]
    finish_reason: str
    started: float
    ended: float
    strict_violations: list[str] = field(default_factory=list)
    call: LLMCall | None = None


@dataclass
class _Turn:
    """One request's generation, shared by the client's retries of it.

    `events` (streaming requests only) receives `(choice_index, TokenDelta)` as tokens are sampled,
    `(choice_index, _Choice)` when a choice ends, and None when the task is done. `forced` is the
    tool-call opening `tool_choice` fixed, `parse_tools` whether tool calls are parsed out of the text,
    `stop` the stop strings generation used, `strict` the validators of the request's `strict: true` tools."""

    response_id: str
    created: int
    n: int
    streaming: bool
    forced: str
    parse_tools: bool
    stop: tuple[str, ...]
    strict: StrictTools | None = None
    task: asyncio.Future | None = None
    events: asyncio.Queue | None = None

    def __post_init__(self):
        if self.streaming:
            self.events = asyncio.Queue()

    @property
    def failed(self) -> bool:
        return self.task.done() and (self.task.cancelled() or self.task.exception() is not None)

    def error(self) -> ProxyError | None:
        """The error body of a finished generation that failed, else None. A generation cancelled because
        its episode was closed is a 404 `episode_closed`; an unexpected exception (a bug) a 500."""
        if self.task.cancelled():
            return _episode_closed()
        exc = self.task.exception()
        if exc is None or isinstance(exc, ProxyError):
            return exc
        log.error("proxy: unexpected %s in a generation", type(exc).__name__, exc_info=exc)
        return ProxyError(500, f"internal error in the ajet proxy ({type(exc).__name__}); see the proxy's log",
                          "server_error", code="internal_error")

    async def result(self) -> list[_Choice]:
        """The generation's choices, awaited without cancelling it when the waiting request is cancelled (the
        client went away: the generation still finishes and is recorded, and a retry gets its result).
        Raises the ProxyError of a failed generation (see `error`)."""
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            if self.task.cancelled():          # the episode was closed, not this request
                raise self.error() from None
            raise
        except ProxyError:
            raise
        except Exception:  # noqa: BLE001 - a bug: its 500 body, logged
            raise self.error() from None


@dataclass
class _Episode:
    episode_id: str
    token: str
    calls: list[LLMCall] = field(default_factory=list)
    turns: dict[str, _Turn] = field(default_factory=dict)   # request key -> its generation (for retries)
    rendered: dict[str, str] = field(default_factory=dict)   # call id -> its rendered prompt text (a cache)
    open: bool = True


@dataclass
class _Prepared:
    """What the prepare thread makes of a request body: the validated request, its retry key, and (unless
    it repeats an earlier request) its prompt."""

    req: ChatCompletionRequest
    key: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: Prompt | None = None
    prompt_ids: list[int] | None = None
    forced: str = ""
    strict: StrictTools | None = None


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

    def response(self, headers: dict[str, str] | None = None) -> Response:
        """The JSON body (see `body`) with this status."""
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return _json(self.body(), self.status, headers)

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`, as an answer or a streamed error event."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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

    Parsing, rendering and tokenizing a request run in a pool of `PREPARE_WORKERS` threads, never on the
    event loop, so that a request near the body limit does not stall other episodes' calls.
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
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()   # recently closed tokens
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None    # the server's event loop, once started
        self._prepare_pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="ajet-prepare")
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
        sock.bind((self.host, self.port or 0))   # `port` set before start (ajet serve), else a free one
        self.port = sock.getsockname()[1]
        # "auto": uvloop and httptools (the `uvicorn[standard]` extras ajet depends on) when importable
        config = uvicorn.Config(self.app, log_level="warning", loop="auto", http="auto", access_log=False,
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
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

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
        """Stop accepting calls for the episode and return its calls in order.

        Later calls get a 404; a call still being generated is cancelled and its client gets a 404
        `episode_closed` body (or error event, when streaming). Safe from any thread: the close runs on the
        proxy's event loop, so no call is recorded after the list is returned. Closing twice is harmless:
        the second close returns [] (the first returned the calls). Raises KeyError for a token this proxy
        never opened."""
        with self._lock:
            ep = self._episodes.pop(endpoint.api_key, None)
            if ep is None:
                if endpoint.api_key in self._closed:
                    return []
                raise KeyError(f"episode {endpoint.episode_id!r} was never opened on this proxy")
            self._closed[endpoint.api_key] = None
            while len(self._closed) > 100_000:          # remember the recent ones (tokens only)
                self._closed.popitem(last=False)
        loop = self._loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            self._close_on_loop(ep)
        else:
            asyncio.run_coroutine_threadsafe(_call(self._close_on_loop, ep), loop).result(timeout=30)
        return ep.calls

    @staticmethod
    def _close_on_loop(ep: _Episode) -> None:
        """Mark `ep` closed and cancel its generations nobody waits for any more (on the event loop)."""
        ep.open = False
        for turn in ep.turns.values():
            if turn.task is not None and not turn.task.done():
                turn.task.cancel()
        ep.turns.clear()

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
    def _build_app(self) -> Starlette:
        """The ASGI app: plain Starlette (the proxy needs routing and error handlers, nothing more)."""
        async def http_error(req: Request, exc: StarletteHTTPException):  # unknown path, wrong method
            return ProxyError(exc.status_code, f"{exc.detail}: {req.method} {_cut(req.url.path, 200)}",
                              code=str(exc.detail).lower().replace(" ", "_")).response(exc.headers)

        async def chat(request: Request):
            p = request.path_params
            token = p["token"] if "token" in p else _bearer(request)
            return await self.chat_completions(self._episode(token), request, agent_tag=p.get("tag", "default"))

        async def models(request: Request):
            self._episode(request.path_params.get("token") or _bearer(request))
            return _json(self._models())

        async def responses(_request: Request):
            raise ProxyError(404, "ajet's proxy serves the Chat Completions API, not the Responses API: "
                                  "use client.chat.completions.create(...) (LangChain: use_responses_api=False)",
                             code="unsupported_endpoint")

        routes = [Route(prefix + path, fn, methods=[method])
                  for prefix in ("/ep/{token}", "/ep/{token}/agent/{tag}", "")
                  for path, fn, method in (("/v1/chat/completions", chat, "POST"), ("/v1/models", models, "GET"),
                                           ("/v1/responses", responses, "POST"))]
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self._loop = asyncio.get_running_loop()   # close_episode runs its close here
            yield

        return Starlette(routes=routes, middleware=[Middleware(_CatchAll)],   # any other exception: a 500 body
                         exception_handlers={ProxyError: lambda _req, exc: exc.response(),
                                             StarletteHTTPException: http_error}, lifespan=lifespan)

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
        call's parent among that agent's calls only, and the tracker merges each agent's calls apart. A
        client retry (the OpenAI SDK's `x-stainless-retry-count` >= 1, or a repeated `Idempotency-Key`)
        of a request this episode already received is answered from that request's generation: one
        recorded call, no fork.
        """
        t0 = time.perf_counter()
        raw = await _read_body(request, self.max_body_bytes)
        retry, idempotency_key = _is_retry(request), request.headers.get("idempotency-key", "")
        # parse, validate, render and tokenize in the prepare pool: the event loop keeps serving other calls
        prep = await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, self._prepare, ep, raw, agent_tag, idempotency_key, retry)
        req = prep.req
        earlier = ep.turns.get(prep.key) if retry else None
        if earlier is not None and not earlier.failed:
            return await self._replay(earlier, req)
        if prep.prompt is None:       # a retry whose first attempt finished meanwhile, or failed: build it now
            prep = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, self._prepare, ep, raw, agent_tag, idempotency_key, False)
        if not ep.open:
            raise _episode_closed()
        turn = ep.turns[prep.key] = self._start_turn(ep, prep, agent_tag, t0)
        if req.stream:
            return await self._stream(turn, req, turn.events)
        return _json(self._completion_body(turn, await turn.result(), req))

    def _prepare(self, ep: _Episode, raw: bytes, agent_tag: str, idempotency_key: str, retry: bool) -> _Prepared:
        """Everything a request needs before generation, run in the prepare pool (off the event loop):
        parse and validate the body, its retry key and, unless it repeats a request the episode already
        received, its prompt ids (token-in-token-out). Raises ProxyError 400 for bad input, including a
        prompt longer than the context (rejected from a lower bound on its tokens before tokenizing when
        the bound already exceeds it)."""
        req = _parse(raw)
        self._check_model(req.model)
        _reject_unsupported(req)
        key = _request_key(raw, agent_tag, idempotency_key)
        prep = _Prepared(req, key)
        if retry and key in ep.turns:
            return prep
        prep.messages, prep.tools = req.wire_messages(), req.wire_tools()
        try:
            prep.strict = StrictTools.of(prep.tools)
        except ValueError as exc:
            raise ProxyError(400, _printable(str(exc)), param="tools", code="invalid_value") from None
        history = [c for c in list(ep.calls) if c.agent_tag == agent_tag]
        try:
            prep.prompt = self.prompts.build(prep.messages, prep.tools, history, ep.rendered,
                                             max_tokens=self.max_model_len - 1)
        except PromptTooLong as exc:
            raise _context_exceeded(f"at least {exc.min_tokens}", self.max_model_len) from None
        prep.forced = _forced_tool_call(req)          # tool_choice required/named: the call's opening is given
        ids = prep.prompt.ids
        prep.prompt_ids = ids + self.prompts.encode(prep.forced) if prep.forced else ids
        if len(prep.prompt_ids) + 1 > self.max_model_len:
            raise _context_exceeded(str(len(prep.prompt_ids)), self.max_model_len)
        return prep

    def _start_turn(self, ep: _Episode, prep: _Prepared, agent_tag: str, t0: float) -> _Turn:
        """Start generating the request's `n` choices in a task that records them when all are done, whether
        or not the client is still there."""
        req, messages, tools, prompt, prompt_ids, forced = (prep.req, prep.messages, prep.tools, prep.prompt,
                                                             prep.prompt_ids, prep.forced)
        sampling = self._sampling(req)
        turn = _Turn(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.n or 1, bool(req.stream), forced,
                     _parses_tools(req), sampling.stop, prep.strict)

        async def generate(i: int) -> _Choice:
            # choice i of n: its own seed (seed + i) so that seeded choices differ yet replay exactly
            params = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + i)
            on_tokens = (lambda d: turn.events.put_nowait((i, d))) if turn.events is not None else None
            t1 = time.perf_counter()
            try:
                completion = await self.engine.generate(prompt_ids, params, on_tokens)
            except ValueError as exc:
                raise ProxyError(400, str(exc), param="messages", code="context_length_exceeded") from exc
            except Exception as exc:  # noqa: BLE001 - an engine failure is the server's fault, not the client's
                log.warning("proxy: engine failed: %r", exc)
                raise ProxyError(503, f"the inference engine failed ({type(exc).__name__}: {_cut(str(exc), 200)}); "
                                      "retry later", "server_error", code="engine_error",
                                 retry_after=self.retry_after_s) from exc
            choice = self._to_choice(i, completion, turn, params, t1)
            if turn.events is not None:
                turn.events.put_nowait((i, choice))
            return choice

        async def run() -> list[_Choice]:
            choices = await asyncio.gather(*(generate(i) for i in range(turn.n)))
            if not ep.open:
                raise _episode_closed()
            for c in choices:
                c.call = LLMCall(
                    call_id=f"call-{ep.episode_id}-{len(ep.calls)}", episode_id=ep.episode_id, agent_tag=agent_tag,
                    index=len(ep.calls), messages=messages, tools=tools, prompt_ids=prompt_ids,
                    completion_ids=c.completion.token_ids, completion_logprobs=c.completion.logprobs,
                    finish_reason=c.finish_reason, response_message=c.message, sampling=c.params,
                    policy_version=c.completion.policy_version, prompt_parent=prompt.parent_call_id,
                    prompt_render_reason=prompt.render_reason, forced_text=forced,
                    strict_violations=c.strict_violations,
                    timings={"prepare_s": c.started - t0, "generate_s": c.ended - c.started,
                             "total_s": time.perf_counter() - t0})
                ep.calls.append(c.call)
                ep.rendered[c.call.call_id] = prompt.text
            return choices

        turn.task = asyncio.ensure_future(run())
        if turn.events is not None:
            turn.task.add_done_callback(lambda _t: turn.events.put_nowait(None))
        return turn

    def _to_choice(self, i: int, completion: Completion, turn: _Turn, params: SamplingParams,
                   started: float) -> _Choice:
        """The assistant message for a finished completion: decoded text (stop string cut, as OpenAI does),
        tool calls parsed out when the request has tools."""
        text = turn.forced + self._decode(completion.token_ids)
        if completion.finish_reason == "stop" and turn.stop:
            text = cut_at_stop(text, turn.stop)
        content, tool_calls = parse_tool_calls(text) if turn.parse_tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else completion.finish_reason
        violations = turn.strict.violations(tool_calls) if turn.strict is not None else []
        return _Choice(i, completion, params, message, finish, started, time.perf_counter(), violations)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    async def _replay(self, turn: _Turn, req: ChatCompletionRequest):
        """Answer a client's retry from the generation its first attempt started (waiting for it to finish),
        streamed or not as the retry asks."""
        choices = await turn.result()
        if not req.stream:
            return _json(self._completion_body(turn, choices, req))
        events: asyncio.Queue = asyncio.Queue()
        for c in choices:
            events.put_nowait((c.index, c))
        events.put_nowait(None)
        return await self._stream(turn, req, events)

    async def _stream(self, turn: _Turn, req: ChatCompletionRequest, events: asyncio.Queue):
        """An SSE response sending content as it is sampled. Errors before the first event keep their HTTP
        status (400, 503, ...); later ones end the stream with an OpenAI-style `{"error": ...}` event."""
        first = await events.get()
        if first is None and turn.error() is not None:
            raise turn.error()
        return StreamingResponse(self._sse(turn, req, events, first), media_type="text/event-stream")

    async def _sse(self, turn: _Turn, req: ChatCompletionRequest, events: asyncio.Queue, first):
        base = {"id": turn.response_id, "object": "chat.completion.chunk", "created": turn.created, "model": req.model}
        want_logprobs = bool(req.logprobs)
        states = [IncrementalContent(turn.parse_tools, turn.stop) for _ in range(turn.n)]
        pending_lp: list[list[dict[str, Any]]] = [[] for _ in range(turn.n)]   # entries not yet sent
        ids_so_far: list[list[int]] = [[] for _ in range(turn.n)]
        out = [chunk(base, i, {"role": "assistant", "content": ""}) for i in range(turn.n)]   # sent per wake-up
        event = first
        while event is not None:
            batch = [event]
            while not events.empty():           # coalesce whatever else is already here
                batch.append(events.get_nowait())
            touched: set[int] = set()
            for ev in batch:
                if ev is None:
                    break
                i, item = ev
                if isinstance(item, TokenDelta):
                    ids_so_far[i] += item.token_ids
                    if want_logprobs:
                        pending_lp[i] += self._logprob_entries(item.token_ids, item.logprobs, item.top_logprobs)
                    touched.add(i)
                else:                                   # choice i finished
                    out.append(self._finish_choice(base, states[i], item, pending_lp[i], want_logprobs, ids_so_far[i]))
                    pending_lp[i] = []
                    touched.discard(i)
            for i in touched:
                delta = states[i].update(turn.forced + self._decode(ids_so_far[i]))
                if delta:
                    out.append(chunk(base, i, {"content": delta}, logprobs=pending_lp[i] if want_logprobs else None))
                    pending_lp[i] = []
            if batch[-1] is None:
                break
            if out:
                yield "".join(out)              # one write per wake-up, however many chunks
                out = []
            event = await events.get()
        if (err := turn.error()) is not None:   # the engine failed, or the episode was closed, mid-stream
            out.append(sse(err.body()))
        else:
            if req.stream_options and req.stream_options.include_usage:
                out.append(sse({**base, "choices": [], "usage": self._usage(turn.task.result())}))
            out.append(sse("[DONE]"))
        yield "".join(out)

    def _finish_choice(self, base, state: IncrementalContent, c: _Choice, pending_lp, want_logprobs: bool,
                       streamed_ids: list[int]) -> str:
        """The last chunks of choice `c`: the content not yet sent, its tool calls, its finish reason."""
        if want_logprobs:   # tokens never announced by the engine (a non-streaming engine) get entries now
            rest = c.completion.token_ids[len(streamed_ids):]
            tops = c.completion.top_logprobs[len(streamed_ids):] if c.completion.top_logprobs else None
            pending_lp = pending_lp + self._logprob_entries(rest, c.completion.logprobs[len(streamed_ids):], tops)
        out = []
        rest_text = state.finish(c.message["content"])
        if rest_text or pending_lp:
            out.append(chunk(base, c.index, {"content": rest_text} if rest_text else {},
                             logprobs=pending_lp if want_logprobs else None))
        out += tool_call_chunks(base, c.index, c.message.get("tool_calls") or [])
        out.append(chunk(base, c.index, {}, c.finish_reason))
        return "".join(out)

    def _sampling(self, req: ChatCompletionRequest) -> SamplingParams:
        """The sampling parameters a request gets under the config's `sampling_policy`."""
        d = self.defaults
        asked_max = req.max_completion_tokens or req.max_tokens
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        stop = tuple(s for s in stop if s)      # "" would match at once: ignored, never a 1-token completion
        if req.parallel_tool_calls is False and _parses_tools(req):
            stop += (TOOL_CALL_END,)    # at most one tool call: generation ends with the first one
        top = (req.top_logprobs or 0) if req.logprobs else 0
        if self.sampling_policy == "client":
            return SamplingParams(
                temperature=d.temperature if req.temperature is None else req.temperature,   # 0: greedy
                top_p=d.top_p if req.top_p is None else req.top_p,
                max_tokens=asked_max or d.max_tokens, seed=req.seed, stop=stop, top_logprobs=top)
        return SamplingParams(temperature=d.temperature, top_p=d.top_p, max_tokens=min(asked_max or d.max_tokens,
                              d.max_tokens), seed=req.seed, stop=stop, top_logprobs=top)

    def _logprob_entries(self, ids: list[int], logprobs: list[float],
                         tops: list[list[tuple[int, float]]] | None) -> list[dict[str, Any]]:
        """OpenAI `logprobs.content` entries for sampled tokens (logprobs under the sampling temperature)."""
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = self.tokenizer.decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (tops[k] if tops else [])]}
                for k, (t, lp) in enumerate(zip(ids, logprobs))]

    def _completion_body(self, turn: _Turn, choices: list[_Choice], req: ChatCompletionRequest) -> dict[str, Any]:
        return {"id": turn.response_id, "object": "chat.completion", "created": turn.created, "model": req.model,
                "choices": [{"index": c.index, "message": c.message, "finish_reason": c.finish_reason,
                             "logprobs": {"content": self._logprob_entries(c.completion.token_ids, c.completion.logprobs,
                                                                          c.completion.top_logprobs)}
                             if req.logprobs else None} for c in choices],
                "usage": self._usage(choices)}

    @staticmethod
    def _usage(choices: list[_Choice]) -> dict[str, int]:
        n_prompt = len(choices[0].call.prompt_ids)
        n_completion = sum(len(c.completion.token_ids) for c in choices)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


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


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response (orjson-encoded)."""
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


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
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


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
                    return _printable(_cut(p, 200))
                stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
        elif isinstance(v, str) and not _utf8_ok(v):
            return _printable(_cut(path, 200))
    return None


def _printable(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes (so that it can be sent as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _too_deep_path(data: Any, limit: int) -> str | None:
    """The dotted path of the first value nested deeper than `limit` objects/arrays, else None (iterative:
    no recursion however deep `data` is)."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        path, v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= limit:
                return _printable(_cut(path, 200))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend(((f"{path}.{k}" if path else str(k)), x, depth + 1) for k, x in items)
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


def _parse(raw: bytes) -> ChatCompletionRequest:
    """The validated request. Raises ProxyError 400 for anything malformed (not JSON, not an object, lone
    surrogates, a schema violation: the message names the field and quotes at most ~200 characters of the
    offending value)."""
    fallback = False
    try:   # orjson for speed; the standard parser for what it refuses (it gives the precise error, or accepts)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            fallback = True
            data = json.loads(raw)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, >4300-digit ints, nesting
        raise ProxyError(400, f"the request body is not valid JSON: {_cut(str(exc), 200)}",
                         code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ProxyError(400, "the request body must be a JSON object", code="invalid_json")
    # nesting: a small body's bracket count bounds its depth, so only one with many brackets is walked (a
    # large one is walked at once: few values, or the walk costs little beside parsing them)
    if ((len(raw) > 2**20 or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH)
            and (where := _too_deep_path(data, MAX_JSON_DEPTH))):
        raise ProxyError(400, f"{where}: the value is nested more than {MAX_JSON_DEPTH} levels deep (objects and "
                              "arrays): flatten it", param=where, code="invalid_value")
    # lone surrogates: orjson refuses them, so only a body the standard parser accepted can hold one
    if fallback and _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate_path(data)) is not None:
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
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise ProxyError(400, "tool_choice asks for a tool call but the request has no `tools`", param="tool_choice",
                         code="invalid_value")
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.get("name")
        if name not in {t.function.name for t in req.tools}:
            raise ProxyError(400, f"tool_choice names function {short_repr(name)}, which is not in `tools`",
                             param="tool_choice", code="invalid_value")
    if req.frequency_penalty or req.presence_penalty:
        raise ProxyError(400, "frequency/presence penalties would change the sampling distribution the policy is "
                              "trained on: remove them", param="frequency_penalty", code="unsupported_value")
    if req.top_logprobs and not req.logprobs:
        raise ProxyError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object"):
        raise ProxyError(400, f"response_format type {short_repr(kind)} is not supported (ajet samples without a "
                              "grammar): use 'json_object' and describe the schema in the prompt",
                         param="response_format.type", code="unsupported_value")
    if kind == "json_object" and not any("json" in _message_text(m).lower() for m in req.messages):
        raise ProxyError(400, "'messages' must contain the word 'json' in some form, to use 'response_format' of "
                              "type 'json_object'", param="messages", code="invalid_value")


def _parses_tools(req: ChatCompletionRequest) -> bool:
    """Whether tool calls are parsed out of the generated text: the request has tools and allows calls."""
    return bool(req.tools) and req.tool_choice != "none"


def _message_text(m) -> str:
    c = m.content
    return c if isinstance(c, str) else "".join(p.text for p in c or [])


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


def _is_retry(request: Request) -> bool:
    """The client says this request repeats an earlier one: the OpenAI SDK's `x-stainless-retry-count` >= 1
    (it retries timeouts, connection errors, 408/409/429/5xx), or any `Idempotency-Key` header."""
    count = request.headers.get("x-stainless-retry-count", "0")
    return (count.isdigit() and int(count) > 0) or "idempotency-key" in request.headers


def _request_key(raw: bytes, agent_tag: str, idempotency_key: str) -> str:
    """What identifies a request among its episode's requests: the agent, the idempotency key if any, and
    the exact body (a retry sends the same bytes)."""
    h = hashlib.blake2b(raw, digest_size=16)
    h.update(agent_tag.encode() + b"\0" + idempotency_key.encode())
    return h.hexdigest()


def _episode_closed() -> ProxyError:
    return ProxyError(404, "the episode was closed while this call was running (the workflow returned or timed "
                           "out before its agent finished): nothing was recorded", code="episode_closed")


def _context_exceeded(n_tokens: str, max_model_len: int) -> ProxyError:
    return ProxyError(400, f"the prompt is {n_tokens} tokens; this model's context holds {max_model_len}: "
                           "shorten the conversation", param="messages", code="context_length_exceeded")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _call(fn, *args):
    """`fn(*args)` as a coroutine (to run a plain function on another thread's event loop)."""
    return fn(*args)
