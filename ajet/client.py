"""The Python client of `ajet serve`'s episode API (sync and async, on httpx).

    from ajet.client import AjetClient

    client = AjetClient("http://127.0.0.1:8765", secret="...")     # or AJET_URL / AJET_SECRET
    while True:
        with client.episode() as ep:            # begin: the server hands out the next task
            llm = ep.openai()                   # openai.OpenAI bound to this episode's recording endpoint
            r = llm.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.task["query"]}])
            ep.finish(reward=score(r))          # or ep.finish(final_answer=...) and the server's judge scores it

An exception inside the block ends the episode as failed (its traceback is recorded, it is never trained
on) and is re-raised; leaving the block without `finish` does the same. Lost connections and 503s are
retried with exponential backoff for up to `retry_for_s` seconds (a restarting server is waited for).
A server whose trainer stopped early answers 503 `server_restarting` until it is restarted with
`--resume`: that, too, is waited for (within `retry_for_s`), never taken as the end of the run.
`begin` raises `RunFinished` once the server has trained all its steps; `finish` raises `EpisodeGone` when
the server no longer knows the episode (it was abandoned after going idle, or the server restarted).
`AsyncAjetClient` has the same methods as coroutines (`async with client.episode() as ep:`).

Wire protocol (JSON over HTTP; every control call carries `Authorization: Bearer <secret>`, and the calls
on one episode its `episode_token` from begin in the `X-Ajet-Episode-Token` header):

    POST /ajet/v1/episodes                {"client_id", "dataset"?, "task"?, "group_id"?}   -> episode
    POST /ajet/v1/episodes/{id}/finish    {"reward"?, "final_answer"?, "metadata"?, "metrics"?} | {"error"}
    POST /ajet/v1/episodes/{id}/abort     {"reason"?}
    POST /ajet/v1/episodes/{id}/heartbeat {}
    GET  /ajet/v1/status

A job server (`ajet serve` without `--conf`, docs/serve.md "Jobs from a laptop") also takes jobs from the holder of
an admin key (its secret; client keys only list and read jobs): `submit(job)`, `jobs()`, `wait(job_id, timeout_s)`, `stop(job_id)` (coroutines on `AsyncAjetClient`):

    POST /ajet/v1/jobs                    {"config": {...}, "tasks"?: {"train"|"val"|"test": [rows]}} -> job
    GET  /ajet/v1/jobs                    -> {"jobs": [job, ...]}
    GET  /ajet/v1/jobs/{id}               -> job
    POST /ajet/v1/jobs/{id}/stop          -> job
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

API = "/ajet/v1"
TOKEN_HEADER = "X-Ajet-Episode-Token"
_RETRY_STATUS = {502, 503, 504}


class AjetClientError(Exception):
    """The server refused a call (a 4xx); `status` and `code` are the HTTP status and the error code."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class RunFinished(AjetClientError):
    """The server has trained all its steps and hands out no more episodes."""


class EpisodeGone(AjetClientError):
    """The server no longer knows the episode (abandoned after going idle, aborted, or the server restarted)."""


@dataclass
class _EpisodeData:
    episode_id: str
    episode_token: str
    base_url: str
    api_key: str
    model: str
    task: dict[str, Any]
    group_id: str
    dataset: str | None
    idle_timeout_s: float
    policy_version: int
    finished: bool = field(default=False, repr=False)


class EpisodeHandle(_EpisodeData):
    """The client's handle of a running episode of `ajet serve` (what `AjetClient.begin` and `episode()` return;
    the record of a finished episode is `ajet.episode.Episode`, another thing). Attributes: `episode_id`, `episode_token` (the episode's own secret: only the client
    holding it can finish, abort or heartbeat the episode), `task` (dict: task_id, query, answer, metadata),
    `base_url` / `api_key` (OpenAI-compatible, record every call), `model`, `group_id`, `idle_timeout_s`
    (the server abandons the episode after this long without a call or heartbeat), `policy_version`.

    One implementation for both clients: an `AjetClient`'s episode (this class) calls the server at once, an
    `AsyncAjetClient`'s (`AsyncEpisodeHandle`) returns each call as a coroutine to await.
    """

    _client: AjetClient | AsyncAjetClient
    _asynchronous = False

    def openai(self, **kwargs):
        """An `openai.OpenAI` client (`openai.AsyncOpenAI` for an `AsyncEpisodeHandle`) bound to this episode (kwargs go
        to its constructor; without `http_client` it shares the process's TLS context, `ajet.tls`)."""
        from openai import AsyncOpenAI, OpenAI

        from ajet.tls import openai_http_client

        if "http_client" not in kwargs:
            kwargs["http_client"] = openai_http_client(asynchronous=self._asynchronous)
        return (AsyncOpenAI if self._asynchronous else OpenAI)(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def finish(self, reward: float | None = None, final_answer: str | None = None,
               metadata: dict[str, Any] | None = None, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        """End the episode with `reward` (or with `final_answer` only, for the server's judge to score).

        Returns:
            The server's answer, {"episode_id", "status"}.

        Raises:
            AjetClientError: the server refused it (a 400: non-finite reward, no reward and no judge, ...).
            EpisodeGone: the server no longer knows the episode (404/410: abandoned after `idle_timeout_s`
                seconds without a call or heartbeat, aborted, or the server restarted).
            httpx.TransportError: the server stayed unreachable for `retry_for_s` seconds.
        """
        return self._end("finish", _finish_body(reward, final_answer, metadata, metrics))

    def fail(self, error: str) -> dict[str, Any]:
        """End the episode as failed (recorded with `error`, never trained on).

        Raises:
            EpisodeGone: the server no longer knows the episode. AjetClientError: any other refusal (a 4xx).
            httpx.TransportError: the server stayed unreachable for `retry_for_s` seconds.
        """
        return self._end("finish", {"error": error})

    def abort(self, reason: str = "aborted by the client") -> dict[str, Any]:
        """Give the episode up: recorded with `reason`, never trained on; its task goes to another client.

        Raises:
            EpisodeGone: the server no longer knows the episode. AjetClientError: any other refusal (a 4xx).
            httpx.TransportError: the server stayed unreachable for `retry_for_s` seconds.
        """
        return self._end("abort", {"reason": reason})

    def heartbeat(self) -> None:
        """Tell the server the episode is alive (needed only for work longer than `idle_timeout_s` seconds
        without model calls).

        Raises:
            EpisodeGone: the server no longer knows the episode. AjetClientError: any other refusal (a 4xx).
            httpx.TransportError: the server stayed unreachable for `retry_for_s` seconds.
        """
        return self._then(self._client._call("POST", f"{API}/episodes/{self.episode_id}/heartbeat", {},
                                             token=self.episode_token), lambda _: None)

    def _end(self, how: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `how` ("finish" or "abort") with `body`; the episode is finished once the server answered."""
        def ended(out: dict[str, Any]) -> dict[str, Any]:
            self.finished = True
            return out

        return self._then(self._client._end(self.episode_id, self.episode_token, how, body), ended)

    def _then(self, out: Any, after: Any) -> Any:
        """`after(out)`: at once for a sync client's answer `out`; for an async client's (a coroutine), a coroutine
        that awaits it first."""
        if not self._asynchronous:
            return after(out)

        async def awaited() -> Any:
            return after(await out)

        return awaited()


class AsyncEpisodeHandle(EpisodeHandle):
    """A running episode of an `AsyncAjetClient`: `EpisodeHandle`'s methods as coroutines (`await ep.finish(...)`), and
    `openai()` an `openai.AsyncOpenAI`."""

    _asynchronous = True


def _finish_body(reward, final_answer, metadata, metrics) -> dict[str, Any]:
    body: dict[str, Any] = {"reward": reward, "final_answer": final_answer, "metadata": metadata or {},
                            "metrics": metrics or {}}
    return {k: v for k, v in body.items() if v is not None}


def _error(resp: httpx.Response) -> AjetClientError:
    try:
        err = resp.json()["error"]
        code, message = err.get("code"), err.get("message", "")
    except Exception:  # noqa: BLE001 - a body that is not ours (a proxy in between, say)
        code, message = None, resp.text[:300]
    cls = RunFinished if code == "run_finished" else EpisodeGone if resp.status_code in (404, 410) else AjetClientError
    return cls(resp.status_code, code, message)


def _retry_wait(resp: httpx.Response | httpx.TransportError, attempt: int, deadline: float,
                done_codes: tuple[str, ...]) -> dict[str, Any] | float:
    """The answer's JSON when the call succeeded, else the seconds to wait before retrying it.

    Retries connection errors and 502/503/504 (exponential backoff from 0.2 s, at most 5 s, at most the
    server's `Retry-After`) until `deadline`; a 503 `no_task_available` is retried without that bound (the
    server is up and answering: every task is handed out and training is catching up, which may take
    long with many clients). A retried call answered with an error code in `done_codes` (its first try
    went through before the connection broke) counts as success.

    Raises:
        httpx.TransportError: the server stayed unreachable until `deadline`.
        AjetClientError (or RunFinished, EpisodeGone): any other refusal.
    """
    now = time.monotonic()
    if isinstance(resp, httpx.TransportError):
        if now > deadline:
            raise resp
        return min(0.2 * 2 ** attempt, 5.0)
    if resp.status_code < 400:
        return resp.json()
    waiting_for_task = resp.status_code == 503 and _error(resp).code == "no_task_available"
    if resp.status_code not in _RETRY_STATUS or (now > deadline and not waiting_for_task):
        err = _error(resp)
        if attempt > 0 and err.code in done_codes:
            return {"status": err.code}
        raise err
    try:
        cap = float(resp.headers.get("retry-after", 5.0))
    except ValueError:
        cap = 5.0
    return min(0.2 * 2 ** attempt, 5.0, cap)


class _Retry:
    """One API call's retry policy (`_retry_wait`), for both clients: the deadline is fixed when the call starts
    (`retry_for_s` seconds from then), the tries are counted; the clients differ only in how they send and wait."""

    def __init__(self, retry_for_s: float, done_codes: tuple[str, ...]):
        self.deadline, self.attempt, self.done_codes = time.monotonic() + retry_for_s, 0, done_codes

    def after(self, resp: httpx.Response | httpx.TransportError) -> dict[str, Any] | float:
        """The answer's JSON when this try succeeded, else the seconds to wait before the next try.

        Raises:
            httpx.TransportError, AjetClientError: as `_retry_wait`.
        """
        out = _retry_wait(resp, self.attempt, self.deadline, self.done_codes)
        self.attempt += 1
        return out


class _EpisodeBlock:
    """`client.episode(...)`: `with` (an `AjetClient`'s) or `async with` (an `AsyncAjetClient`'s). Entering begins
    the episode; leaving it unfinished fails it: with the block's traceback when an exception left it (the
    exception goes on; the fail call's own errors are dropped), else saying that `finish` was never called."""

    def __init__(self, client: AjetClient | AsyncAjetClient, task: dict[str, Any] | None, group_id: str | None,
                 dataset: str | None):
        self.client, self.args, self.ep = client, (task, group_id, dataset), None

    def _left(self, exc: BaseException | None) -> tuple[str, contextlib.AbstractContextManager] | None:
        """How to fail the episode the block left (the reason, and what surrounds the fail call), or None."""
        if self.ep.finished:
            return None
        if exc is None:
            return "the client left the episode block without calling finish()", contextlib.nullcontext()
        return "".join(traceback.format_exception(exc)), contextlib.suppress(AjetClientError, httpx.TransportError)

    def __enter__(self) -> EpisodeHandle:
        self.ep = self.client.begin(*self.args)
        return self.ep

    def __exit__(self, et, exc: BaseException | None, tb) -> None:
        if (left := self._left(exc)) is not None:
            with left[1]:
                self.ep.fail(left[0])

    async def __aenter__(self) -> AsyncEpisodeHandle:
        self.ep = await self.client.begin(*self.args)
        return self.ep

    async def __aexit__(self, et, exc: BaseException | None, tb) -> None:
        if (left := self._left(exc)) is not None:
            with left[1]:
                await self.ep.fail(left[0])


class _ClientBase:
    """Settings shared by both clients.

    Args:
        url: the server's base URL (default: `AJET_URL`).
        secret: the server's secret or one of its `serve.keys` (default: `AJET_SECRET`).
        client_id: a name for this client in the server's status (default: host-pid-random).
        retry_for_s: how long connection errors and 502/503/504 answers are retried, seconds.
        timeout_s: per-request timeout, seconds.

    Raises:
        ValueError: no URL given and AJET_URL unset.
    """

    _HTTP: type = httpx.Client

    def __init__(self, url: str | None = None, secret: str | None = None, client_id: str | None = None,
                 retry_for_s: float = 120.0, timeout_s: float = 60.0):
        url = (url or os.environ.get("AJET_URL") or "").rstrip("/")
        if not url:
            raise ValueError("no server URL: pass AjetClient(url) or set AJET_URL (printed by `ajet serve`)")
        self.url, self.retry_for_s = url, retry_for_s
        self.secret = secret if secret is not None else os.environ.get("AJET_SECRET")
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        headers = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        self._http = self._HTTP(base_url=self.url, headers=headers, timeout=timeout_s)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, done_codes: tuple[str, ...],
                 token: str | None) -> tuple[_Retry, dict[str, Any]]:
        """One API call's retry policy and the keyword arguments of each try's `request` (with the episode's
        `token`, for calls on one episode)."""
        headers = {TOKEN_HEADER: token} if token else None
        return _Retry(self.retry_for_s, done_codes), {"method": method, "url": path, "json": body, "headers": headers}

    def _end_args(self, episode_id: str, token: str, how: str, body: dict[str, Any]) -> dict[str, Any]:
        """`_call`'s arguments for ending an episode (`how`: "finish" or "abort"); a retried end that the server
        already took counts as done."""
        return {"method": "POST", "path": f"{API}/episodes/{episode_id}/{how}", "body": body,
                "done_codes": ("episode_already_finished",), "token": token}

    def _begin_body(self, task, group_id, dataset) -> dict[str, Any]:
        body = {"client_id": self.client_id, "task": task, "group_id": group_id, "dataset": dataset}
        return {k: v for k, v in body.items() if v is not None}

    def _episode(self, data: dict[str, Any], cls: type[EpisodeHandle]) -> EpisodeHandle:
        """The episode `begin` got (`data`: the server's answer) as a `cls`, bound to this client."""
        ep = cls(**{k: data[k] for k in _EpisodeData.__dataclass_fields__ if k != "finished"})
        ep._client = self
        return ep

    # the job API's requests, sent by both clients' submit, jobs, wait and stop
    @staticmethod
    def _submit_args(job: Any) -> dict[str, Any]:
        """`_call`'s arguments for queueing `job` (see `job_payload`; its ConfigError is raised here)."""
        return {"method": "POST", "path": f"{API}/jobs", "body": job_payload(job)}

    @staticmethod
    def _job_args(job_id: str | None = None, action: str = "") -> dict[str, Any]:
        """`_call`'s arguments for listing the jobs (no `job_id`), reading job `job_id`, or `action` "stop" on it."""
        path = f"{API}/jobs" + ("" if job_id is None else f"/{job_id}") + (f"/{action}" if action else "")
        return {"method": "POST" if action else "GET", "path": path}

    @staticmethod
    def _finished(job: dict[str, Any], timeout_s: float, deadline: float) -> bool:
        """Whether `wait` is over with `job` (done, failed or stopped); raises TimeoutError past `deadline`
        (`time.monotonic()`), the wait having lasted `timeout_s` seconds."""
        if job["state"] in ("done", "failed", "stopped"):
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['id']} is still {job['state']} (step {job['step']}) after {timeout_s:g}s")
        return False


class AjetClient(_ClientBase):
    """Synchronous client of `ajet serve`'s episode API (see the module docstring for the protocol).

    Args:
        url: the server's base URL (default: the environment variable `AJET_URL`).
        secret: the server's secret (default: `AJET_SECRET`; sent as `Authorization: Bearer`).
        client_id: a name for this client in the server's status and progress display (default:
            host-pid-random).
        retry_for_s: how long connection errors and 502/503/504 answers are retried, seconds (exponential
            backoff from 0.2 s, at most 5 s between tries, at most the server's `Retry-After`).
        timeout_s: per-request timeout, seconds.

    Raises:
        ValueError: no URL given and `AJET_URL` unset.
    """

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              done_codes: tuple[str, ...] = (), token: str | None = None) -> dict[str, Any]:
        """One API call (with the episode's `token`, for calls on one episode), retried on connection errors
        and 502/503/504 (see `_retry_wait`)."""
        retry, request = self._request(method, path, body, done_codes, token)
        while True:
            try:
                resp = self._http.request(**request)
            except httpx.TransportError as exc:
                resp = exc
            if isinstance(wait := retry.after(resp), dict):
                return wait
            time.sleep(wait)

    def _end(self, episode_id: str, token: str, how: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(**self._end_args(episode_id, token, how, body))

    def begin(self, task: dict[str, Any] | None = None, group_id: str | None = None,
              dataset: str | None = None) -> EpisodeHandle:
        """Begin an episode: the server's next task (of `dataset`, in a multi-task run), or your own `task`
        ({"query", "answer"?, "task_id"?, "metadata"?}) in GRPO group `group_id`. Waits (retrying) while the
        server has no task to hand out.

        Raises:
            RunFinished: the run is over. AjetClientError: the server refused the request (a 4xx, e.g. a
                wrong secret or an unknown `dataset`).
            httpx.TransportError: the server stayed unreachable for `retry_for_s` seconds.
        """
        return self._episode(self._call("POST", f"{API}/episodes", self._begin_body(task, group_id, dataset)), EpisodeHandle)

    def episode(self, task: dict[str, Any] | None = None, group_id: str | None = None,
                dataset: str | None = None) -> contextlib.AbstractContextManager[EpisodeHandle]:
        """`with client.episode() as ep:` begin; an exception in the block (or no `finish`) fails the episode
        (the exception is re-raised).

        Raises:
            RunFinished, AjetClientError, httpx.TransportError: as `begin`.
        """
        return _EpisodeBlock(self, task, group_id, dataset)

    def status(self) -> dict[str, Any]:
        """The run's status: policy_version, step, total_steps, finished, episodes (running, finished,
        abandoned...), clients.

        Raises:
            AjetClientError: the server refused it (a wrong secret). httpx.TransportError: the server stayed
                unreachable for `retry_for_s` seconds.
        """
        return self._call("GET", f"{API}/status")

    # ---- jobs: `ajet serve` without --conf (docs/serve.md, "Jobs from a laptop"); the secret is the admin key -----
    def submit(self, job: Any) -> dict[str, Any]:
        """Queue a job on a job server: `job` an `ajet.Job` (its config, and its tasks given as Python objects; its
        workflow stays here: the job's episodes come from clients), a YAML's text, or a mapping of config keys.

        Returns:
            the job: {"id", "state": "queued", "step", "total_steps", "exp_dir", ...}.

        Raises:
            AjetClientError: 400 `invalid_job` (the message is what `ajet --conf` says of such a YAML, with its "did
                you mean"), 401 without a key of the server, 403 `admin_key_required` with a client key.
                ConfigError: `job` is no job.
        """
        return self._call(**self._submit_args(job))

    def jobs(self) -> list[dict[str, Any]]:
        """Every job of the server, oldest first: {"id", "state" (queued, running, done, failed, stopped), "step",
        "total_steps", "exp_dir", "result", "error", ...}.

        Raises:
            AjetClientError: 401 without the server's secret.
        """
        return self._call(**self._job_args())["jobs"]

    def wait(self, job_id: str, timeout_s: float = 3600.0, poll_s: float = 1.0) -> dict[str, Any]:
        """Wait until job `job_id` is done, failed or stopped; returns it (its `result`: exp_dir, steps, last_step,
        held_out, checkpoint; a failed one's `error`: its exit status and last output lines).

        Raises:
            TimeoutError: still queued or running after `timeout_s` seconds. AjetClientError: 404 for an unknown id.
        """
        deadline = time.monotonic() + timeout_s
        while not self._finished(job := self._call(**self._job_args(job_id)), timeout_s, deadline):
            time.sleep(poll_s)
        return job

    def stop(self, job_id: str) -> dict[str, Any]:
        """Stop a job: a queued one leaves the queue, a running one stops as after Ctrl-C (its folder keeps what it
        trained). Returns the job as it is now (`wait` for the running one's final state).

        Raises:
            AjetClientError: 404 for an unknown id, 401 without a key of the server, 403 `admin_key_required`
                with a client key.
        """
        return self._call(**self._job_args(job_id, "stop"))

    def close(self) -> None:
        """Close the HTTP connections (also done by `with AjetClient(...) as client:`)."""
        self._http.close()

    def __enter__(self) -> AjetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncAjetClient(_ClientBase):
    """Asynchronous client of `ajet serve`: the arguments and methods of `AjetClient`, each method a coroutine
    (`episode` an async context manager: `async with client.episode() as ep:`).

    Args:
        url: the server's base URL (default: the environment variable `AJET_URL`).
        secret: the server's secret (default: `AJET_SECRET`; sent as `Authorization: Bearer`).
        client_id: a name for this client in the server's status (default: host-pid-random).
        retry_for_s: how long connection errors and 502/503/504 answers are retried, seconds.
        timeout_s: per-request timeout, seconds.

    Raises:
        ValueError: no URL given and `AJET_URL` unset.
    """

    _HTTP = httpx.AsyncClient

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    done_codes: tuple[str, ...] = (), token: str | None = None) -> dict[str, Any]:
        retry, request = self._request(method, path, body, done_codes, token)
        while True:
            try:
                resp = await self._http.request(**request)
            except httpx.TransportError as exc:
                resp = exc
            if isinstance(wait := retry.after(resp), dict):
                return wait
            await asyncio.sleep(wait)

    async def _end(self, episode_id: str, token: str, how: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(**self._end_args(episode_id, token, how, body))

    async def begin(self, task: dict[str, Any] | None = None, group_id: str | None = None,
                    dataset: str | None = None) -> AsyncEpisodeHandle:
        """`AjetClient.begin`, awaited: the server's next task (or your own `task`) as a running episode.

        Raises:
            RunFinished: the run is over. AjetClientError: a 4xx refusal. httpx.TransportError: the server stayed
                unreachable for `retry_for_s` seconds.
        """
        data = await self._call("POST", f"{API}/episodes", self._begin_body(task, group_id, dataset))
        return self._episode(data, AsyncEpisodeHandle)

    def episode(self, task: dict[str, Any] | None = None, group_id: str | None = None,
                dataset: str | None = None) -> contextlib.AbstractAsyncContextManager[AsyncEpisodeHandle]:
        """`async with client.episode() as ep:` (as `AjetClient.episode`)."""
        return _EpisodeBlock(self, task, group_id, dataset)

    async def status(self) -> dict[str, Any]:
        """`AjetClient.status`, awaited: policy_version, step, total_steps, finished, episodes, clients.

        Raises:
            AjetClientError: a wrong secret. httpx.TransportError: unreachable for `retry_for_s` seconds.
        """
        return await self._call("GET", f"{API}/status")

    # ---- jobs (`AjetClient`'s job methods, as coroutines) --------------------------------------------------------
    async def submit(self, job: Any) -> dict[str, Any]:
        """Queue `job` on a job server, as `AjetClient.submit` (an `ajet.Job`, a YAML's text, or a mapping).

        Returns:
            the job as queued: {"id", "state": "queued", "step", "total_steps", "exp_dir", ...}.

        Raises:
            AjetClientError: 400 `invalid_job` with the config's "did you mean", 401 (no key, a wrong one) or 403
                `admin_key_required` (a client key). ConfigError: `job` is no job (nothing is sent).
        """
        return await self._call(**self._submit_args(job))

    async def jobs(self) -> list[dict[str, Any]]:
        """The server's jobs, oldest first, each as `AjetClient.jobs` lists it (id, state, step, result, ...).

        Raises:
            AjetClientError: 401 (no key, a wrong one).
        """
        return (await self._call(**self._job_args()))["jobs"]

    async def wait(self, job_id: str, timeout_s: float = 3600.0, poll_s: float = 1.0) -> dict[str, Any]:
        """Poll job `job_id` every `poll_s` seconds (without blocking the event loop) until it is done, failed or
        stopped, and return it (its `result`, or a failed one's `error`), as `AjetClient.wait`.

        Raises:
            TimeoutError: not finished after `timeout_s` seconds. AjetClientError: 404 (no such job).
        """
        deadline = time.monotonic() + timeout_s
        while not self._finished(job := await self._call(**self._job_args(job_id)), timeout_s, deadline):
            await asyncio.sleep(poll_s)
        return job

    async def stop(self, job_id: str) -> dict[str, Any]:
        """Stop job `job_id` as `AjetClient.stop` does (a queued one leaves the queue, a running one stops cleanly);
        returns the job as it is now.

        Raises:
            AjetClientError: 404 (no such job), 401 (no key, a wrong one) or 403 (a client key).
        """
        return await self._call(**self._job_args(job_id, "stop"))

    async def aclose(self) -> None:
        """Close the HTTP connections (also done by `async with AsyncAjetClient(...) as client:`)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAjetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


_DEPRECATED = {"Episode": "EpisodeHandle", "AsyncEpisode": "AsyncEpisodeHandle"}


def job_payload(job: Any) -> dict[str, Any]:
    """The body `POST /ajet/v1/jobs` takes for `job`: an `ajet.Job` (its config; tasks given as Python objects go as
    data), a YAML's text, or a mapping of config keys (optionally {"config": ..., "tasks": ...} already).

    Raises:
        ConfigError: text that is not a YAML mapping; anything else that is no job.
    """
    import yaml

    from ajet.errors import ConfigError

    if isinstance(job, str):
        try:
            job = yaml.safe_load(job)
        except yaml.YAMLError as exc:
            raise ConfigError(f"job: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if isinstance(job, dict):
        return dict(job) if "config" in job and set(job) <= {"config", "tasks"} else {"config": dict(job)}
    if hasattr(job, "config") and hasattr(job, "_rows"):   # an ajet.Job
        data = job.config.model_dump(mode="json", by_alias=True, exclude_unset=True)
        data.pop("mode", None)
        data.pop("workflow", None)   # a job's episodes come from its clients
        from ajet.job import SPLITS

        for split in job._rows:
            data.get("data", {}).pop(SPLITS[split], None)
        return {"config": data, **({"tasks": dict(job._rows)} if job._rows else {})}
    raise ConfigError(f"job: expected an ajet.Job, a YAML text or a mapping of config keys, got {type(job).__name__}")


def __getattr__(name: str) -> Any:
    """`ajet.client.Episode` and `AsyncEpisode`, the names of `EpisodeHandle` and `AsyncEpisodeHandle` up to 0.1.0:
    the classes themselves, with a DeprecationWarning (the old names go in the next release; `ajet.episode.Episode`
    is the record of a finished episode, unrelated).

    Raises:
        AttributeError: any other name this module does not have.
    """
    if name in _DEPRECATED:
        import warnings

        new = _DEPRECATED[name]
        warnings.warn(f"ajet.client.{name} is renamed ajet.client.{new} (ajet.episode.Episode is the record of a "
                      f"finished episode, another class); the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
