"""The HTTP front of `ajet serve` without `--conf` (docs/serve.md, "Jobs from a laptop"): the job API, and every
other request forwarded to the running job's own `ajet serve` (ajet/serve/jobs.py), so that clients use one URL.

    POST /ajet/v1/jobs              {"config": {...YAML keys...}, "tasks"?: {"train"|"val"|"test": [rows]}} -> job
    GET  /ajet/v1/jobs              -> {"jobs": [job, ...]}
    GET  /ajet/v1/jobs/{id}         -> job: {"id", "state", "step", "total_steps", "exp_dir", "result", "error", ...}
    POST /ajet/v1/jobs/{id}/stop    -> job

The job API needs a key (`Authorization: Bearer <key>`; 401 without one): submitting and stopping jobs an admin key
(the server's secret, or an admin key of `--keys`), else 403 `admin_key_required`; listing and reading jobs any key,
client keys included (a client waiting for its job's run may see the queue). A job that does not validate is a 400 whose message is what `ajet --conf` would say of the same YAML (with its "did you
mean"); nothing is queued. The episode API and the model endpoint (`/ajet/v1/episodes...`, `/ep/...`) go to the
running job's server, which checks the key itself (the server hands its secret and keys to each job's server); while no job runs they are a 503 `no_job_running` (clients
retry it, as a restarting server's).
"""

from __future__ import annotations

import json
import logging
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ajet.errors import ConfigError
from ajet.guard import bearer_token, key_ring
from ajet.serve.api import API, _error
from ajet.serve.jobs import JobQueue

log = logging.getLogger(__name__)
MAX_JOB_BYTES = 64 * 2**20   # a job's body: its config and, optionally, its task rows
_HOP = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}


def build_jobs_app(queue: JobQueue, secret: str | None, keys: list[tuple[str, str, str]] = ()):
    """The ASGI app of the job server: the job API under `/ajet/v1/jobs`, everything else forwarded to the running
    job's server (`queue.child_url`).

    Args:
        queue: the job queue.
        secret: the admin key named `secret` (None: only `keys`).
        keys: (name, key, scope "client" | "admin") each, `--keys`: a client key lists and reads jobs, an admin key
            also submits and stops them.

    Raises:
        ValueError: `keys` that `ajet.guard.key_ring` refuses (two names, one key twice or as the secret).
    """
    import httpx

    ring = key_ring(secret, keys)

    def guarded(handler, admin: bool):
        async def endpoint(request: Request):
            caller = ring.identify(bearer_token(request.scope) or "")
            if caller is None:
                return _error(401, "invalid_secret", "missing or wrong key: the job API needs `Authorization: Bearer "
                                                     "<key>` with the server's secret or one of its --keys")
            if admin and not caller.admin:
                return _error(403, "admin_key_required", f"key `{caller.name}` is a client key: submitting and "
                                                         "stopping jobs needs an admin key (the server's secret or "
                                                         "an admin key of its --keys)")
            try:
                return await handler(request)
            except ConfigError as exc:
                return _error(400, "invalid_job", str(exc))
            except Exception:   # a bug of ours: a JSON answer and a log line
                log.exception("job API: %s %s", request.method, request.url.path[:200])
                return _error(500, "internal_error", "the server failed on this request (its log has the traceback)")
        return endpoint

    async def submit(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_JOB_BYTES:
            return _error(413, "body_too_large", f"the job is {len(raw)} bytes; the limit is {MAX_JOB_BYTES}: give "
                                                 "large task sets as files on the server (data.train_path)")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            return _error(400, "invalid_json", f"the body is not valid JSON ({str(exc)[:200]})")
        if not isinstance(body, dict) or set(body) - {"config", "tasks"} or "config" not in body:
            return _error(400, "invalid_body", 'send {"config": {...the YAML\'s keys...}, "tasks"?: {"train": [...]}}')
        job = await run_in_threadpool(queue.submit, body["config"], body.get("tasks"))
        return JSONResponse(job)

    async def jobs(_request: Request) -> Response:
        return JSONResponse({"jobs": queue.jobs()})

    def unknown(job_id: str) -> Response:
        return _error(404, "unknown_job", f"no job `{job_id[:100]}` on this server (GET {API}/jobs lists them)")

    async def one(request: Request) -> Response:
        job = queue.get(request.path_params["job_id"])
        return unknown(request.path_params["job_id"]) if job is None else JSONResponse(job)

    async def stop(request: Request) -> Response:
        job = await run_in_threadpool(queue.stop, request.path_params["job_id"])
        return unknown(request.path_params["job_id"]) if job is None else JSONResponse(job)

    api = Starlette(routes=[Route(f"{API}/jobs", guarded(submit, admin=True), methods=["POST"]),
                            Route(f"{API}/jobs", guarded(jobs, admin=False), methods=["GET"]),
                            Route(API + "/jobs/{job_id}", guarded(one, admin=False), methods=["GET"]),
                            Route(API + "/jobs/{job_id}/stop", guarded(stop, admin=True), methods=["POST"])])
    http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def forward(scope, receive, send) -> None:
        request = Request(scope, receive)
        child = queue.child_url
        if child is None:
            return await _error(503, "no_job_running", "no job is running on this server: submit one "
                                f"(POST {API}/jobs) or wait for the queue", retry_after_s=2)(scope, receive, send)
        body = await request.body()
        if len(body) > MAX_JOB_BYTES:
            return await _error(413, "body_too_large", f"the body is {len(body)} bytes")(scope, receive, send)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
        url = child + scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else "")
        try:
            resp = await http.send(http.build_request(request.method, url, headers=headers, content=body), stream=True)
        except httpx.TransportError:   # the job's server is stopping (its last step done) or starting
            return await _error(503, "no_job_running", "the job's server is not answering (it is starting or "
                                "stopping): retry", retry_after_s=2)(scope, receive, send)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower().encode() not in _HOP}
        if scope["path"] == f"{API}/episodes" and request.method == "POST" and resp.status_code == 200:
            data = json.loads(await resp.aread())   # the episode's endpoint on the address this client reached
            await resp.aclose()
            if isinstance(data.get("base_url"), str) and data["base_url"].startswith(child):
                data["base_url"] = str(request.base_url).rstrip("/") + data["base_url"][len(child):]
            return await JSONResponse(data, status_code=200)(scope, receive, send)
        out_headers.pop("content-length", None)
        await StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out_headers,
                                background=BackgroundTask(resp.aclose))(scope, receive, send)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await api(scope, receive, send)
        if scope["type"] != "http":
            return None
        path = scope["path"]
        if path == f"{API}/jobs" or path.startswith(f"{API}/jobs/"):
            return await api(scope, receive, send)
        return await forward(scope, receive, send)

    app.http = http   # closed by the command on the way out
    return app

