"""Environments that live in another process, reached over HTTP in AgentJet's env-service shape.

Every endpoint is a `POST` with a JSON body; the answer is `{"data": ...}`:

    /get_env_profile {env_type, params: {split}}                 -> task ids [str]
    /create          {env_type, task_id, instance_id?, params}   -> {state: [messages], reward, is_terminated, info}
    /step            {instance_id, messages: action, params}     -> {state, reward, is_terminated, info}
    /evaluate        {instance_id, messages, params}             -> score (float)
    /release         {instance_id}                               -> bool

`data.env_service: {url, env_type}` makes the service's task ids the task source (a task's query is empty
until `/create` returns the first state); a workflow drives an instance with `EnvServiceClient`:

    async with EnvServiceClient(task.metadata["env_url"], task.metadata["env_type"]) as env:
        state = await env.create(task.task_id)      # state.messages: the observation as chat messages
        while not state.is_terminated:
            state = await env.step(state.instance_id, {"role": "assistant", "content": action})
        reward = await env.evaluate(state.instance_id)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ajet.errors import AjetError
from ajet.task import Task


class EnvServiceError(AjetError):
    """The environment service could not be reached or answered something other than `{"data": ...}`."""


@dataclass
class EnvState:
    """One answer of `/create` or `/step`.

    Attributes:
        messages: the observation, as chat messages `[{"role", "content"}]`.
        reward: the environment's reward so far (or of this step, as the environment defines it).
        is_terminated: the episode is over; do not step again.
        info: anything else; `info["instance_id"]` names the instance.
    """

    messages: list[dict[str, Any]]
    reward: float = 0.0
    is_terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def instance_id(self) -> str:
        return str(self.info["instance_id"])


class EnvServiceClient:
    """Async client of one env service (httpx). Use as `async with` (or call `aclose`).

    Args:
        url: the service's base URL, e.g. http://127.0.0.1:8080.
        env_type: which environment of the service.
        timeout_s: per request, seconds.
    Raises (every method):
        EnvServiceError: connection failure, an HTTP error status, or a body without `data`; the message
            names the endpoint and quotes the service's answer.
    """

    def __init__(self, url: str, env_type: str, timeout_s: float = 300.0):
        import httpx

        self.url, self.env_type = url.rstrip("/"), env_type
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def __aenter__(self) -> EnvServiceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, endpoint: str, body: dict[str, Any]) -> Any:
        import httpx

        try:
            r = await self._http.post(f"/{endpoint}", json=body)
        except httpx.HTTPError as exc:
            raise EnvServiceError(f"env service {self.url}/{endpoint}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 400:
            raise EnvServiceError(f"env service {self.url}/{endpoint} answered {r.status_code}: {r.text[:500]}")
        try:
            return r.json()["data"]
        except (ValueError, KeyError, TypeError) as exc:
            raise EnvServiceError(f"env service {self.url}/{endpoint}: expected a JSON body {{\"data\": ...}}, got "
                                  f"{r.text[:200]!r}") from exc

    async def task_ids(self, split: str = "train") -> list[str]:
        """The service's task ids of `split` (`/get_env_profile`)."""
        return [str(t) for t in await self._post("get_env_profile", {"env_type": self.env_type, "params": {"split": split}})]

    async def create(self, task_id: str, params: dict[str, Any] | None = None) -> EnvState:
        """A new instance of `task_id`; its first observation (`/create`)."""
        return _state(await self._post("create", {"env_type": self.env_type, "task_id": task_id, "params": params or {}}))

    async def step(self, instance_id: str, action: dict[str, Any], params: dict[str, Any] | None = None) -> EnvState:
        """Apply `action` (a chat message, usually `{"role": "assistant", "content": ...}`) (`/step`)."""
        return _state(await self._post("step", {"instance_id": instance_id, "messages": action, "params": params or {}}))

    async def evaluate(self, instance_id: str, params: dict[str, Any] | None = None) -> float:
        """The instance's score (`/evaluate`)."""
        return float(await self._post("evaluate", {"instance_id": instance_id, "messages": {}, "params": params or {}}))

    async def release(self, instance_id: str) -> bool:
        """Free the instance (`/release`)."""
        return bool(await self._post("release", {"instance_id": instance_id}))


def _state(data: Any) -> EnvState:
    if not isinstance(data, dict) or "state" not in data:
        raise EnvServiceError(f"env service: expected {{state, reward, is_terminated, info}}, got {str(data)[:200]}")
    state = data["state"]
    messages = state if isinstance(state, list) else [{"role": "user", "content": str(state)}]
    return EnvState(messages, float(data.get("reward") or 0.0), bool(data.get("is_terminated")), dict(data.get("info") or {}))


def read_env_service_tasks(url: str, env_type: str, split: str, max_tasks: int | None = None) -> list[Task]:
    """One `Task` per task id the service lists for `split`; metadata carries `env_url` and `env_type` for
    the workflow's `EnvServiceClient`.

    Raises:
        EnvServiceError: the service is unreachable or lists no tasks.
    """
    import asyncio

    async def ids() -> list[str]:
        async with EnvServiceClient(url, env_type, timeout_s=30) as env:
            return await env.task_ids(split)

    found = asyncio.run(ids())[:max_tasks]
    if not found:
        raise EnvServiceError(f"env service {url} lists no {env_type!r} tasks for split {split!r}")
    return [Task(t, "", None, {"env_url": url, "env_type": env_type}) for t in found]
