"""`--with-ray`: episodes run on a pool of Ray actors, each running its workflows concurrently.

The proxy stays in the trainer process: for every episode it opens an endpoint (a base URL and a per-episode
key), a Ray actor runs the user's workflow against that URL with an OpenAI client, and the trainer closes the
endpoint and collects the recorded calls. Calls, samples and rewards are therefore exactly those of the
in-process rollout (`ajet.rollout.episodes.rollout`, same call signature); only where the workflow code runs changes.

A worker that dies mid-step (killed, out of memory, node lost) fails only the episodes it was running: each
is recorded with the Ray error as its `error` (and the calls it made before dying); Ray restarts the actor
for the next step. Locally `ray.init()` starts a private Ray; on a cluster, `ray start --head` on the first
node, `ray start --address=HEAD:6379` on the others and `rollout.ray_address: auto` (docs/backbones.md).
With several nodes the proxy must listen where the workers can reach it (`proxy.host: 0.0.0.0`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Callable

from ajet.episode import Episode
from ajet.errors import ConfigError
from ajet.proxy.server import ProxyServer
from ajet.rollout.episodes import Judge, execute_episode, new_episodes, seed_key
from ajet.task import Task
from ajet.workflow import Workflow


_RESTART_WAIT_S = 0.5   # between two sends of an episode a restarting actor refused (for up to its timeout_s)


class _EpisodeWorker:
    """A Ray actor (async: up to `max_concurrency` workflows at once on its event loop)."""

    async def run(self, workflow: Workflow, judge: Judge | None, task: Task, episode_id: str, base_url: str,
                  api_key: str, timeout_s: float, model_name: str) -> dict[str, Any]:
        """Run one episode against the proxy at `base_url`; returns output, reward, error, duration_s."""
        return await execute_episode(workflow, task, episode_id, base_url, api_key, judge, timeout_s, model_name)


class RayRollout:
    """A pool of `num_workers` Ray actors that `rollout(...)` episodes, as `ajet.rollout.rollout` does.

    Args:
        num_workers: actors in the pool (each a separate process; one CPU each).
        address: None starts a local Ray (`ray.init()`); "auto" or "HOST:PORT" joins an existing cluster.
        episodes_per_worker: workflows one actor runs at once.

    Raises:
        ImportError: with the install hint, when `ray` is not installed.
    """

    def __init__(self, num_workers: int, address: str | None = None, episodes_per_worker: int = 64):
        try:
            import ray
        except ImportError as exc:
            raise ImportError("--with-ray needs the `ray` package: pip install 'ajet[ray]'") from exc
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
        actor = ray.remote(num_cpus=0)(_EpisodeWorker)
        # max_restarts: a killed actor comes back for the next episodes; max_task_retries=0: its running
        # episodes are not replayed (a replay would call the policy twice into the same episode)
        self.workers = [actor.options(max_concurrency=episodes_per_worker, max_restarts=-1,
                                      max_task_retries=0).remote() for _ in range(num_workers)]

    async def __call__(self, workflow: Workflow, tasks: list[Task], num_repeat: int, proxy: ProxyServer,
                       judge: Judge | None, step: int, max_concurrency: int, timeout_s: float,
                       on_episode_done: Callable[[Episode], None] | None = None, attempt: int = 0,
                       tools=None, first_task_index: int = 0, groups: list[str] | None = None,
                       semaphore: asyncio.Semaphore | None = None) -> list[Episode]:
        """`ajet.rollout.episodes.rollout` on the pool: episode i runs on worker i mod num_workers (`semaphore`,
        when given, replaces the `max_concurrency` bound, as there).

        Returns:
            `[len(tasks) * num_repeat]` episodes, as `ajet.rollout.episodes.new_episodes` names and groups them.

        Raises:
            ConfigError: `tools` (MCP servers) given: their sessions live in the trainer process.
        """
        if tools is not None:
            raise ConfigError("tools.mcp_servers cannot be used with --with-ray yet (the MCP sessions live in the "
                              "trainer process): drop one of the two")
        _pickle_user_code_by_value(workflow, judge)
        sem = semaphore or asyncio.Semaphore(max_concurrency)
        wf_ref, judge_ref = self._ray.put(workflow), self._ray.put(judge)
        episodes = new_episodes(tasks, num_repeat, step, attempt, first_task_index, groups)

        async def _one(i: int, ep: Episode) -> Episode:
            async with sem:
                t0 = time.perf_counter()
                while True:
                    endpoint = proxy.open_episode(ep.episode_id, seed_key(ep))
                    try:
                        out = await self.workers[i % len(self.workers)].run.remote(
                            wf_ref, judge_ref, ep.task, ep.episode_id, endpoint.base_url, endpoint.api_key, timeout_s,
                            "ajet-policy")
                        ep.output, ep.reward, ep.error = out["output"], out["reward"], out["error"]
                        ep.duration_s = out["duration_s"]
                    except Exception as exc:  # noqa: BLE001 - a lost worker fails its own episodes only
                        ep.error = f"{type(exc).__name__}: the Ray worker running this episode failed: {exc}"
                        ep.duration_s = time.perf_counter() - t0
                    finally:
                        ep.calls = proxy.close_episode(endpoint)
                    # an actor that is still restarting (after a kill in an earlier step) refuses the episode;
                    # when the policy saw no call, nothing was trained-visible yet: wait and send it again, for
                    # as long as the episode's own timeout (a restart takes seconds idle, far longer under load)
                    restarting = ep.error is not None and ep.error.startswith("ActorUnavailableError")
                    if not (restarting and not ep.calls) or time.perf_counter() - t0 >= timeout_s:
                        break
                    await asyncio.sleep(_RESTART_WAIT_S)
            if on_episode_done is not None:
                on_episode_done(ep)
            return ep

        return list(await asyncio.gather(*(_one(i, ep) for i, ep in enumerate(episodes))))

    def close(self) -> None:
        """Stop the actors (and the local Ray this pool started)."""
        for w in self.workers:
            self._ray.kill(w)
        self.workers = []
        if self._started_ray:
            self._ray.shutdown()


def _pickle_user_code_by_value(*objects: Any) -> None:
    """Workflows and judges loaded from a file (`path/to/wf.py:Class`) live in a module the Ray workers cannot
    import: ship their code by value (cloudpickle), as Ray does for functions defined in a script."""
    from ray import cloudpickle

    for obj in objects:
        for mod_name in {type(obj).__module__, getattr(obj, "__module__", None)}:
            if mod_name and mod_name.startswith("ajet_user_") and mod_name in sys.modules:
                cloudpickle.register_pickle_by_value(sys.modules[mod_name])
