"""The episode API of `ajet serve` (JSON over HTTP under `/ajet/v1`), and the one ASGI app that serves it
beside the proxy's routes.

    POST /ajet/v1/episodes                 begin: {"client_id"?, "dataset"?, "task"?, "group_id"?} -> the episode
    POST /ajet/v1/episodes/{id}/finish     {"reward"?, "final_answer"?, "metadata"?, "metrics"?} or {"error"}
    POST /ajet/v1/episodes/{id}/abort      {"reason"?}
    POST /ajet/v1/episodes/{id}/heartbeat  {}
    GET  /ajet/v1/status

Every call needs `Authorization: Bearer <key>`: the secret (an admin key) or one of `serve.keys`
(ajet/serve/keys.py), 401 without one. A client key runs episodes and reads the status without its `clients`
(the other clients' names and figures: an admin key's view). Finish, abort and heartbeat also need the
episode's own `episode_token` (from begin) in the `X-Ajet-Episode-Token` header, so that no client can end
another's episode. Every refusal is a 4xx (503 while no task can be handed out, or while the trainer restarts) with
an OpenAI-style body `{"error": {"message", "type", "code"}}` that names the field and says what to fix;
the server never crashes on a request. Bodies nested deeper than `MAX_DEPTH` and strings that are not
valid Unicode (a lone surrogate) are refused before anything is begun. Docs with curl examples:
docs/serve.md.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ajet.guard import Caller, bearer_token, finite_number, key_ring
from ajet.proxy.wire import ClientGone, log_client_gone
from ajet.rollout.episode_queue import TOKEN_HEADER, EpisodeApiError, EpisodeQueue

API = "/ajet/v1"
MAX_BODY_BYTES = 1 * 2**20   # an episode API body is small; a final answer of 1 MiB is plenty
MAX_DEPTH = 32               # JSON nesting (task and episode metadata are checkpointed: torch.save recurses)
log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskIn(_Body):
    """A client's own task (the server's tasks come from its dataset)."""

    query: str
    answer: str | None = None
    task_id: str = Field(default_factory=lambda: "own-" + secrets.token_hex(6), min_length=1, max_length=200)
    metadata: dict[str, Any] = {}


class BeginIn(_Body):
    client_id: str = Field("anonymous", min_length=1, max_length=200)
    task: TaskIn | None = None
    group_id: str | None = Field(None, min_length=1, max_length=200)
    dataset: str | None = Field(None, min_length=1, max_length=200)


class FinishIn(_Body):
    reward: float | None = None
    final_answer: str | None = None
    metadata: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    error: str | None = Field(None, max_length=200_000)

    @field_validator("reward", mode="before")
    @classmethod
    def _finite_reward(cls, v):
        return None if v is None else finite_number(v, "`reward`")

    @field_validator("metrics", mode="before")
    @classmethod
    def _finite_metrics(cls, v):
        if not isinstance(v, dict):
            return v                     # pydantic names the type error
        return {k: finite_number(x, f"`metrics.{k}`") for k, x in v.items()}


class _NoAnswer(Response):
    """The answer to a client that has gone: sends nothing (uvicorn expects none from a closed connection)."""

    def __init__(self) -> None:
        super().__init__(status_code=204)

    async def __call__(self, scope, receive, send) -> None:
        return None


class AbortIn(_Body):
    reason: str = Field("aborted by the client", max_length=10_000)


def _error(status: int, code: str, message: str, retry_after_s: float | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            409: "conflict_error", 410: "gone_error", 413: "invalid_request_error", 500: "server_error",
            503: "unavailable_error"}
    message = message.encode("utf-8", "backslashreplace").decode()   # a refusal must always render
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse({"error": {"message": message, "type": kind.get(status, "invalid_request_error"),
                                   "param": None, "code": code}}, status_code=status, headers=headers)


def build_api(queue: EpisodeQueue, secret: str | None, keys: list[tuple[str, str, str]] = ()) -> Starlette:
    """The Starlette app of the episode API, bound to `queue`, guarded by `secret` (an admin key named `secret`;
    None: only `keys`) and `keys` ((name, key, scope "client" | "admin") each: `serve.keys`).

    Raises:
        ValueError: `keys` that `ajet.guard.key_ring` refuses (two names, one key twice or as the secret).
    """
    ring = key_ring(secret, keys)

    async def body(request: Request, model: type[BaseModel]) -> BaseModel:
        try:
            raw = await request.body()
        except ClientDisconnect:
            declared = request.headers.get("content-length")
            raise ClientGone("the client closed the connection before its body arrived"
                             + (f" in full ({declared[:20]} bytes declared)" if declared else "")) from None
        if len(raw) > MAX_BODY_BYTES:
            raise EpisodeApiError(413, "body_too_large", f"the body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            data = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as exc:
            raise EpisodeApiError(400, "invalid_json", f"the body is not valid JSON ({str(exc)[:200]})") from None
        _check_json(data)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"`{'.'.join(map(str, e['loc'])) or 'body'}`: {e['msg']}" for e in exc.errors()[:5])
            raise EpisodeApiError(400, "invalid_body", problems[:1000]) from None

    def guarded(handler: Callable) -> Callable:
        async def endpoint(request: Request):
            caller = ring.identify(bearer_token(request.scope) or "")
            if caller is None:
                return _error(401, "invalid_secret", "missing or wrong key: send `Authorization: Bearer <key>` with "
                                                     "the secret `ajet serve` printed (or serve.secret) or a key of "
                                                     "serve.keys")
            request.state.caller = caller
            try:
                return JSONResponse(await handler(request))
            except EpisodeApiError as exc:
                return _error(exc.status, exc.code, exc.message, exc.retry_after_s)
            except ClientDisconnect as exc:   # the client went away mid-upload: one line; the answer reaches nobody
                log_client_gone(log, "episode API", request.scope, exc)
                return _NoAnswer()
            except Exception:   # a bug of ours: a JSON answer and a log line, never a dropped connection
                log.exception("episode API: %s %s", request.method, request.url.path[:200])
                return _error(500, "internal_error", "the server failed on this request (its log has the "
                                                     "traceback); nothing was changed by it, retry")
        return endpoint

    async def begin(request: Request) -> dict[str, Any]:
        b = await body(request, BeginIn)
        ep = await run_in_threadpool(queue.begin, b.client_id, None if b.task is None else b.task.model_dump(),
                                     b.group_id, b.dataset)
        # the episode's base_url on the address this client reached us at (the server may bind 0.0.0.0)
        ep["base_url"] = str(request.base_url).rstrip("/") + ep["base_url"][len(queue.proxy.url):]
        return ep

    async def finish(request: Request) -> dict[str, Any]:
        b = await body(request, FinishIn)
        return await run_in_threadpool(queue.finish, request.path_params["episode_id"], b.reward, b.final_answer,
                                       b.metadata, b.metrics, b.error, _token(request))

    async def abort(request: Request) -> dict[str, Any]:
        b = await body(request, AbortIn)
        return await run_in_threadpool(queue.abort, request.path_params["episode_id"], b.reason, _token(request))

    async def heartbeat(request: Request) -> dict[str, Any]:
        return queue.heartbeat(request.path_params["episode_id"], _token(request))

    async def status(request: Request) -> dict[str, Any]:
        found = queue.status()
        caller: Caller = request.state.caller
        return found if caller.admin else {k: v for k, v in found.items() if k != "clients"}   # others' names: admin

    async def http_error(request: Request, exc: HTTPException):   # unknown path under /ajet, wrong method
        return _error(exc.status_code, str(exc.detail).lower().replace(" ", "_"),
                      f"{exc.detail}: {request.method} {request.url.path[:200]} (see docs/serve.md)")

    routes = [Route(f"{API}/episodes", guarded(begin), methods=["POST"]),
              Route(API + "/episodes/{episode_id}/finish", guarded(finish), methods=["POST"]),
              Route(API + "/episodes/{episode_id}/abort", guarded(abort), methods=["POST"]),
              Route(API + "/episodes/{episode_id}/heartbeat", guarded(heartbeat), methods=["POST"]),
              Route(f"{API}/status", guarded(status), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _token(request: Request) -> str:
    """The episode token the request carries in TOKEN_HEADER ("" when none: refused unless the id is unknown)."""
    return request.headers.get(TOKEN_HEADER, "")


def _check_json(data: Any) -> None:
    """400 naming the field for JSON nested deeper than MAX_DEPTH, a string (or key) that is not valid
    Unicode (a lone surrogate from a `\\ud800` escape: storing or answering it would fail later), or NaN or
    +-Infinity (answering it would fail: the answer echoes task metadata)."""
    stack = [(data, "body", 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise EpisodeApiError(400, "too_deep", f"`{where}` is nested deeper than {MAX_DEPTH} levels: flatten it")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EpisodeApiError(400, "invalid_string", f"`{where}` holds a lone surrogate "
                                      f"({v[exc.start:exc.end]!a} at index {exc.start}), not valid Unicode") from None
        elif isinstance(v, float) and not math.isfinite(v):   # NaN / Infinity: Python's parser takes them, JSON has none
            raise EpisodeApiError(400, "invalid_body", f"`{where}` is {v}, which is not a JSON number: send a finite "
                                                       "number or null")
        elif isinstance(v, dict):
            for k, x in v.items():
                name = k.encode("utf-8", "backslashreplace").decode()   # a bad key must not break the message
                path = where + "." + name if where != "body" else name
                stack += [(k, f"{where} key", depth + 1), (x, path, depth + 1)]
        elif isinstance(v, list):
            stack += [(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]


def compose(proxy_app, api_app, on_activity: Callable[[str, int], None]):
    """One ASGI app: `/ajet/...` goes to the episode API, everything else (and lifespan) to the proxy.

    Every proxy request that names an episode token (`/ep/<token>/...` or `Authorization: Bearer`) is
    reported to `on_activity(token, 0)` when it starts, `(token, +1)` once its whole body has arrived and
    `(token, -1)` when its response is done, so an episode whose call is still generating is never
    abandoned as idle, while an upload that stalls midway (headers, a few bytes, then nothing) is: it
    only counts as activity when it starts.
    """

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await proxy_app(scope, receive, send)
        path = scope["path"]
        if path.startswith("/ajet/"):
            return await api_app(scope, receive, send)
        token = _episode_token(scope)
        if token is None:
            return await proxy_app(scope, receive, send)
        on_activity(token, 0)
        counted = False

        async def receive_counted():
            nonlocal counted
            message = await receive()
            if not counted and message["type"] == "http.request" and not message.get("more_body", False):
                counted = True                   # the body is complete: the call is being served now
                on_activity(token, +1)
            return message

        try:
            await proxy_app(scope, receive_counted, send)
        finally:
            if counted:
                on_activity(token, -1)

    return app


def _episode_token(scope) -> str | None:
    """The episode token of a proxy request: its `/ep/<token>/` path, else its `Authorization: Bearer`."""
    if scope["path"].startswith("/ep/"):
        return scope["path"][4:].split("/", 1)[0] or None
    return bearer_token(scope)
