"""The user-facing workflow API: `Workflow`, `WorkflowOutput` and the per-episode `Tuner`.

A workflow is the user's own agent code. ajet hands it a `Tuner` whose `base_url`/`api_key` point at
this episode's proxy endpoint; every chat-completion call made there is recorded for training.

    class MyWorkflow(Workflow):
        async def execute(self, task, tuner):
            r = await tuner.client.chat.completions.create(model=tuner.model, messages=[...])
            return WorkflowOutput(reward=1.0 if ok(r) else 0.0)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # keep `import ajet` light: openai is imported only when a client is built
    from openai import AsyncOpenAI

    from ajet.engines.base import EngineWait
    from ajet.task import Task
    from ajet.tool_types import ToolCaller, ToolResult


@dataclass
class WorkflowOutput:
    """What a workflow returns for one episode.

    Attributes:
        reward: scalar episode reward (any finite float; GRPO-style estimators compare it within the episode's
            group, so only differences matter); None lets the configured judge score the episode.
        final_answer: the agent's final answer text (what a judge reads), if any.
        metadata: free-form JSON-serialisable data stored with the trajectory.
        metrics: numeric values averaged per step into metrics.jsonl (e.g. {"turns": 3}).
    """

    reward: float | None = None
    final_answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Tuner:
    """Per-episode handle given to `Workflow.execute`.

    Attributes:
        base_url: OpenAI-compatible base URL for this episode (ends in `/v1`).
        api_key: this episode's secret token (also embedded in `base_url`).
        model: the model name to pass as `model=` (any string is accepted by the proxy).
        episode_id: id of this episode (for the workflow's own logging).
    """

    base_url: str
    api_key: str
    model: str
    episode_id: str
    _client: AsyncOpenAI | None = field(default=None, repr=False)
    _tools: ToolCaller | None = field(default=None, repr=False)
    _engine_wait: EngineWait | None = field(default=None, repr=False)

    @property
    def engine_wait(self) -> EngineWait | None:
        """How long this episode's calls have waited in the engine's queue (`ajet.engines.base.EngineWait`), which
        the episode's timeout does not count; None where ajet cannot see it (a Ray worker)."""
        return self._engine_wait

    @property
    def client(self) -> AsyncOpenAI:
        """A ready `openai.AsyncOpenAI` client bound to this episode (created on first use; 2 retries, a
        600 s timeout per request; the process's shared TLS context, `ajet.tls`, instead of a new one per client)."""
        if self._client is None:
            from openai import AsyncOpenAI

            from ajet.tls import openai_http_client

            self._client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=2, timeout=600,
                                       http_client=openai_http_client())
        return self._client

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for Anthropic clients (`anthropic.Anthropic(base_url=..., api_key=tuner.api_key)`,
        Claude Code's `ANTHROPIC_BASE_URL`): `base_url` without `/v1`; they append `/v1/messages`."""
        return self.base_url[: -len("/v1")]

    @property
    def gemini_base_url(self) -> str:
        """The base URL for Gemini API clients (`google.genai.Client(api_key=tuner.api_key,
        http_options=HttpOptions(base_url=...))`, Gemini CLI's `GOOGLE_GEMINI_BASE_URL` with `GEMINI_API_KEY`):
        `base_url` without `/v1`; they append `/v1beta/models/...`."""
        return self.base_url[: -len("/v1")]

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The run's MCP tools (config `tools.mcp_servers`) as OpenAI-format schemas, ready for `tools=`;
        [] when the config names no servers."""
        return self._tools.schemas if self._tools is not None else []

    async def call_tool(self, name: str, arguments: dict[str, Any] | str | None = None) -> ToolResult:
        """Call one of `tools` with `arguments` (a dict, or the JSON text the model wrote).

        The call counts against the episode's `tools.max_calls_per_episode`, is cut at `tools.call_timeout_s`,
        and is recorded on the episode (`Episode.tool_calls`). A failure (unknown tool, bad JSON, server
        error, timeout, crashed server, limit reached) is an error result whose `.text` tells the model what
        went wrong, as real agents see it; `.is_error` and `.error_kind` say so to the workflow.

        Raises:
            RuntimeError: the config names no MCP servers (`tools.mcp_servers`).
        """
        if self._tools is None:
            raise RuntimeError("tuner.call_tool needs MCP servers: add a `tools.mcp_servers` section to the config")
        return await self._tools.call(name, arguments)

    def agent(self, tag: str) -> Tuner:
        """A tuner for one agent of a multi-agent workflow: its calls are recorded under `tag`, merged
        apart from the other agents' calls, and (with `algorithm.group_by_agent_tag`) grouped per tag.

        Raises:
            ValueError: `tag` is empty or contains '/' (it becomes a path segment of the endpoint URL).
        """
        if not tag or "/" in tag:
            raise ValueError(f"agent tag must be a non-empty name without '/': {tag!r}")
        return Tuner(base_url=self.base_url[: -len("/v1")] + f"/agent/{tag}/v1", api_key=self.api_key,
                     model=self.model, episode_id=self.episode_id, _tools=self._tools,
                     _engine_wait=self._engine_wait)

    async def aclose(self) -> None:
        """Close `client` if it was created (the runner does this after `execute` returns)."""
        if self._client is not None:
            await self._client.close()


class Workflow(abc.ABC):
    """Base class of a user's agent workflow. One instance serves many episodes concurrently.

    Subclasses implement `execute`; it must use `tuner.client` (or `tuner.base_url`/`tuner.api_key`
    with any OpenAI-compatible client) for every model call that should be trained on.
    """

    @abc.abstractmethod
    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        """Run one episode of the agent on `task`.

        Returns:
            WorkflowOutput; its `reward` may be None when a judge is configured.

        Raises:
            Anything: an exception marks the episode failed (recorded with its traceback, not trained on).
        """


class FunctionWorkflow(Workflow):
    """A `Workflow` whose episode is an `async def fn(task, tuner) -> WorkflowOutput` (a config's `workflow:
    file.py:fn`, or the function given to `ajet.Job`); `__name__`/`__qualname__` name the function.

    Raises:
        TypeError: `fn` is not an `async def` function (a plain function cannot run beside the other episodes).
    """

    def __init__(self, fn: Any) -> None:
        import inspect

        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{getattr(fn, '__qualname__', fn)!s} is not an `async def` function: an episode function "
                            f"is `async def fn(task, tuner) -> WorkflowOutput` (or write a Workflow subclass)")
        self.fn = fn

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        """`await fn(task, tuner)`.

        Raises:
            TypeError: the function returned something else than a `WorkflowOutput` (the episode fails).
        """
        output = await self.fn(task, tuner)
        if not isinstance(output, WorkflowOutput):
            raise TypeError(f"{self.fn.__qualname__} must return WorkflowOutput, got {type(output).__name__}")
        return output

    def __repr__(self) -> str:
        return f"FunctionWorkflow({self.fn.__module__}:{self.fn.__qualname__})"

