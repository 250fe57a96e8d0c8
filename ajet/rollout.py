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
from typing import Callable

from ajet.episode import Episode
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

Judge = Callable[[Task, WorkflowOutput], float]


async def run_episode(workflow: Workflow, episode: Episode, proxy: ProxyServer, judge: Judge | None,
                      timeout_s: float, model_name: str = "ajet-policy") -> Episode:
    """Run `workflow` on `episode.task`, filling in the episode's calls, output, reward or error."""
    endpoint = proxy.open_episode(episode.episode_id)
    try:
        out = await execute_workflow(workflow, episode.task, episode.episode_id, endpoint.base_url, endpoint.api_key,
                                     judge, timeout_s, model_name)
        episode.output, episode.reward, episode.error, episode.duration_s = (
            out["output"], out["reward"], out["error"], out["duration_s"])
    finally:
        episode.calls = proxy.close_episode(endpoint)
    return episode


async def execute_workflow(workflow: Workflow, task: Task, episode_id: str, base_url: str, api_key: str,
                           judge: Judge | None, timeout_s: float, model_name: str = "ajet-policy") -> dict:
    """Run `workflow` on `task` against the proxy endpoint at `base_url` (here or in a Ray worker).

    Returns:
        {"output": WorkflowOutput | None, "reward": float | None, "error": traceback text | None,
        "duration_s": wall-clock seconds}; never raises for a broken workflow (the error is recorded).
    """
    tuner = Tuner(base_url=base_url, api_key=api_key, model=model_name, episode_id=episode_id)
    result: dict = {"output": None, "reward": None, "error": None}
    t0 = time.perf_counter()
    try:
        output = await asyncio.wait_for(workflow.execute(task, tuner), timeout=timeout_s)
        if not isinstance(output, WorkflowOutput):
            raise TypeError(f"{type(workflow).__name__}.execute must return WorkflowOutput, got {type(output).__name__}")
        result["output"] = output
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
        result["reward"] = reward
    except asyncio.TimeoutError:
        result["error"] = f"TimeoutError: the workflow ran longer than episode_timeout_s={timeout_s}"
    except Exception:  # noqa: BLE001 - a broken workflow is recorded and skipped, never a crashed run
        result["error"] = traceback.format_exc()
    finally:
        result["duration_s"] = time.perf_counter() - t0
        await tuner.aclose()
    return result


async def rollout(workflow: Workflow, tasks: list[Task], num_repeat: int, proxy: ProxyServer,
                  judge: Judge | None, step: int, max_concurrency: int, timeout_s: float,
                  on_episode_done: Callable[[Episode], None] | None = None, attempt: int = 0) -> list[Episode]:
    """Run `num_repeat` episodes of every task (at most `max_concurrency` at once).

    `on_episode_done` is called with each finished episode (e.g. to store it and advance a progress bar).

    Returns:
        `[len(tasks) * num_repeat]` episodes, grouped by task; group_id is "<step>:<task_id>"; episode ids
        "a<attempt>-s<step>-t<task index>-r<repeat>" are unique across the attempts of a resumed run.
    """
    sem = asyncio.Semaphore(max_concurrency)
    episodes = new_episodes(tasks, num_repeat, step, attempt)

    async def _one(ep: Episode) -> Episode:
        async with sem:
            await run_episode(workflow, ep, proxy, judge, timeout_s)
        if on_episode_done is not None:
            on_episode_done(ep)
        return ep

    return list(await asyncio.gather(*(_one(ep) for ep in episodes)))


def new_episodes(tasks: list[Task], num_repeat: int, step: int, attempt: int = 0) -> list[Episode]:
    """`[len(tasks) * num_repeat]` empty episodes grouped by task: group_id "<step>:<task_id>", episode id
    "a<attempt>-s<step>-t<task index>-r<repeat>"."""
    return [Episode(episode_id=f"a{attempt}-s{step}-t{ti}-r{r}", task=task, group_id=f"{step}:{task.task_id}",
                    repeat_index=r) for ti, task in enumerate(tasks) for r in range(num_repeat)]
