"""Running episodes: one workflow execution per (task, repeat), each behind its own proxy endpoint.

A workflow that raises, hangs past the timeout or yields a non-finite reward is recorded with the
reason (traceback text) and left out of training; the other episodes go on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
from typing import TYPE_CHECKING, Callable

from ajet.episode import Episode
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

if TYPE_CHECKING:
    from ajet.tools.mcp_hub import McpHub

Judge = Callable[[Task, WorkflowOutput], float]


async def run_episode(workflow: Workflow, episode: Episode, proxy: ProxyServer, judge: Judge | None,
                      timeout_s: float, model_name: str = "ajet-policy", tools: McpHub | None = None) -> Episode:
    """Run `workflow` on `episode.task`, filling in the episode's calls, tool calls, output, reward or error.
    With `tools` (the run's MCP servers), the tuner offers `tuner.tools` / `tuner.call_tool`."""
    episode_tools = await tools.open_episode() if tools is not None else None
    endpoint = proxy.open_episode(episode.episode_id)
    tuner = Tuner(base_url=endpoint.base_url, api_key=endpoint.api_key, model=model_name,
                  episode_id=episode.episode_id, _tools=episode_tools)
    t0 = time.perf_counter()
    try:
        output = await asyncio.wait_for(workflow.execute(episode.task, tuner), timeout=timeout_s)
        if not isinstance(output, WorkflowOutput):
            raise TypeError(f"{type(workflow).__name__}.execute must return WorkflowOutput, got {type(output).__name__}")
        episode.output = output
        reward = output.reward
        if reward is None:
            if judge is None:
                raise ValueError("the workflow returned reward=None and the config names no `judge`")
            reward = judge(episode.task, output)
            if inspect.isawaitable(reward):
                reward = await reward
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward is not finite: {reward}")
        episode.reward = reward
    except asyncio.TimeoutError:
        episode.error = f"TimeoutError: the workflow ran longer than episode_timeout_s={timeout_s}"
    except Exception:  # noqa: BLE001 - a broken workflow is recorded and skipped, never a crashed run
        episode.error = traceback.format_exc()
    finally:
        episode.duration_s = time.perf_counter() - t0
        episode.calls = proxy.close_episode(endpoint)
        episode.tool_calls = list(episode_tools.records) if episode_tools is not None else []
        await tuner.aclose()
    return episode


async def rollout(workflow: Workflow, tasks: list[Task], num_repeat: int, proxy: ProxyServer,
                  judge: Judge | None, step: int, max_concurrency: int, timeout_s: float,
                  on_episode_done: Callable[[Episode], None] | None = None, attempt: int = 0,
                  tools: McpHub | None = None) -> list[Episode]:
    """Run `num_repeat` episodes of every task (at most `max_concurrency` at once).

    `on_episode_done` is called with each finished episode (e.g. to store it and advance a progress bar);
    `tools` are the run's MCP servers (see `run_episode`).

    Returns:
        `[len(tasks) * num_repeat]` episodes, grouped by task; group_id is "<step>:<task_id>"; episode ids
        "a<attempt>-s<step>-t<task index>-r<repeat>" are unique across the attempts of a resumed run.
    """
    sem = asyncio.Semaphore(max_concurrency)
    episodes = [Episode(episode_id=f"a{attempt}-s{step}-t{ti}-r{r}", task=task, group_id=f"{step}:{task.task_id}", repeat_index=r)
                for ti, task in enumerate(tasks) for r in range(num_repeat)]

    async def _one(ep: Episode) -> Episode:
        async with sem:
            await run_episode(workflow, ep, proxy, judge, timeout_s, tools=tools)
        if on_episode_done is not None:
            on_episode_done(ep)
        return ep

    return list(await asyncio.gather(*(_one(ep) for ep in episodes)))
