"""The in-process rollout source: one workflow execution per (task, repeat), each behind its own proxy
endpoint, all in this process (`ajet --conf`).

A workflow that raises, hangs past the timeout or yields a non-finite reward is recorded with the
reason (traceback text) and left out of training; the other episodes go on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from ajet.config import CommandWorkflowConfig
from ajet.episode import Episode
from ajet.errors import ConfigError
from ajet.importing import load_object
from ajet.judges import load_judge
from ajet.proxy.server import ProxyServer
from ajet.rollout import RolloutContext
from ajet.rollout.command import CommandWorkflow
from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

if TYPE_CHECKING:
    from ajet.tools.mcp_hub import McpHub

Judge = Callable[[Task, WorkflowOutput], float]


async def execute_workflow(workflow: Workflow, task: Task, tuner: Tuner,
                           timeout_s: float) -> tuple[WorkflowOutput | None, str | None]:
    """`workflow.execute(task, tuner)` within `timeout_s` seconds: (its output, None), or (None, the error:
    a traceback, or a TimeoutError line). Never raises for a broken workflow."""
    try:
        output = await asyncio.wait_for(workflow.execute(task, tuner), timeout=timeout_s)
        if not isinstance(output, WorkflowOutput):
            raise TypeError(f"{type(workflow).__name__}.execute must return WorkflowOutput, got {type(output).__name__}")
        return output, None
    except asyncio.TimeoutError:
        return None, f"TimeoutError: the workflow ran longer than episode_timeout_s={timeout_s}"
    except Exception:  # noqa: BLE001 - a broken workflow is recorded and skipped, never a crashed run
        return None, traceback.format_exc()


async def run_episode(workflow: Workflow, episode: Episode, proxy: ProxyServer, judge: Judge | None,
                      timeout_s: float, model_name: str = "ajet-policy", tools: McpHub | None = None) -> Episode:
    """Run `workflow` on `episode.task`, filling in the episode's calls, tool calls, output, reward or error.
    With `tools` (the run's MCP servers), the tuner offers `tuner.tools` / `tuner.call_tool`."""
    episode_tools = await tools.open_episode() if tools is not None else None
    endpoint = proxy.open_episode(episode.episode_id)
    try:
        out = await execute_episode(workflow, episode.task, episode.episode_id, endpoint.base_url, endpoint.api_key,
                                    judge, timeout_s, model_name, episode_tools)
        episode.output, episode.reward, episode.error, episode.duration_s = (
            out["output"], out["reward"], out["error"], out["duration_s"])
    finally:
        episode.calls = proxy.close_episode(endpoint)
        episode.tool_calls = list(episode_tools.records) if episode_tools is not None else []
    return episode


async def execute_episode(workflow: Workflow, task: Task, episode_id: str, base_url: str, api_key: str,
                          judge: Judge | None, timeout_s: float, model_name: str = "ajet-policy",
                          episode_tools=None) -> dict[str, Any]:
    """Run `workflow` on `task` against the proxy endpoint at `base_url` and score it (here, or in a Ray
    worker: ajet/ray_rollout.py).

    Returns:
        {"output": WorkflowOutput | None, "reward": float | None, "error": traceback text | None,
        "duration_s": wall-clock seconds}; never raises for a broken workflow or judge (the error is recorded).
    """
    tuner = Tuner(base_url=base_url, api_key=api_key, model=model_name, episode_id=episode_id, _tools=episode_tools)
    reward, t0 = None, time.perf_counter()
    try:
        output, error = await execute_workflow(workflow, task, tuner, timeout_s)
        if error is None:
            try:
                reward = await _score(task, output, judge)
            except Exception:  # noqa: BLE001 - a broken judge or reward fails the episode only
                error = traceback.format_exc()
    finally:
        duration_s = time.perf_counter() - t0
        await tuner.aclose()
    return {"output": output, "reward": reward, "error": error, "duration_s": duration_s}


def new_episodes(tasks: list[Task], num_repeat: int, step: int, attempt: int = 0) -> list[Episode]:
    """`[len(tasks) * num_repeat]` fresh episodes, grouped by task; group_id is "<step>:<task_id>"; episode ids
    "a<attempt>-s<step>-t<task index>-r<repeat>" are unique across the attempts of a resumed run."""
    return [Episode(episode_id=f"a{attempt}-s{step}-t{ti}-r{r}", task=task, group_id=f"{step}:{task.task_id}",
                    repeat_index=r, attempt=attempt)
            for ti, task in enumerate(tasks) for r in range(num_repeat)]


async def _score(task: Task, output: WorkflowOutput, judge: Judge | None) -> float:
    """The episode's reward: the workflow's, else the judge's. Raises ValueError when there is none or it
    is not finite."""
    reward = output.reward
    if reward is None:
        if judge is None:
            raise ValueError("the workflow returned reward=None and the config names no `judge`")
        reward = judge(task, output)
        if inspect.isawaitable(reward):
            reward = await reward
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite: {reward}")
    return reward


async def rollout(workflow: Workflow, tasks: list[Task], num_repeat: int, proxy: ProxyServer,
                  judge: Judge | None, step: int, max_concurrency: int, timeout_s: float,
                  on_episode_done: Callable[[Episode], None] | None = None, attempt: int = 0,
                  tools: McpHub | None = None) -> list[Episode]:
    """Run `num_repeat` episodes of every task (at most `max_concurrency` at once).

    `on_episode_done` is called with each finished episode (e.g. to store it and advance a progress bar);
    `tools` are the run's MCP servers (see `run_episode`).

    Returns:
        `[len(tasks) * num_repeat]` episodes as `new_episodes` names and groups them.
    """
    sem = asyncio.Semaphore(max_concurrency)
    episodes = new_episodes(tasks, num_repeat, step, attempt)

    async def _one(ep: Episode) -> Episode:
        async with sem:
            await run_episode(workflow, ep, proxy, judge, timeout_s, tools=tools)
        if on_episode_done is not None:
            on_episode_done(ep)
        return ep

    return list(await asyncio.gather(*(_one(ep) for ep in episodes)))


def load_workflow(cfg) -> Workflow:
    """The config's workflow: an instance of its `Workflow` class, or a `CommandWorkflow`.

    Raises:
        ConfigError: no `workflow` in the config, or it cannot be loaded.
    """
    if cfg.workflow is None:
        raise ConfigError("the config names no `workflow` (a `file.py:Class`, a `module:Class`, or "
                          "`{command: [...]}`); only `ajet serve` runs without one")
    if isinstance(cfg.workflow, CommandWorkflowConfig):
        return CommandWorkflow(cfg.workflow, cfg.config_dir)
    workflow_cls = load_object(cfg.workflow, cfg.config_dir)   # a built-in workflow may read its config section
    return workflow_cls.from_config(cfg) if hasattr(workflow_cls, "from_config") else workflow_cls()


class InProcessRollout:
    """The rollout source of `ajet --conf`: runs the workflow on `tasks_per_step` tasks x `num_repeat` per step,
    in this process (the tasks in `MultiTaskSampler` order, so a resumed run sees the same data)."""

    def __init__(self, ctx: RolloutContext, workflow: Workflow, judge: Judge | None):
        self.ctx, self.workflow, self.judge = ctx, workflow, judge
        self.sampler = ctx.sampler()
        self.proxy: ProxyServer | None = None
        self.run_episodes: Callable[..., Any] = rollout   # or, with --with-ray, a pool of Ray actors
        r = ctx.cfg.rollout
        if r.ray_workers:
            from ajet.ray_rollout import RayRollout

            self.run_episodes = RayRollout(r.ray_workers, r.ray_address)

    @classmethod
    def from_context(cls, ctx: RolloutContext) -> InProcessRollout:
        """Load the config's workflow (a class, or a command) and judge.

        Raises:
            ConfigError: the workflow or judge cannot be loaded.
        """
        cfg = ctx.cfg
        judge = load_judge(cfg)
        return cls(ctx, load_workflow(cfg), judge)

    def bind(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    def collect(self, step: int) -> list[Episode]:
        r = self.ctx.cfg.rollout
        tasks = self.sampler.next_batch(self.ctx.cfg.trainer.tasks_per_step)
        return asyncio.run(self.run_episodes(self.workflow, tasks, r.num_repeat, self.proxy, self.judge, step, r.max_concurrency,
                                   r.episode_timeout_s, on_episode_done=lambda ep: self.ctx.record(step, ep),
                                   attempt=self.ctx.attempt, tools=self.ctx.tools))

    def step_done(self, step: int) -> None:
        pass

    def state_dict(self, step: int) -> dict[str, Any]:
        return {"sampler": self.sampler.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.set_state(state["sampler"])

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if hasattr(self.run_episodes, "close"):
            self.run_episodes.close()
