"""The gateway's one HTTP front: the recording proxy's API routes without per-episode URLs, plus feedback.

    POST /v1/chat/completions, /v1/responses, /v1/messages,       a model call (the proxy's four dialects, as
         /v1beta/models/{model}:generateContent (and streaming)   they are): the request joins its session
    GET  /v1/models, /v1/responses/{id}; POST count_tokens        as the proxy answers them
    POST /v1/feedback          {"session_id" | "response_id", "reward", "comment"?}: durable before the 200
    GET  /v1/sessions/{id}     a session's state, reward and responses (with their policy versions)
    POST /v1/sessions/{id}/close   the conversation is over: close the session now
    GET  /healthz              {"status": "ok", "policy_version", "training": "running" | "done"} (no secret)
    GET  /metrics              Prometheus text (ajet/gateway/ops.py)                          admin key
    POST /v1/admin/rollback    {to?: version}: serve a kept earlier version (ajet/gateway/gate.py); waits up to
                               ROLLBACK_WAIT_S for the trainer thread to do it (202 while pending)   admin key
    GET  /v1/admin/versions    versions served, gate decisions, kept checkpoints              admin key

Nothing of the proxy is re-implemented: a model call's body is read once, its session is resolved
(`SessionBook.resolve`), and the request goes to the proxy's own route of that session's episode
(`/ep/<token>/...`) with the body replayed. Every answer carries `X-Ajet-Session` and `X-Ajet-Response-Id` (the
body's `id`); a non-streamed one also `X-Ajet-Policy-Version`. With keys (`gateway.secret` and `gateway.keys`),
every request but /healthz must carry one (`Authorization: Bearer`, `x-api-key` or `x-goog-api-key`: whatever the
client's SDK sends as its api key; `?key=` only with `allow_query_key`), else 401. A client key may call the
model APIs and use (rate, read, close) only the sessions it opened; /metrics, /v1/admin/* and other keys'
sessions need an admin key (the secret is one), else 403 in the dialect's error shape. Before anything else the shared guard (ajet/guard.py) refuses a request for a Host
not allowed (403) and a POST whose Content-Type is not JSON (415); no answer carries CORS headers. With a rate
limit, a client over it gets a 429 with `Retry-After` (not /healthz, /metrics): one bucket per key of
`gateway.keys` (by its name), else per source address, whatever session it sends. Admission: at most `max_queued` model calls wait beyond the
`decoding` the engine generates together (while an update holds calls, all of them wait); a call beyond them
is answered at once with a 503 `overloaded` and `Retry-After` instead of waiting without bound. A call is
counted only once its body is complete, and a request whose headers and body do not arrive within
`read_timeout_s` has its connection closed (ajet/gateway/timeouts.py), so slow uploads never take a place. A
session is written to gateway.sqlite only when its first answer is recorded (ajet/gateway/sessions.py). A client that
closes its connection while its call waits or generates gets nothing, and its generation is stopped (the
proxy's `until_answered`). Refusals use the proxy's error contract (a 4xx/503 in the dialect's error shape
naming the field); the proxy's per-episode paths (`/ep/...`) are not served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match, Route

from ajet import guard
from ajet.gateway.gate import VersionGate
from ajet.gateway.ops import RateLimiter, RequestMetrics
from ajet.gateway.sessions import GatewayError, Session, SessionBook
from ajet.gateway.timeouts import ReadTimeouts
from ajet.proxy.server import RESPONSE_ID_HEADER, until_answered
from ajet.proxy.turn import OpenEpisode
from ajet.proxy.wire import ProxyError, json_response, load_json, log_client_gone, read_body, validated

log = logging.getLogger(__name__)
SESSION_HEADER = "X-Ajet-Session"
VERSION_HEADER = "X-Ajet-Policy-Version"
FEEDBACK_MAX_BODY_BYTES = 1 * 2**20   # a feedback body is small
ROLLBACK_WAIT_S = 60.0                # how long POST /v1/admin/rollback waits for the rollback to be done
BUSY_RETRY_AFTER_S = 1                # the Retry-After of a model call refused because the queue is full, seconds


class FeedbackIn(BaseModel):
    """The body of `POST /v1/feedback`: a reward for a session, named or found by one of its responses."""

    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(None, min_length=1, max_length=200)
    response_id: str | None = Field(None, min_length=1, max_length=200)
    reward: float = Field(allow_inf_nan=True)   # a non-finite reward is refused by the range check, naming the range
    comment: str | None = Field(None, max_length=10_000)

    @field_validator("reward", mode="before")
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("reward must be a JSON number")
        try:
            return float(v)
        except OverflowError:    # a 400-digit integer: out of any range
            return float("inf") if v > 0 else float("-inf")


class RollbackIn(BaseModel):
    """The body of `POST /v1/admin/rollback`: the version to serve (None: the one served before the current)."""

    model_config = ConfigDict(extra="forbid")
    to: int | None = Field(None, ge=0, strict=True)


class GatewayApp:
    """ASGI app in front of `proxy.app` (see the module docstring).

    Args:
        proxy: the `ProxyServer` (not yet started); its routes and adapters are used as they are.
        book: the sessions.
        secret: an admin key (named "secret"); None with no `keys`: no key is asked for (every caller admin).
        policy_version: `() -> int`, the engine's current version (for /healthz).
        limiter: per-client rate limits (`RateLimiter`, keyed by source address), or None.
        gate: the evaluation gate (`VersionGate`): its `LiveHold` holds model calls while a new policy is
            updated and evaluated, its store takes rollback wishes; None: no gate, no /v1/admin routes.
        allowed_hosts: the Host names answered (`ajet.guard.allowed_hosts`; None: any); default: this machine's
            loopback names only.
        max_queued: model calls that may wait beyond `decoding` (`gateway.max_queued`); None: no bound.
        decoding: model calls the engine generates together (`rollout.max_batch_size` // `gateway.n`).
        read_timeout_s: seconds a request's headers and body may take (`gateway.read_timeout_s`; sets
            `proxy.http_protocol`, so the app must be made before the proxy starts); None: no timeout.
        keys: more api keys, (name, key, scope "client" | "admin") each (`gateway.keys`).
        allow_query_key: accept the key in the URL's `?key=` too (`gateway.allow_query_key`).

    Raises:
        ValueError: `keys` that `ajet.guard.KeyRing` refuses (two names, one key twice).
    """

    def __init__(self, proxy, book: SessionBook, secret: str | None, policy_version,
                 limiter: RateLimiter | None = None, gate: VersionGate | None = None,
                 allowed_hosts: list[str] | None = list(guard.LOCAL_HOSTS), max_queued: int | None = None,
                 decoding: int = 1, read_timeout_s: float | None = None,
                 keys: list[tuple[str, str, str]] = (), allow_query_key: bool = False):
        self.proxy, self.book, self.secret, self.policy_version = proxy, book, secret, policy_version
        self.keys = guard.key_ring(secret, keys) if secret is not None or keys else None
        self.allow_query_key = allow_query_key
        self.allowed_hosts = allowed_hosts
        self.max_queued, self.decoding = max_queued, max(1, decoding)
        self.admitted = 0                           # model calls in the gateway now: generating or waiting
        self.read_timeouts = ReadTimeouts(read_timeout_s) if read_timeout_s is not None else None
        if self.read_timeouts is not None:
            proxy.http_protocol = self.read_timeouts.protocol()
        self.limiter, self.metrics, self.gate = limiter, RequestMetrics(), gate
        self.first_version = policy_version()
        self.training = "running"                   # "done" once the last update is over (the gateway keeps serving)
        self.proxy_app = proxy.app
        self.util = proxy.open_episode("gateway")   # answers /v1/models, count_tokens and unparseable bodies
        self.api_routes = [(Route(path, _nothing, methods=[method]), api, kind)
                           for api in proxy.apis.values() for path, method, kind in api.routes]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":                   # lifespan: the proxy records its event loop there
            return await self.proxy_app(scope, receive, send)
        path = scope["path"]
        started, status, t0 = False, 0, time.perf_counter()

        async def tracking_send(message):
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
            await send(message)

        try:
            return await self._route(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: a JSON 500 and a log line, never a dropped connection
            if started:
                raise
            log.error("gateway: unexpected %s in %s %s", type(exc).__name__, scope.get("method"), path[:200],
                      exc_info=exc)
            err = ProxyError(500, f"internal error in the ajet gateway ({type(exc).__name__}); see its log",
                             "server_error", code="internal_error")
            return await self._error(path, err)(scope, receive, tracking_send)
        finally:
            self.metrics.observe(self._route_label(scope), status, time.perf_counter() - t0)

    def _route_label(self, scope) -> str:
        """The route template of a request (its metrics label: never the raw path, whose ids are unbounded)."""
        path = scope["path"]
        if path in ("/healthz", "/metrics", "/v1/feedback", "/v1/admin/rollback", "/v1/admin/versions"):
            return path
        if path.startswith("/v1/sessions/"):
            return "/v1/sessions/{id}/close" if path.endswith("/close") else "/v1/sessions/{id}"
        for route, _api, _kind in self.api_routes:
            if route.matches(scope)[0] == Match.FULL:
                return route.path
        return "other"

    async def _route(self, scope, receive, send):
        path = scope["path"]
        try:
            guard.check(scope, self.allowed_hosts, "call the gateway at the address it printed (or add the name "
                        "to gateway.allowed_hosts)")
            if path == "/healthz":
                return await json_response({"status": "ok", "policy_version": self.policy_version(),
                                            "training": self.training})(scope, receive, send)
            if path.startswith("/ep/"):
                raise ProxyError(404, "this gateway has no per-episode URLs: call /v1/... (the session is the "
                                 f"{SESSION_HEADER} header, or found from the conversation)", code="not_found")
            caller = self._caller(scope)
            if path == "/metrics" or path.startswith("/v1/admin/"):
                self._need_admin(caller, path)
            if path == "/metrics":
                counts = {**self.book.counts_snapshot(), **(self.gate.counts if self.gate is not None else {}),
                          "read_timeouts": self.read_timeouts.timed_out if self.read_timeouts is not None else 0}
                text = self.metrics.render(counts, self.book.states(), self.policy_version(), self.first_version)
                return await Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")(
                    scope, receive, send)
            if self.limiter is not None:
                client = scope.get("client")
                named = self.keys is not None and caller.name != "secret"
                wait = self.limiter.take(f"key:{caller.name}" if named else f"addr:{client[0] if client else '?'}")
                if wait is not None:
                    raise ProxyError(429, f"rate limit exceeded ({self.limiter.rps:g} requests/s, bursts of "
                                     f"{self.limiter.burst}): retry after {wait}s", "rate_limit_error",
                                     code="rate_limit_exceeded", retry_after=wait)
            if path == "/v1/feedback" or path.startswith("/v1/sessions/"):
                return await self._own(scope, receive, send, caller)
            if path.startswith("/v1/admin/"):
                return await self._admin(scope, receive, send)
            for route, api, kind in self.api_routes:
                match, child = route.matches(scope)
                if match == Match.FULL:
                    return await self._api(scope, receive, send, api, kind, child.get("path_params", {}), caller)
            return await self.proxy_app(scope, receive, send)   # its 404 / 405 in the dialect's shape
        except ProxyError as err:
            return await self._error(path, err)(scope, receive, send)
        except guard.Refused as err:
            return await self._error(path, ProxyError(err.status, err.message, _error_type(err.status),
                                                      code=err.code))(scope, receive, send)
        except GatewayError as err:
            return await self._error(path, ProxyError(err.status, err.message, _error_type(err.status),
                                                      param=err.param, code=err.code))(scope, receive, send)
        except ClientDisconnect as exc:
            log_client_gone(log, "gateway", scope, exc)

    # ---- model calls -------------------------------------------------------------------------------
    async def _api(self, scope, receive, send, api, kind: str, path_params: dict[str, Any], caller: guard.Caller):
        if kind in ("models", "count_tokens"):
            return await self.proxy_app(_to_episode(scope, self.util.api_key), receive, send)
        if kind == "stored":                          # GET /v1/responses/{id}: from the session that answered it
            s = self.book.session_of_response(path_params.get("response_id", ""))
            if s is not None and not caller.admin and s.key != caller.name:
                s = None                              # another key's response: as if unknown (the proxy's 404)
            token = s.endpoint.api_key if s is not None and s.endpoint is not None else self.util.api_key
            return await self.proxy_app(_to_episode(scope, token), receive, send)
        request = Request(scope, receive)
        raw = await read_body(request, self.proxy.max_body_bytes)   # before taking a place: a slow upload takes none
        if self.max_queued is not None and self.admitted >= self.decoding + self.max_queued:
            raise ProxyError(503, f"the gateway is busy: {self.admitted} model calls are being answered or wait for "
                             f"the engine ({self.decoding} generated together, gateway.max_queued {self.max_queued} "
                             f"waiting); retry after {BUSY_RETRY_AFTER_S}s", "server_error", code="overloaded",
                             retry_after=BUSY_RETRY_AFTER_S)
        self.admitted += 1
        try:
            if self.gate is None:
                return await self._model_call(scope, receive, send, api, path_params, request, raw, caller)
            # waits while a new policy is updated and evaluated; a client gone meanwhile leaves the queue
            await until_answered(self.gate.hold.enter(), receive)
            try:
                return await self._model_call(scope, receive, send, api, path_params, request, raw, caller)
            finally:
                self.gate.hold.leave()
        finally:
            self.admitted -= 1

    async def _model_call(self, scope, receive, send, api, path_params: dict[str, Any], request: Request, raw: bytes,
                          caller: guard.Caller):
        route = {"path": scope["path"], "path_params": dict(path_params), "query": dict(request.query_params)}
        header = request.headers.get(SESSION_HEADER)
        peek = await run_in_threadpool(self._peek, api, raw, route)
        if peek is None and header is None:           # the proxy answers its 400; nothing is recorded
            return await self.proxy_app(_to_episode(scope, self.util.api_key), _replay(raw, receive), send)
        messages, tools, previous = peek or (None, None, None)
        session = await run_in_threadpool(self.book.resolve, header, messages, tools, previous, caller.name,
                                          caller.admin)
        try:
            return await self.proxy_app(_to_episode(scope, session.endpoint.api_key), _replay(raw, receive),
                                        self._tagging(send, session))
        finally:
            self.book.activity(session, -1)

    def _peek(self, api, raw: bytes, route: dict[str, Any]):
        """(wire messages, wire tools, previous_response_id) of a model call, or None when the body does not
        parse (the proxy then says why)."""
        try:
            data = load_json(raw, self.proxy.max_body_items)
            previous = data.get("previous_response_id")
            if isinstance(previous, str) and self.book.session_of_response(previous) is not None:
                return None, None, previous
            req, _ = api.parse_request(data, OpenEpisode("gateway-peek", ""), route)
        except Exception:  # noqa: BLE001 - any refusal is the proxy's to answer, in its words
            return None
        if self.book.n > 1 and (req.n or 1) > 1:
            raise ProxyError(400, f"this gateway samples every request {self.book.n} times and answers the judge's "
                             "pick (best-of-N): ask for one choice (n: 1)", param="n", code="unsupported_value")
        return req.wire_messages(), req.wire_tools(), None

    def _tagging(self, send, session: Session):
        """`send`, adding the session id (and, when known, the policy version) to the response's headers."""
        async def tagged(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((SESSION_HEADER.lower().encode(), session.session_id.encode()))
                rid = next((v.decode("latin-1") for k, v in headers if k == RESPONSE_ID_HEADER.lower().encode()), None)
                version = self.book.version_of(rid) if rid is not None else None
                if version is not None:
                    headers.append((VERSION_HEADER.lower().encode(), str(version).encode()))
                message = {**message, "headers": headers}
            await send(message)
        return tagged

    # ---- feedback and sessions ---------------------------------------------------------------------
    async def _own(self, scope, receive, send, caller: guard.Caller):
        request, path = Request(scope, receive), scope["path"]
        owner = None if caller.admin else caller.name   # a client key: its own sessions only
        method = scope["method"]
        if path == "/v1/feedback" and method == "POST":
            raw = await read_body(request, FEEDBACK_MAX_BODY_BYTES)
            body: FeedbackIn = validated(FeedbackIn, load_json(raw))
            if body.session_id is None and body.response_id is None:
                raise ProxyError(400, "send `session_id` (an answer's X-Ajet-Session header) or `response_id` (an "
                                 "answer's `id`)", param="session_id", code="missing_session")
            out = await run_in_threadpool(self.book.feedback, body.session_id, body.response_id, body.reward,
                                          body.comment, caller.name, owner)
            return await json_response(out)(scope, receive, send)
        parts = path.removeprefix("/v1/sessions/").split("/")
        if len(parts) == 1 and parts[0] and method == "GET":
            return await json_response(self.book.get(parts[0], owner))(scope, receive, send)
        if len(parts) == 2 and parts[0] and parts[1] == "close" and method == "POST":
            out = await run_in_threadpool(self.book.close, parts[0], "closed by the client", owner)
            return await json_response(out)(scope, receive, send)
        raise ProxyError(404 if len(parts) > 2 or not parts[0] else 405,
                         f"no route {method} {path[:200]}: see /v1/feedback, GET /v1/sessions/ID, "
                         "POST /v1/sessions/ID/close", code="not_found")

    async def _admin(self, scope, receive, send):
        request, path, method = Request(scope, receive), scope["path"], scope["method"]
        if self.gate is None:
            raise ProxyError(404, "this gateway has no version gate", code="not_found")
        if path == "/v1/admin/versions" and method == "GET":
            return await json_response(await run_in_threadpool(self.gate.snapshot))(scope, receive, send)
        if path == "/v1/admin/rollback" and method == "POST":
            raw = await read_body(request, FEEDBACK_MAX_BODY_BYTES)
            body: RollbackIn = validated(RollbackIn, load_json(raw) if raw.strip() else {})
            store = self.gate.store
            rollback_id = await run_in_threadpool(store.request_rollback, body.to)
            deadline = time.monotonic() + ROLLBACK_WAIT_S
            row = store.rollback(rollback_id)
            while row["done_at"] is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                row = await run_in_threadpool(store.rollback, rollback_id)
            out = {**row, "status": "pending" if row["done_at"] is None else "done" if row["ok"] else "refused",
                   "policy_version": self.policy_version()}
            if out["status"] == "refused":
                raise ProxyError(409, row["message"], param="to", code="rollback_refused")
            return await json_response(out, status=202 if out["status"] == "pending" else 200)(scope, receive, send)
        raise ProxyError(404 if path not in ("/v1/admin/versions", "/v1/admin/rollback") else 405,
                         f"no route {method} {path[:200]}: see POST /v1/admin/rollback, GET /v1/admin/versions",
                         code="not_found")

    def _caller(self, scope) -> guard.Caller:
        """Who sends the request: the key it carries (`ajet.guard.api_key`; the URL's `?key=` only with
        `allow_query_key`). Without any key configured, an anonymous admin.

        Raises:
            ProxyError: 401 `invalid_api_key` for a missing or unknown key, `query_key_refused` for a key sent
                only in the URL of a gateway that does not accept it there.
        """
        if self.keys is None:
            return guard.Caller("", "admin")
        caller = self.keys.identify(guard.api_key(scope, query=self.allow_query_key))
        if caller is not None:
            return caller
        if not self.allow_query_key and guard.query_key(scope) and not guard.api_key(scope, query=False):
            raise ProxyError(401, "this gateway does not take the api key from the URL (?key=: it ends up in "
                             "browser history, Referer headers and proxy logs): send it as a header (Authorization: "
                             "Bearer, x-api-key or x-goog-api-key), or set gateway.allow_query_key: true",
                             "authentication_error", code="query_key_refused")
        raise ProxyError(401, "missing or wrong api key: send one of the gateway's keys (gateway.secret or "
                         "gateway.keys) as your SDK's api key (Authorization: Bearer, x-api-key or x-goog-api-key)",
                         "authentication_error", code="invalid_api_key")

    @staticmethod
    def _need_admin(caller: guard.Caller, path: str) -> None:
        """Raises ProxyError 403 `admin_key_required` when `caller` is not an admin key."""
        if not caller.admin:
            raise ProxyError(403, f"{path[:100]} needs an admin key (gateway.secret or a gateway.keys entry with "
                             f"scope admin); key {caller.name!r} is a client key", "permission_error",
                             code="admin_key_required")

    def _error(self, path: str, err: ProxyError):
        """`err` in the error shape of the dialect `path` belongs to (OpenAI's for the gateway's own routes)."""
        api = next((a for a in self.proxy.apis.values() if any(p in path for p in a.error_paths)), None)
        return api.error_response(err) if api is not None else err.response()


def _error_type(status: int) -> str:
    """The OpenAI error `type` of a refusal with this HTTP status."""
    return {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")


async def _nothing(_request):   # the endpoint of the route table used only for matching
    return None


def _to_episode(scope, token: str):
    """`scope` with its path moved under the episode's own prefix `/ep/<token>` (the proxy's per-episode route)."""
    path = f"/ep/{token}{scope['path']}"
    return {**scope, "path": path, "raw_path": path.encode()}


def _replay(raw: bytes, receive):
    """A `receive` that hands the already-read body over once, then waits on the client (for disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()
    return replay
