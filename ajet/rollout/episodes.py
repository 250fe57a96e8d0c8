"""Running episodes: one workflow execution per episode against its own proxy endpoint, scored by the
workflow's reward or the judge. Shared by the in-process source (`in_process.py`, this process) and the
Ray source (`ray.py`, a pool of actors), so both record exactly the same episodes.

A workflow that raises, hangs past the timeout or yields a non-finite reward is recorded with the
reason (traceback text) and left out of training; the other episodes go on. So is an episode whose judge cannot
score it (raises, or returns a value that is not a finite number): a failure naming the judge, never a reward of 0. The timeout
(`rollout.episode_timeout_s`) does not count the time the episode's calls waited in the engine's queue
(`ajet.rollout.deadline`).
"""

from __future__ import annotations

import asyncio
import math
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from ajet.episode import Episode
from ajet.judges.calling import JudgeError, call_judge
from ajet.proxy.server import ProxyServer
from ajet.rollout.deadline import EpisodeTimeout, run_within
from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

if TYPE_CHECKING:
    from ajet.engines.base import EngineWait
    from ajet.tools.mcp_hub import McpHub

Judge = Callable[[Task, WorkflowOutput], float]


async def execute_workflow(workflow: Workflow, task: Task, tuner: Tuner,
                           timeout_s: float) -> tuple[WorkflowOutput | None, str | None]:
    """`workflow.execute(task, tuner)` within `timeout_s` seconds, not counting the time its calls waited in the
    engine's queue (`tuner.engine_wait`; `ajet.rollout.deadline.run_within`): (its output, None), or (None, the
    error: a traceback, or a TimeoutError line). Never raises for a broken workflow."""
    try:
        output = await run_within(workflow.execute(task, tuner), timeout_s, tuner.engine_wait)
        if not isinstance(output, WorkflowOutput):
            raise TypeError(f"{type(workflow).__name__}.execute must return WorkflowOutput, got {type(output).__name__}")
        return output, None
    except EpisodeTimeout as exc:
        return None, (f"TimeoutError: the workflow ran longer than episode_timeout_s={timeout_s} (not counting "
                      f"{exc.queued_s:.1f} s its calls waited in the engine's queue)")
    except Exception:  # noqa: BLE001 - a broken workflow is recorded and skipped, never a crashed run
        return None, traceback.format_exc()


async def run_episode(workflow: Workflow, episode: Episode, proxy: ProxyServer, judge: Judge | None,
                      timeout_s: float, model_name: str = "ajet-policy", tools: McpHub | None = None) -> Episode:
    """Run `workflow` on `episode.task`, filling in the episode's calls, tool calls, output, reward or error.
    With `tools` (the run's MCP servers), the tuner offers `tuner.tools` / `tuner.call_tool`."""
    episode_tools = await tools.open_episode() if tools is not None else None
    endpoint = proxy.open_episode(episode.episode_id, seed_key(episode))
    try:
        out = await execute_episode(workflow, episode.task, episode.episode_id, endpoint.base_url, endpoint.api_key,
                                    judge, timeout_s, model_name, episode_tools, endpoint.engine_wait)
        episode.output, episode.reward, episode.error, episode.duration_s = (
            out["output"], out["reward"], out["error"], out["duration_s"])
    finally:
        episode.calls = proxy.close_episode(endpoint)
        episode.tool_calls = list(episode_tools.records) if episode_tools is not None else []
    return episode


async def execute_episode(workflow: Workflow, task: Task, episode_id: str, base_url: str, api_key: str,
                          judge: Judge | None, timeout_s: float, model_name: str = "ajet-policy",
                          episode_tools=None, engine_wait: EngineWait | None = None) -> dict[str, Any]:
    """Run `workflow` on `task` against the proxy endpoint at `base_url` and score it (here, or in a Ray
    worker: ajet/rollout/ray.py). `engine_wait`: the episode's queue time (`EpisodeEndpoint.engine_wait`), not
    counted by the timeout; None (a Ray worker, which cannot see it) times the workflow by the wall clock.

    Returns:
        {"output": WorkflowOutput | None, "reward": float | None, "error": traceback text | None,
        "duration_s": wall-clock seconds}; never raises for a broken workflow or judge (the error is recorded).
    """
    tuner = Tuner(base_url=base_url, api_key=api_key, model=model_name, episode_id=episode_id, _tools=episode_tools,
                  _engine_wait=engine_wait)
    reward, t0 = None, time.perf_counter()
    try:
        output, error = await execute_workflow(workflow, task, tuner, timeout_s)
        if error is None:
            try:
                reward = await _score(task, output, judge)
            except JudgeError as exc:   # its error text: what the judge raised, then the line naming the judge
                error = exc.error_text()
            except Exception:  # noqa: BLE001 - a broken judge or reward fails the episode only
                error = traceback.format_exc()
    finally:
        duration_s = time.perf_counter() - t0
        await tuner.aclose()
    return {"output": output, "reward": reward, "error": error, "duration_s": duration_s}


def group_ids(step: int, task_ids: list[str]) -> list[str]:
    """The GRPO group id of each of a step's draws, `task_ids` in draw order (the step's tasks, then its
    extra tasks under dynamic sampling): "<step>:<task_id>", and for a task drawn again in the same step (a small
    dataset wraps into its next epoch) "<step>:<task_id>#<k>", k its draw's index in the step. Each draw is its
    own group, with its own sampling seeds (`seed_key`), and a resumed step that gets the same draws gets the
    same ids.

    Returns:
        `[len(task_ids)]` distinct ids.
    """
    out: list[str] = []
    taken: set[str] = set()
    for k, task_id in enumerate(task_ids):
        gid = f"{step}:{task_id}"
        while gid in taken:   # (a task id that itself ends in "#<k>" takes one more suffix)
            gid += f"#{k}"
        taken.add(gid)
        out.append(gid)
    return out


def new_episodes(tasks: list[Task], num_repeat: int, step: int, attempt: int = 0,
                 first_task_index: int = 0, groups: list[str] | None = None) -> list[Episode]:
    """`[len(tasks) * num_repeat]` fresh episodes, grouped by task; group ids `groups` (one per task; default
    `group_ids` of `tasks`); episode ids "a<attempt>-s<step>-t<task index>-r<repeat>" are unique across the
    attempts of a resumed run (task indices count from `first_task_index`: a step's extra tasks under dynamic
    sampling continue its numbering).

    Raises:
        ValueError: `groups` is not one id per task.
    """
    groups = group_ids(step, [t.task_id for t in tasks]) if groups is None else groups
    if len(groups) != len(tasks):
        raise ValueError(f"{len(groups)} group ids for {len(tasks)} tasks")
    return [Episode(episode_id=f"a{attempt}-s{step}-t{ti}-r{r}", task=task, group_id=gid,
                    repeat_index=r, attempt=attempt)
            for ti, (task, gid) in enumerate(zip(tasks, groups), start=first_task_index) for r in range(num_repeat)]


def seed_key(episode: Episode) -> str:
    """The episode's name in its calls' sampler seeds: its group and repeat, not its attempt, so that a
    resumed step samples as the interrupted attempt did (`ajet.llm_call.call_seed`)."""
    return f"{episode.group_id}/r{episode.repeat_index}"


async def _score(task: Task, output: WorkflowOutput, judge: Judge | None) -> float:
    """The episode's reward: the workflow's, else the judge's (`ajet.judges.call_judge`).

    Raises:
        ValueError: the workflow's reward is missing without a judge, or not finite.
        JudgeError: the judge raised, or returned something that is not a finite number (naming the judge).
    """
    reward = output.reward
    if reward is None:
        if judge is None:
            raise ValueError("the workflow returned reward=None and the config names no `judge`")
        return await call_judge(judge, task, output)
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite: {reward}")
    return reward


async def rollout(workflow: Workflow, tasks: list[Task], num_repeat: int, proxy: ProxyServer,
                  judge: Judge | None, step: int, max_concurrency: int, timeout_s: float,
                  on_episode_done: Callable[[Episode], None] | None = None, attempt: int = 0,
                  tools: McpHub | None = None, first_task_index: int = 0,
                  semaphore: asyncio.Semaphore | None = None, groups: list[str] | None = None) -> list[Episode]:
    """Run `num_repeat` episodes of every task (at most `max_concurrency` at once).

    `on_episode_done` is called with each finished episode (e.g. to store it and advance a progress bar);
    `tools` are the run's MCP servers (see `run_episode`); `first_task_index` and `groups` as `new_episodes`; `semaphore`,
    when given, replaces the `max_concurrency` bound (asynchronous training shares one across the steps in flight).

    Returns:
        `[len(tasks) * num_repeat]` episodes as `new_episodes` names and groups them.
    """
    sem = semaphore or asyncio.Semaphore(max_concurrency)
    episodes = new_episodes(tasks, num_repeat, step, attempt, first_task_index, groups)

    async def _one(ep: Episode) -> Episode:
        async with sem:
            await run_episode(workflow, ep, proxy, judge, timeout_s, tools=tools)
        if on_episode_done is not None:
            on_episode_done(ep)
        return ep

    return list(await asyncio.gather(*(_one(ep) for ep in episodes)))
