"""The episode API of `ajet serve` (JSON over HTTP under `/ajet/v1`), and the one ASGI app that serves it
beside the proxy's routes.

    POST /ajet/v1/episodes                 begin: {"client_id"?, "dataset"?, "task"?, "group_id"?} -> the episode
    POST /ajet/v1/episodes/{id}/finish     {"reward"?, "final_answer"?, "metadata"?, "metrics"?} or {"error"}
    POST /ajet/v1/episodes/{id}/abort      {"reason"?}
    POST /ajet/v1/episodes/{id}/heartbeat  {}
    GET  /ajet/v1/status

Every call needs `Authorization: Bearer <secret>`. Every refusal is a 4xx (503 while no task can be
handed out) with an OpenAI-style body `{"error": {"message", "type", "code"}}` that says what to fix; the
server never crashes on a request. Docs with curl examples: docs/serve.md.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ajet.rollout.episode_queue import EpisodeApiError, EpisodeQueue

API = "/ajet/v1"
MAX_BODY_BYTES = 1 * 2**20   # an episode API body is small; a final answer of 1 MiB is plenty


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
    def _finite(cls, v):
        if isinstance(v, bool) or (v is not None and not isinstance(v, (int, float))):
            raise ValueError("reward must be a JSON number")
        if v is not None and not math.isfinite(v):
            raise ValueError(f"reward must be a finite number, got {v}")
        return v


class AbortIn(_Body):
    reason: str = Field("aborted by the client", max_length=10_000)


def _error(status: int, code: str, message: str, retry_after_s: float | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            409: "conflict_error", 410: "gone_error", 413: "invalid_request_error", 503: "unavailable_error"}
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse({"error": {"message": message, "type": kind.get(status, "invalid_request_error"),
                                   "param": None, "code": code}}, status_code=status, headers=headers)


def build_api(queue: EpisodeQueue, secret: str) -> Starlette:
    """The Starlette app of the episode API, bound to `queue`, guarded by `secret`."""

    async def body(request: Request, model: type[BaseModel]) -> BaseModel:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise EpisodeApiError(413, "body_too_large", f"the body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            data = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as exc:
            raise EpisodeApiError(400, "invalid_json", f"the body is not valid JSON ({str(exc)[:200]})") from None
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"`{'.'.join(map(str, e['loc'])) or 'body'}`: {e['msg']}" for e in exc.errors()[:5])
            raise EpisodeApiError(400, "invalid_body", problems[:1000]) from None

    def guarded(handler: Callable) -> Callable:
        async def endpoint(request: Request):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {secret}".encode()):
                return _error(401, "invalid_secret", "missing or wrong secret: send `Authorization: Bearer <secret>` "
                                                     "with the secret `ajet serve` printed (or serve.secret)")
            try:
                return JSONResponse(await handler(request))
            except EpisodeApiError as exc:
                return _error(exc.status, exc.code, exc.message, exc.retry_after_s)
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
                                       b.metadata, b.metrics, b.error)

    async def abort(request: Request) -> dict[str, Any]:
        b = await body(request, AbortIn)
        return await run_in_threadpool(queue.abort, request.path_params["episode_id"], b.reason)

    async def heartbeat(request: Request) -> dict[str, Any]:
        return queue.heartbeat(request.path_params["episode_id"])

    async def status(_request: Request) -> dict[str, Any]:
        return queue.status()

    async def http_error(request: Request, exc: HTTPException):   # unknown path under /ajet, wrong method
        return _error(exc.status_code, str(exc.detail).lower().replace(" ", "_"),
                      f"{exc.detail}: {request.method} {request.url.path[:200]} (see docs/serve.md)")

    routes = [Route(f"{API}/episodes", guarded(begin), methods=["POST"]),
              Route(API + "/episodes/{episode_id}/finish", guarded(finish), methods=["POST"]),
              Route(API + "/episodes/{episode_id}/abort", guarded(abort), methods=["POST"]),
              Route(API + "/episodes/{episode_id}/heartbeat", guarded(heartbeat), methods=["POST"]),
              Route(f"{API}/status", guarded(status), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def compose(proxy_app, api_app, on_activity: Callable[[str, int], None]):
    """One ASGI app: `/ajet/...` goes to the episode API, everything else (and lifespan) to the proxy.

    Every proxy request that names an episode token (`/ep/<token>/...` or `Authorization: Bearer`) is
    reported to `on_activity(token, +1)` when it starts and `(token, -1)` when its response is done, so
    an episode whose call is still generating is never abandoned as idle.
    """

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await proxy_app(scope, receive, send)
        path = scope["path"]
        if path.startswith("/ajet/"):
            return await api_app(scope, receive, send)
        token = _episode_token(path, scope.get("headers", ()))
        if token is None:
            return await proxy_app(scope, receive, send)
        on_activity(token, +1)
        try:
            await proxy_app(scope, receive, send)
        finally:
            on_activity(token, -1)

    return app


def _episode_token(path: str, headers) -> str | None:
    if path.startswith("/ep/"):
        return path[4:].split("/", 1)[0] or None
    for k, v in headers:
        if k == b"authorization" and v[:7].lower() == b"bearer ":
            return v[7:].decode("latin-1").strip()
    return None
