"""The recording proxy: one request path behind four APIs, per episode.

Each episode gets `http://127.0.0.1:PORT/ep/<token>/v1` as its OpenAI base_url (Chat Completions
`/chat/completions`, Responses `/responses`) and `http://127.0.0.1:PORT/ep/<token>` as its Anthropic
base_url (Messages `/v1/messages`) and Gemini base URL (`/v1beta/models/{model}:generateContent`);
`<token>` (unguessable) is its api_key, also accepted as `Authorization: Bearer <token>`, `x-api-key`,
`x-goog-api-key` or `?key=` on the bare `/v1/...` and `/v1beta/...` paths.

A request's path is a straight line, the same for every API: find the episode -> read the body -> in the
prepare pool (on the event loop itself for a body of at most 4 KiB, `INLINE_PREPARE_BYTES`): parse it, the API
adapter (`ajet/proxy/api/`) turns it into the one turn type (`ajet/proxy/turn.py`), build the prompt ids
(token-in-token-out) -> (a client retry? answer from the first attempt) -> choose sampling params -> generate the
`n` choices in a task -> parse tool calls -> record one `LLMCall` per choice -> the adapter writes the answer
(streamed as tokens are sampled when `stream` is set).

Every error is a `ProxyError`, written in the API's error shape: bad input is a 4xx naming what is wrong
(never echoing more than ~200 characters of it), an engine failure a 503 with `Retry-After`, and only a
bug in the proxy itself a 500.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import hashlib
import logging
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.routing import BaseRoute, Route

from ajet.chat_template import TOOL_CALL_END, parse_tool_calls
from ajet.engines.base import (Engine, EngineWait, reset_calling_agent, reset_queue_ticket, set_calling_agent,
                         set_queue_ticket)
from ajet.guard import api_key
from ajet.llm_call import Completion, LLMCall, SamplingParams, call_seed
from ajet.proxy.api import Api
from ajet.proxy.api.chat import ChatApi
from ajet.proxy.api.gemini import GeminiApi
from ajet.proxy.api.messages import MessagesApi
from ajet.proxy.api.responses import ResponsesApi
from ajet.proxy.prompt import PromptBuilder, PromptTooLong
from ajet.proxy.schema import ChatCompletionRequest, short_repr
from ajet.proxy.stream import cut_at_stop
from ajet.proxy.strict import StrictTools
from ajet.proxy.turn import (Choice, OpenEpisode, Prepared, Turn, episode_closed, forced_tool_call, parses_tools,
                             reject_unsupported, server_stopping)
from ajet.proxy.wire import (MAX_JSON_DEPTH, MAX_JSON_ITEMS, ClientGone, ProxyError, cut, json_response, load_json,
                             log_client_gone, printable, read_body, redacted_path)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20   # 8 MiB
APIS: tuple[type[Api], ...] = (ChatApi, ResponsesApi, MessagesApi, GeminiApi)   # the adapters a proxy serves by default
PREPARE_WORKERS = 2                  # threads that parse, render and tokenize requests off the event loop
# bodies up to this size (bytes) are prepared on the event loop itself: the hop to a prepare thread and back
# (~0.1 ms of CPU, and the two threads' handovers of the GIL) costs as much as a plain call's whole preparation
# (~0.1-0.3 ms). The costliest 4 KiB body (~400 one-letter messages, rendered in full) takes ~1.7 ms, less
# than the 5 ms a prepare thread may hold the GIL before it has to yield it to the event loop anyway.
INLINE_PREPARE_BYTES = 4096
STOP_GRACE_S = 2.0   # `stop` waits this long for requests in flight (their generations cancelled), then ends them
RESPONSE_ID_HEADER = "X-Ajet-Response-Id"   # every answer's id (its body's `id`) as a header
__all__ = ["DEFAULT_MAX_BODY_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_ITEMS", "EpisodeEndpoint", "ProxyError", "ProxyServer"]


@dataclass
class EpisodeEndpoint:
    """What a workflow needs to reach the proxy for one episode.

    Attributes:
        episode_id: the episode's id.
        base_url: the OpenAI base_url (`.../ep/<token>/v1`: Chat Completions and Responses).
        api_key: the episode's token (any SDK's api key: Bearer or `x-api-key`).
        engine_wait: how long the episode's calls have waited in the engine's queue (`ajet.engines.base.EngineWait`;
            the episode's timeout does not count it).
    """

    episode_id: str
    base_url: str
    api_key: str
    engine_wait: EngineWait | None = None

    @property
    def anthropic_base_url(self) -> str:
        """The Anthropic base_url (`.../ep/<token>`; the SDK appends `/v1/messages`)."""
        return self.base_url.removesuffix("/v1")

    @property
    def gemini_base_url(self) -> str:
        """The Gemini API base URL (`.../ep/<token>`; the SDKs append `/v1beta/models/...`)."""
        return self.base_url.removesuffix("/v1")


class ProxyServer:
    """Serves the proxy with uvicorn in a background thread (its own event loop) on `host`.

    Args:
        engine: generates completions (see `ajet.engines.base.Engine`).
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
        max_body_items: most JSON objects + arrays a request body may hold (messages, content parts, tools,
            ...); more get a 400 naming the field holding most of them, before any validation or rendering,
            so that one request's work in the prepare pool stays bounded. Default `MAX_JSON_ITEMS` (20,000).
        apis: the API adapter classes to serve (`ajet/proxy/api/`), each on the paths it declares.
        seed: the run's seed (`trainer.seed`): a request without its own `seed` samples with
            `call_seed(seed, episode key, request index in the episode)`, so its tokens do not depend on
            arrival order or batching. None: such requests draw from the engine's generator.

    Parsing, rendering and tokenizing a request run in a pool of `PREPARE_WORKERS` threads, so that a request near
    the body limit does not stall other episodes' calls; a body of at most `INLINE_PREPARE_BYTES` is prepared on the
    event loop (the hop to a thread would cost more than its preparation).
    """

    def __init__(self, engine: Engine, tokenizer, defaults: SamplingParams, sampling_policy: str = "config",
                 max_model_len: int = 4096, model_name: str = "ajet-policy", host: str = "127.0.0.1",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, accepted_models: Iterable[str] | None = None,
                 retry_after_s: int = 1, max_body_items: int = MAX_JSON_ITEMS,
                 apis: Iterable[type[Api]] = APIS, seed: int | None = None):
        self.engine = engine
        self.seed = seed
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
        self.max_body_items = max_body_items
        self.port: int | None = None
        self._episodes: dict[str, OpenEpisode] = {}   # token -> episode
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()   # recently closed tokens
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None    # the server's event loop, once started
        self._prepare_pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="ajet-prepare")
        self._server: uvicorn.Server | None = None
        # uvicorn's `http` setting: "auto", or a protocol class (the gateway's closes a connection whose request
        # does not arrive within its read timeout: ajet/gateway/timeouts.py); set before `start`
        self.http_protocol: Any = "auto"
        self._stopping = False                                 # `stop` was called
        self._requests: set[asyncio.Task] = set()              # the tasks of the requests in flight (`_CatchAll`)
        self._failures = FailureLog()                          # engine failures: one warning per kind a minute
        self._thread: threading.Thread | None = None
        self.apis = {cls.name: cls(self) for cls in apis}
        # called on the event loop once a request's calls are recorded: on_recorded(episode, turn, choices,
        # others) (`ajet gateway` maps response ids to sessions and persists the calls); `others`: the
        # best-of-N candidates not answered (their calls are built, never in the episode); None: nothing is called
        self.on_recorded: Callable[[OpenEpisode, Turn, list[Choice], list[Choice]], None] | None = None
        # best-of-N (`ajet gateway`'s gateway.n): `best_of(episode) -> N` samples a request asking for one
        # choice N times (one engine batch), `await choose(episode, turn, prep, choices) -> index` picks the
        # one answered (a stream gets it once all N are sampled); None: every request samples its own `n`
        self.best_of: Callable[[OpenEpisode], int] | None = None
        self.choose: Callable[[OpenEpisode, Turn, Prepared, list[Choice]], Any] | None = None
        self.app = self._build_app()

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> ProxyServer:
        """Bind a free port on `host` and serve in a daemon thread (the process's first start also freezes its
        heap: `freeze_heap_once`). Raises RuntimeError if it won't start."""
        freeze_heap_once()
        # proto IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # Nagle holds each response body behind its headers for a delayed ACK (~40 ms a request)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port or 0))   # `port` set before start (ajet serve), else a free one
        self.port = sock.getsockname()[1]
        # "auto": uvloop and httptools (the `uvicorn[standard]` extras ajet depends on) when importable;
        # proxy_headers off: nothing reads the client address that X-Forwarded-For would rewrite
        config = uvicorn.Config(self.app, log_level="warning", loop="auto", http=self.http_protocol,
                                access_log=False, timeout_keep_alive=30, proxy_headers=False)
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

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop serving, promptly: every generation still running is cancelled and its client answered 503
        `server_stopping` (a stream: that error event), new calls get the same answer, and the server closes its
        connections once their answers are sent. A request still running `grace_s` seconds later (a body still
        being uploaded) is cancelled and answered the same. Joins the server thread (at most `grace_s` + 10 s)."""
        if self._server is not None:
            self._stopping = True
            loop = self._loop
            if loop is not None and loop.is_running() and _running_loop() is not loop:
                with contextlib.suppress(TimeoutError, RuntimeError):   # the loop ended meanwhile
                    asyncio.run_coroutine_threadsafe(_call(self._stop_generations), loop).result(timeout=30)
            self._server.should_exit = True
            self._thread.join(timeout=grace_s)
            if self._thread.is_alive() and loop is not None and loop.is_running():
                # uvicorn waits for the requests in flight: end them (each is answered, see _CatchAll)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lambda: [task.cancel() for task in list(self._requests)])
            self._thread.join(timeout=10)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def _stop_generations(self) -> None:
        """Cancel every open episode's generations (on the event loop): their clients get `server_stopping`."""
        with self._lock:
            episodes = list(self._episodes.values())
        for ep in episodes:
            for turn in list(ep.inflight):
                turn.cancel(server_stopping())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- episodes ---------------------------------------------------------------------------------
    def open_episode(self, episode_id: str, seed_key: str | None = None) -> EpisodeEndpoint:
        """Register an episode; its calls are recorded until `close_episode`. `seed_key` names the episode in
        its calls' sampler seeds (see `call_seed`; default: `episode_id`)."""
        token = "ajet-" + secrets.token_urlsafe(24)
        ep = OpenEpisode(episode_id, token, seed_key=seed_key or episode_id)
        with self._lock:
            self._episodes[token] = ep
        return EpisodeEndpoint(episode_id, f"{self.url}/ep/{token}/v1", token, ep.engine_wait)

    def engine_wait(self, api_key: str) -> EngineWait | None:
        """The queue time of the open episode whose token is `api_key` (None when there is no such episode)."""
        with self._lock:
            ep = self._episodes.get(api_key)
        return ep.engine_wait if ep is not None else None

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
    def _close_on_loop(ep: OpenEpisode) -> None:
        """Mark `ep` closed and cancel its generations nobody waits for any more (on the event loop)."""
        ep.open = False
        for turn in list(ep.inflight):     # each generation still running, also one whose `turns` entry a
            turn.cancel()                  # second request with the same body took over
        ep.turns.clear()

    def _episode(self, token: str | None) -> OpenEpisode:
        with self._lock:
            ep = self._episodes.get(token or "")
        if ep is None:
            raise ProxyError(404 if token else 401,
                             "unknown or finished episode: use the base_url and api_key ajet gave this episode"
                             if token else "missing episode token: pass the episode's api_key as the Bearer token "
                                           "(or the x-api-key header)",
                             "invalid_request_error" if token else "authentication_error",
                             code="episode_not_found" if token else "invalid_api_key")
        return ep

    # ---- HTTP -------------------------------------------------------------------------------------
    def add_routes(self, routes: list[BaseRoute]) -> None:
        """Serve more Starlette routes next to the proxy's (e.g. `ajet serve`'s episode API); they share the
        app's error handling. Call before `start`."""
        self.app.router.routes.extend(routes)

    def _build_app(self) -> Starlette:
        """The ASGI app: plain Starlette (the proxy needs routing and error handlers, nothing more). Every
        API path exists per episode (`/ep/{token}/...`), per agent of a multi-agent workflow
        (`/ep/{token}/agent/{tag}/...`), and bare (the token as bearer or x-api-key)."""
        async def http_error(req: Request, exc: StarletteHTTPException):  # unknown path, wrong method
            err = ProxyError(exc.status_code, f"{exc.detail}: {req.method} {cut(req.url.path, 200)}",
                             code=str(exc.detail).lower().replace(" ", "_"))
            response = _api_for_path(self, req.url.path).error_response(err)
            response.headers.update(exc.headers or {})
            return response

        def endpoint(api: Api, handler):
            async def route(request: Request):
                try:
                    p = request.path_params
                    ep = self._episode(p["token"] if "token" in p else _token(request))
                    return await handler(api, ep, request, p.get("tag", "default"))
                except ProxyError as err:
                    return api.error_response(err)
            return route

        async def models(request: Request):
            self._episode(request.path_params.get("token") or _token(request))
            return json_response(self._models())

        handlers = {"serve": self._serve, "stored": self._stored_response, "count_tokens": self._count_tokens}
        paths = [(path, models if kind == "models" else endpoint(api, handlers[kind]), method)
                 for api in self.apis.values() for path, method, kind in api.routes]
        routes = [Route(prefix + path, fn, methods=[method])
                  for prefix in ("/ep/{token}", "/ep/{token}/agent/{tag}", "") for path, fn, method in paths]

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self._loop = asyncio.get_running_loop()   # close_episode runs its close here
            yield

        return Starlette(routes=routes, middleware=[Middleware(_CatchAll, proxy=self)],   # any other exception: a 500
                         exception_handlers={ProxyError: lambda req, exc: _api_for_path(self, req.url.path)
                                             .error_response(exc), StarletteHTTPException: http_error},
                         lifespan=lifespan)

    def _models(self) -> dict[str, Any]:
        names = [self.model_name] + sorted((self.accepted_models or set()) - {self.model_name})
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "ajet"} for n in names]}

    def _check_model(self, model: str) -> None:
        """Raise a 404 `model_not_found` unless `model` is accepted (any name when no set is configured)."""
        if self.accepted_models is not None and model not in self.accepted_models:
            raise ProxyError(404, f"the model {short_repr(model, 100)} does not exist on this proxy; accepted: "
                                  + ", ".join(sorted(self.accepted_models)), param="model", code="model_not_found")

    # ---- the request path (shared by every API) ---------------------------------------------------
    async def _serve(self, api: Api, ep: OpenEpisode, request: Request, agent_tag: str = "default"):
        """Handle one model call for episode `ep` through `api` (see the module docstring for the steps).

        `agent_tag` names which agent of a multi-agent workflow called; token-in-token-out looks for the
        call's parent among that agent's calls only, and the tracker merges each agent's calls apart. A
        client retry (the OpenAI and Anthropic SDKs' `x-stainless-retry-count` >= 1, or a repeated
        `Idempotency-Key`) of a request this episode already received is answered from that request's
        generation: one recorded call, no fork.
        """
        t0 = time.perf_counter()
        raw = await read_body(request, self.max_body_bytes)
        retry, idempotency_key = _is_retry(request), request.headers.get("idempotency-key", "")
        route = _route(request)
        prep = await self._prepared(api, ep, raw, agent_tag, idempotency_key, retry, route)
        earlier = ep.turns.get(prep.key) if retry else None
        if earlier is not None and not earlier.failed and not earlier.abandoned:
            earlier.waiting += 1                             # a retry: the first attempt's answer
            gone = False
            try:
                choices = await until_answered(earlier.result(), request.receive)
            except ClientGone:
                gone = True
                raise
            finally:
                earlier.leave(gone)
            replay: asyncio.Queue = asyncio.Queue()
            for c in choices:
                replay.put_nowait((c.index, c))
            replay.put_nowait(None)
            return await self._answer(api, earlier, prep, replay, request)
        if prep.prompt is None:       # a retry whose first attempt failed meanwhile: build it now
            prep = await self._prepared(api, ep, raw, agent_tag, idempotency_key, False, route)
        if not ep.open:
            raise episode_closed()
        if self._stopping:
            raise server_stopping()
        turn = ep.turns[prep.key] = self._start_turn(api, ep, prep, agent_tag, t0)
        return await self._answer(api, turn, prep, turn.events, request)

    async def _answer(self, api: Api, turn: Turn, prep: Prepared, events: asyncio.Queue | None, request: Request):
        """The API's answer: its body, or its event stream (errors before the first event keep their HTTP
        status; later ones end the stream with the API's error event). The request waits for `turn` until its
        answer is sent: a client that closes its connection first leaves it (`Turn.leave`: the last one gone
        cancels the generation) and gets nothing (ClientGone, one warning line)."""
        headers = {RESPONSE_ID_HEADER: turn.response_id}   # the body's id, also before a stream's first event
        turn.waiting += 1
        gone, stream = False, None
        try:
            if not prep.req.stream:
                choices = await until_answered(turn.result(), request.receive)
                return json_response(api.body(turn, prep, choices), headers=headers)
            first = await until_answered(events.get(), request.receive)
            if first is None and turn.error() is not None:
                raise turn.error()
            stream = _TurnStream(turn, api.events(turn, prep, events, first), headers)
            return stream
        except ClientGone:
            gone = True
            raise
        finally:
            if stream is None:                    # else the stream leaves the turn when it ends
                turn.leave(gone)

    async def _prepared(self, api: Api, ep: OpenEpisode, raw: bytes, *args) -> Prepared:
        """`_prepare(api, ep, raw, *args)`: in the prepare pool, so that the event loop keeps serving other calls
        meanwhile, unless the body holds at most `INLINE_PREPARE_BYTES` bytes (then here, on the event loop)."""
        if len(raw) <= INLINE_PREPARE_BYTES:
            return self._prepare(api, ep, raw, *args)
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self._prepare, api, ep, raw, *args)

    def _prepare(self, api: Api, ep: OpenEpisode, raw: bytes, agent_tag: str, idempotency_key: str,
                 retry: bool, route: dict[str, Any]) -> Prepared:
        """Everything a request needs before generation, run in the prepare pool (see `_prepared`):
        parse the body, turn it into the turn request (`api.parse`), its retry key and, unless it repeats
        a request the episode already received, its prompt ids (token-in-token-out). Raises ProxyError 400
        for bad input, including a prompt longer than the context (rejected from a lower bound on its
        tokens before tokenizing when the bound already exceeds it)."""
        req, context = api.parse_request(load_json(raw, self.max_body_items), ep, route)
        self._check_model(req.model)
        reject_unsupported(req)
        key = _request_key(raw, api.name + "\0" + agent_tag, idempotency_key)
        prep = Prepared(req, key, context)
        if retry and key in ep.turns:
            return prep
        prep.messages, prep.tools = req.wire_messages(), req.wire_tools()
        try:
            prep.strict = StrictTools.of(prep.tools)
        except ValueError as exc:
            raise ProxyError(400, printable(str(exc)), param="tools", code="invalid_value") from None
        history = [c for c in list(ep.calls) if c.agent_tag == agent_tag]
        try:
            prep.prompt = self.prompts.build(prep.messages, prep.tools, history, ep.rendered,
                                             max_tokens=self.max_model_len - 1)
        except PromptTooLong as exc:
            raise _context_exceeded(f"at least {exc.min_tokens}", self.max_model_len) from None
        prep.forced = forced_tool_call(req)          # tool_choice required/named: the call's opening is given
        ids = prep.prompt.ids
        prep.prompt_ids = ids + self.prompts.encode(prep.forced) if prep.forced else ids
        if len(prep.prompt_ids) + 1 > self.max_model_len:
            raise _context_exceeded(str(len(prep.prompt_ids)), self.max_model_len)
        return prep

    def _start_turn(self, api: Api, ep: OpenEpisode, prep: Prepared, agent_tag: str, t0: float) -> Turn:
        """Start generating the request's `n` choices in a task that records them when all are done, whether
        or not the client is still there."""
        req, messages, tools, prompt, prompt_ids, forced = (prep.req, prep.messages, prep.tools, prep.prompt,
                                                             prep.prompt_ids, prep.forced)
        sampling = self._sampling(req)
        if sampling.seed is None and self.seed is not None:   # the request's own stream, fixed before the engine
            sampling = replace(sampling, seed=call_seed(self.seed, ep.seed_key, ep.requests))
        ep.requests += 1
        turn = Turn(api.id_prefix + uuid.uuid4().hex, int(time.time()), req.n or 1, bool(req.stream), forced,
                    parses_tools(req), sampling.stop, prep.strict)
        best_of = self.best_of(ep) if self.best_of is not None and turn.n == 1 else 1
        events = turn.events if best_of == 1 else None     # best-of-N: only the chosen one is streamed

        async def generate(i: int) -> Choice:
            # choice i of n: its own seed (seed + i) so that seeded choices differ yet replay exactly
            params = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + i)
            on_tokens = (lambda d: events.put_nowait((i, d))) if events is not None else None
            t1 = time.perf_counter()
            ticket = ep.engine_wait.ticket()     # the engine reports the call's queue time (ajet/engines/base.py)
            reset = set_queue_ticket(ticket)
            reset_agent = set_calling_agent(agent_tag)   # an engine with an adapter per role picks this one's
            try:
                completion = await self.engine.generate(prompt_ids, params, on_tokens)
            except ValueError as exc:
                raise ProxyError(400, str(exc), param="messages", code="context_length_exceeded") from exc
            except Exception as exc:  # noqa: BLE001 - an engine failure is the server's fault, not the client's
                self._failures.warn(exc)         # a string: the record holds no traceback
                raise ProxyError(503, f"the inference engine failed ({type(exc).__name__}: {cut(str(exc), 200)}); "
                                      "retry later", "server_error", code="engine_error",
                                 retry_after=self.retry_after_s) from exc
            finally:
                ticket.admitted()                # a call that failed or was cancelled in the queue stops counting
                reset_queue_ticket(reset)
                reset_calling_agent(reset_agent)
            choice = self._to_choice(i, completion, turn, params, t1, ticket.waited_s)
            if events is not None:
                events.put_nowait((i, choice))
            return choice

        async def run() -> list[Choice]:
            count = max(turn.n, best_of)      # one choice: awaited here, without a task of its own
            choices = others = [await generate(0)] if count == 1 else \
                list(await asyncio.gather(*(generate(i) for i in range(count))))
            if best_of > 1 and ep.open:                 # the chosen one is answered as choice 0
                pick = await self.choose(ep, turn, prep, choices)
                choices, others = [replace(choices[pick], index=0)], [c for c in choices if c.index != pick]
                if turn.events is not None:
                    turn.events.put_nowait((0, choices[0]))
            if not ep.open:
                raise episode_closed()
            for c in others if best_of > 1 else ():   # each its own call: `on_recorded` says where it belongs
                c.call = call_of(c, f"call-{ep.episode_id}-{len(ep.calls)}.{c.index}", len(ep.calls))
            for c in choices:
                c.call = call_of(c, f"call-{ep.episode_id}-{len(ep.calls)}", len(ep.calls))
                ep.calls.append(c.call)
                ep.rendered[c.call.call_id] = prompt.text
            api.recorded(ep, turn, prep, choices)
            if self.on_recorded is not None:
                self.on_recorded(ep, turn, choices, others if best_of > 1 else [])
            return choices

        def call_of(c: Choice, call_id: str, index: int) -> LLMCall:
            return LLMCall(
                    call_id=call_id, episode_id=ep.episode_id, agent_tag=agent_tag,
                    index=index, messages=messages, tools=tools, prompt_ids=prompt_ids,
                    completion_ids=c.completion.token_ids, completion_logprobs=c.completion.logprobs,
                    finish_reason=c.finish_reason, response_message=c.message, sampling=c.params,
                    policy_version=c.completion.policy_version, prompt_parent=prompt.parent_call_id,
                    prompt_render_reason=prompt.render_reason, prompt_parent_by=prompt.parent_by, forced_text=forced,
                    strict_violations=c.strict_violations, api=api.name,
                    token_versions=c.completion.token_versions,
                    timings={"prepare_s": c.started - t0, "generate_s": c.ended - c.started,
                             "queued_s": c.queued_s, "total_s": time.perf_counter() - t0})

        turn.task = asyncio.ensure_future(run())
        ep.inflight.add(turn)
        turn.task.add_done_callback(lambda _t: turn.settle(ep))
        return turn

    def _to_choice(self, i: int, completion: Completion, turn: Turn, params: SamplingParams,
                   started: float, queued_s: float = 0.0) -> Choice:
        """The assistant message for a finished completion: decoded text (stop string cut, as OpenAI does),
        tool calls parsed out when the request has tools."""
        text = turn.forced + self.decode(completion.token_ids)
        if completion.finish_reason == "stop" and turn.stop:
            text = cut_at_stop(text, turn.stop)
        content, tool_calls = parse_tool_calls(text) if turn.parse_tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else completion.finish_reason
        violations = turn.strict.violations(tool_calls) if turn.strict is not None else []
        return Choice(i, completion, params, message, finish, started, time.perf_counter(), violations,
                      queued_s=queued_s)

    def decode(self, ids: list[int]) -> str:
        """Completion ids to text, special tokens dropped (what the client is answered)."""
        return self.prompts.decode(ids)

    async def _stored_response(self, api: Api, ep: OpenEpisode, request: Request, _agent_tag: str):
        """`GET /v1/responses/{id}`: a response of this episode, as it was answered."""
        return json_response(api.stored(ep, request.path_params["response_id"]))

    async def _count_tokens(self, api: Api, ep: OpenEpisode, request: Request, _agent_tag: str):
        """`POST /v1/messages/count_tokens` (`{"input_tokens": n}`), Gemini's `:countTokens` (`{"totalTokens": n}`):
        the prompt's length from the policy's own chat template and tokenizer (rendered in full, in the prepare
        pool)."""
        raw, route = await read_body(request, self.max_body_bytes), _route(request)

        def count() -> int:
            req, _ = api.parse_request(load_json(raw, self.max_body_items), ep, route, count_only=True)
            return len(self.prompts.encode(self.prompts.render(req.wire_messages(), req.wire_tools())))

        n = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, count)
        return json_response(api.count_body(n))

    def _sampling(self, req: ChatCompletionRequest) -> SamplingParams:
        """The sampling parameters a request gets under the config's `sampling_policy`."""
        d = self.defaults
        asked_max = req.max_completion_tokens or req.max_tokens
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        stop = tuple(s for s in stop if s)      # "" would match at once: ignored, never a 1-token completion
        if req.parallel_tool_calls is False and parses_tools(req):
            stop += (TOOL_CALL_END,)    # at most one tool call: generation ends with the first one
        top = (req.top_logprobs or 0) if req.logprobs else 0
        if self.sampling_policy == "client":
            return SamplingParams(
                temperature=d.temperature if req.temperature is None else req.temperature,   # 0: greedy
                top_p=d.top_p if req.top_p is None else req.top_p,
                max_tokens=asked_max or d.max_tokens, seed=req.seed, stop=stop, top_logprobs=top)
        return SamplingParams(temperature=d.temperature, top_p=d.top_p, max_tokens=min(asked_max or d.max_tokens,
                              d.max_tokens), seed=req.seed, stop=stop, top_logprobs=top)


class FailureLog:
    """Warns of engine failures, once per kind per `window_s` seconds: a dead server fails every call in flight
    with the same error (32 at once in the main job), which is one event, not 32. A kind is the exception's type and
    the first 120 characters of its message; the next warning of a kind says how many like it were not shown."""

    def __init__(self, window_s: float = 60.0, max_kinds: int = 256, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.max_kinds, self.clock = window_s, max_kinds, clock
        self._kinds: dict[str, list] = {}           # kind -> [time of its last warning (monotonic s), not shown]

    def warn(self, exc: BaseException) -> bool:
        """Log `exc` as "proxy: engine failed: <repr>" unless its kind was logged less than `window_s` ago (then
        only counted). Returns whether it was logged."""
        kind, now = f"{type(exc).__name__}: {str(exc)[:120]}", self.clock()
        entry = self._kinds.get(kind)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return False
        if len(self._kinds) >= self.max_kinds:
            self._kinds.clear()
        hidden = entry[1] if entry is not None else 0
        self._kinds[kind] = [now, 0]
        log.warning("proxy: engine failed: %s%s", repr(exc),
                    f" ({hidden} more like it since the last one shown)" if hidden else "")
        return True


async def until_answered(awaitable, receive):
    """`await awaitable`, unless the client of the ASGI `receive` (whose body was read in full) closes its
    connection first: then `awaitable` is cancelled and ClientGone raised."""
    work = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if not work.done():
        raise ClientGone("the client closed the connection before its answer was ready (its generation was "
                         "stopped)")
    return work.result()


class _TurnStream(StreamingResponse):
    """A turn's event stream that leaves the turn when it ends (`Turn.leave`): gone when the client closed the
    connection before the last event was sent (the generation is then cancelled if nobody else waits for it)."""

    def __init__(self, turn: Turn, body, headers: dict[str, str]):
        self.turn, self.finished = turn, False

        async def events():
            async for chunk in body:
                yield chunk
            self.finished = True
        super().__init__(events(), media_type="text/event-stream", headers=headers)

    async def __call__(self, scope, receive, send):
        cancelled = False
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:         # the proxy stopping ends the request: not the client's doing
            cancelled = True
            raise
        finally:
            self.turn.leave(gone=not self.finished and not cancelled)


class _CatchAll:
    """ASGI middleware: an unexpected exception in a handler (a bug; bad input never gets here) becomes a 500
    OpenAI-style body and is logged. Unlike an `exception_handler(Exception)`, which Starlette answers and then
    re-raises (uvicorn then drops the keep-alive connection under the client's next request), the exception
    stops here. One raised after the response started is re-raised: the client sees a cut-off response. A
    client that closed its connection mid-upload (ClientDisconnect) gets one warning line and no answer; a
    request that `ProxyServer.stop` ends after its grace a 503 `server_stopping`."""

    def __init__(self, app, proxy: ProxyServer):
        self.app, self.proxy = app, proxy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        task = asyncio.current_task()
        self.proxy._requests.add(task)
        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect as exc:   # the client went away mid-upload: nobody to answer, not a bug
            log_client_gone(log, "proxy", scope, exc)
        except asyncio.CancelledError:
            if not self.proxy._stopping or started:
                raise
            # `ProxyServer.stop`'s grace is over and it ended the request (a body still being uploaded): answered,
            # instead of uvicorn's "Exception in ASGI application" traceback
            response = _api_for_path(self.proxy, scope.get("path", "")).error_response(server_stopping())
            await response(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - the catch-all
            if started:
                raise
            log.error("proxy: unexpected %s in %s %s", type(exc).__name__, scope.get("method"),
                      redacted_path(scope.get("path")), exc_info=exc)
            err = ProxyError(500, f"internal error in the ajet proxy ({type(exc).__name__}); see the proxy's log",
                             "server_error", code="internal_error")
            response = _api_for_path(self.proxy, scope.get("path", "")).error_response(err)
            await response(scope, receive, send)
        finally:
            self.proxy._requests.discard(task)


_HEAP_FROZEN = False
YOUNG_GC_THRESHOLD = 7000   # container objects allocated (net) between young collections; CPython's default is 700


def freeze_heap_once() -> None:
    """Once per process (the first proxy start): collect garbage, then move every object still alive (the
    libraries, the model, the tokenizer: ~340k objects in a process with torch and transformers loaded) to the
    garbage collector's permanent generation (the standard library's `gc.freeze`), and raise the young generation's
    threshold to `YOUNG_GC_THRESHOLD` (the other thresholds as they were).

    The proxy's per-call garbage triggers full collections, and each one walked that whole heap: 0.25 s a time,
    about 0.3 ms per call at 64 episodes (benchmarks/proxy_overhead.py; docs/benchmarks.md). Frozen objects
    are never collected: one of them that later becomes part of unreachable reference cycles stays in memory.
    A young collection walks the objects made since the last one that still live (the calls in flight, the calls
    just recorded) and promotes them to the older generations, whose collections walk them again; a tenth as many
    young collections catch a call's short-lived objects alive (and promote them) far less often. Garbage
    collection took 0.075 instead of 0.14 ms per non-streamed plain call
    at 64 episodes, 0.065 instead of 0.24 ms per streamed one (benchmarks/proxy_overhead.py, `gc.callbacks`,
    thread CPU time). Cyclic garbage waits for up to 7,000 new objects instead of 700 before it is freed.
    """
    global _HEAP_FROZEN
    if not _HEAP_FROZEN:
        _HEAP_FROZEN = True
        gc.collect()
        gc.freeze()
        young, *older = gc.get_threshold()
        if 0 < young < YOUNG_GC_THRESHOLD:       # 0: collection turned off by the process; left so
            gc.set_threshold(YOUNG_GC_THRESHOLD, *older)


def _token(request: Request) -> str | None:
    """The episode token of a bare `/v1/...` request: its api key (`ajet.guard.api_key`: `Authorization: Bearer`,
    Anthropic's `x-api-key`, or Google's `x-goog-api-key` / `?key=`)."""
    return api_key(request.scope) or None


def _route(request: Request) -> dict[str, Any]:
    """What an adapter may read of a request besides its body (`Api.parse_request`): path, path parameters,
    query parameters (plain values, safe to hand to the prepare pool)."""
    return {"path": request.url.path, "path_params": dict(request.path_params), "query": dict(request.query_params)}


def _api_for_path(proxy: ProxyServer, path: str) -> Api:
    """The API whose error shape an error on `path` gets: the first whose `error_paths` `path` contains (the
    Messages API's for `/v1/messages...`), else Chat Completions' (OpenAI's shape)."""
    return next((api for api in proxy.apis.values() if any(p in path for p in api.error_paths)),
                proxy.apis.get("chat") or next(iter(proxy.apis.values())))


def _is_retry(request: Request) -> bool:
    """The client says this request repeats an earlier one: the OpenAI SDK's `x-stainless-retry-count` >= 1
    (it retries timeouts, connection errors, 408/409/429/5xx), or any `Idempotency-Key` header."""
    count = request.headers.get("x-stainless-retry-count", "0")
    return (count.isdigit() and int(count) > 0) or "idempotency-key" in request.headers


def _request_key(raw: bytes, agent_tag: str, idempotency_key: str) -> str:
    """What identifies a request among its episode's requests: the agent, the idempotency key if any, and
    the exact body (a retry sends the same bytes). SHA-256 (the CPU's SHA instructions hash a coding agent's 73 KB
    body in ~45 us, BLAKE2b in ~90 us), the first 128 bits."""
    h = hashlib.sha256(raw)
    h.update(b"\0" + agent_tag.encode() + b"\0" + idempotency_key.encode())
    return h.hexdigest()[:32]


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
