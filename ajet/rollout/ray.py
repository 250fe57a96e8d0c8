"""`--with-ray`: episodes run on a pool of Ray actors, each running its workflows concurrently.

The proxy stays in the trainer process: for every episode it opens an endpoint (a base URL and a per-episode
key), a Ray actor runs the user's workflow against that URL with an OpenAI client, and the trainer closes the
endpoint and collects the recorded calls. Calls, samples and rewards are therefore exactly those of the
in-process rollout (`ajet.rollout.episodes.rollout`, same call signature); only where the workflow code runs changes.

A worker that dies mid-step (killed, out of memory, node lost) fails only the episodes it was running: each
is recorded with the Ray error as its `error` (and the calls it made before dying); Ray restarts the actor
for the next step. Locally `ray.init()` starts a private Ray sized to hold the pool; on a cluster, `ray start
--head` on the first node, `ray start --address=HEAD:6379` on the others and `--ray-address HEAD:6379` (or
`rollout.ray_address`, `auto` for the cluster of this node; docs/scale-out.md). With several machines the proxy
must listen where the workers can reach it (`proxy.host: 0.0.0.0`): a worker then gets the proxy's URL with this
node's IP (as Ray knows it) in place of 0.0.0.0, and a proxy on 127.0.0.1 with a worker on another machine is a
`ConfigError` before the first episode (`worker_url`).

Placement: each worker takes 1 CPU, reserved by one placement group of `num_workers` one-CPU bundles with the
SPREAD strategy (Ray puts the bundles on as many nodes as it can), worker i in bundle i. Before reserving, the
cluster's CPUs are counted: a pool that cannot fit is a `ConfigError` at once, and one that does not become ready
in `placement_timeout_s` (other jobs hold the CPUs) is one too, never an endless wait. Where each worker runs
(node id, IP, pid) is printed in one line when the pool starts, and `metrics()` gives the number of nodes the
last step's episodes ran on (`rollout/ray_nodes`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

from ajet.episode import Episode
from ajet.errors import ConfigError
from ajet.proxy.server import ProxyServer
from ajet.ray_cluster import check_cpus, check_reachable, init_address, start_ray
from ajet.rollout.episodes import Judge, execute_episode, new_episodes, seed_key
from ajet.task import Task
from ajet.workflow import Workflow


_RESTART_WAIT_S = 0.5   # between two sends of an episode a restarting actor refused (for up to its timeout_s)


class _EpisodeWorker:
    """A Ray actor (async: up to `max_concurrency` workflows at once on its event loop)."""

    async def run(self, workflow: Workflow, judge: Judge | None, task: Task, episode_id: str, base_url: str,
                  api_key: str, timeout_s: float, model_name: str) -> dict[str, Any]:
        """Run one episode against the proxy at `base_url`; returns output, reward, error, duration_s."""
        out = await execute_episode(workflow, task, episode_id, base_url, api_key, judge, timeout_s, model_name)
        import ray

        return {**out, "node_id": ray.get_runtime_context().get_node_id()}

    def where(self) -> dict[str, Any]:
        """Where this actor runs: {"node_id": Ray's hex node id, "ip": the node's IP, "pid": this process}."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}


class RayRollout:
    """A pool of `num_workers` Ray actors that `rollout(...)` episodes, as `ajet.rollout.rollout` does.

    Args:
        num_workers: actors in the pool (each a separate process taking 1 CPU, spread over the cluster's nodes).
        address: None starts a local Ray (`ray.init()`, declaring the machine's CPUs plus one per worker) unless
            one runs in this process already; "auto" or "HOST:PORT" joins an existing cluster.
        episodes_per_worker: workflows one actor runs at once.
        placement_timeout_s: how long to wait for the cluster to free the pool's CPUs, seconds.

    Attributes:
        placement: `[num_workers]` dicts {"node_id", "ip", "pid"}: where each worker started.
        driver_ip: this process's node IP as Ray knows it (what `worker_url` puts in place of 0.0.0.0).

    Raises:
        ImportError: with the install hint, when `ray` is not installed.
        ConfigError: nothing answers at `address`, or the cluster has fewer CPUs than `num_workers` (free ones
            within `placement_timeout_s`); the message says what the cluster has and what to change.
    """

    def __init__(self, num_workers: int, address: str | None = None, episodes_per_worker: int = 64,
                 placement_timeout_s: float = 60.0):
        try:
            import ray
        except ImportError as exc:
            raise ImportError("--with-ray needs the `ray` package: pip install 'ajet[ray]'") from exc
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.workers: list[Any] = []
        self._pg = None
        self._step_nodes: set[str] = set()
        self._started_ray = not ray.is_initialized()
        init_at = init_address(address)
        joins = init_at != "local"
        if self._started_ray:
            check_reachable(address)
            # a local Ray: the machine's CPUs for what else runs on it (verl's ranks join this Ray when it started
            # first), and one more for each worker, whatever the core count (the workers mostly wait on HTTP)
            sized = {} if joins else {"num_cpus": (os.cpu_count() or 1) + num_workers}
            start_ray(ray, address=init_at, include_dashboard=False, log_to_driver=False,
                      runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}}, **sized)
        try:
            fit = int(_cpus(ray))
            more = "add nodes (`ray start --address=HEAD:PORT --num-cpus N` on another machine)"
            check_cpus(ray, num_workers, f"--with-ray {num_workers} (episode workers, on the cluster"
                       f"{_at(address) or ' this run started'})",
                       f"run at most {fit} (--with-ray {fit}) or {more}" if fit else more)
            self._pg = placement_group([{"CPU": 1}] * num_workers, strategy="SPREAD")
            if not self._pg.wait(placement_timeout_s):
                free = ray.available_resources().get("CPU", 0.0)
                remove_placement_group(self._pg)
                self._pg = None
                raise ConfigError(f"--with-ray {num_workers}: the Ray cluster{_at(address)} did not free "
                                  f"{num_workers} CPU(s) for the episode workers in {placement_timeout_s:g} s "
                                  f"({free:g} of {_cpus(ray):g} free; other jobs hold the rest): stop them, add "
                                  f"nodes, or run fewer workers (--with-ray N)")
            actor = ray.remote(num_cpus=1)(_EpisodeWorker)
            # max_restarts: a killed actor comes back for the next episodes (in its own bundle); max_task_retries=0:
            # its running episodes are not replayed (a replay would call the policy twice into the same episode)
            self.workers = [actor.options(
                max_concurrency=episodes_per_worker, max_restarts=-1, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote() for i in range(num_workers)]
            self.placement: list[dict[str, Any]] = ray.get([w.where.remote() for w in self.workers])
            self.driver_ip = ray.util.get_node_ip_address()
        except BaseException:
            self.close()
            raise
        print(placement_line(self.placement), file=sys.stderr, flush=True)

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
        for p in self.placement:      # a proxy the workers cannot reach: refused before any episode starts
            worker_url(proxy.url, self.driver_ip, p["ip"])
        _pickle_user_code_by_value(workflow, judge)
        sem = semaphore or asyncio.Semaphore(max_concurrency)
        wf_ref, judge_ref = self._ray.put(workflow), self._ray.put(judge)
        episodes = new_episodes(tasks, num_repeat, step, attempt, first_task_index, groups)
        nodes: set[str] = set()

        async def _one(i: int, ep: Episode) -> Episode:
            async with sem:
                t0 = time.perf_counter()
                while True:
                    endpoint = proxy.open_episode(ep.episode_id, seed_key(ep))
                    try:
                        w = i % len(self.workers)
                        out = await self.workers[w].run.remote(
                            wf_ref, judge_ref, ep.task, ep.episode_id,
                            worker_url(endpoint.base_url, self.driver_ip, self.placement[w]["ip"]), endpoint.api_key,
                            timeout_s, "ajet-policy")
                        ep.output, ep.reward, ep.error = out["output"], out["reward"], out["error"]
                        ep.duration_s = out["duration_s"]
                        nodes.add(out["node_id"])
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

        try:
            return list(await asyncio.gather(*(_one(i, ep) for i, ep in enumerate(episodes))))
        finally:
            self._step_nodes = nodes

    def metrics(self) -> dict[str, float]:
        """`{"rollout/ray_nodes": the number of distinct nodes the last call's finished episodes ran on}`."""
        return {"rollout/ray_nodes": float(len(self._step_nodes))}

    def close(self) -> None:
        """Stop the actors, release their CPUs (and stop the local Ray this pool started)."""
        for w in self.workers:
            self._ray.kill(w)
        self.workers = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False


def placement_line(placement: list[dict[str, Any]]) -> str:
    """One line naming where each episode worker runs: `ajet: 2 Ray episode workers on 2 node(s): worker 0 node
    1a2b3c4d5e6f (10.0.0.1, pid 123), ...` (node ids shortened to 12 hex digits)."""
    nodes = {p["node_id"] for p in placement}
    where = ", ".join(f"worker {i} node {p['node_id'][:12]} ({p['ip']}, pid {p['pid']})"
                      for i, p in enumerate(placement))
    return f"ajet: {len(placement)} Ray episode workers on {len(nodes)} node(s): {where}"


def worker_url(url: str, driver_ip: str, worker_ip: str) -> str:
    """The proxy URL (`url`, on this trainer's node `driver_ip`) as a worker on node `worker_ip` must call it.

    A proxy listening on all addresses (`proxy.host: 0.0.0.0` or `::`) is reached at `driver_ip`; one on a
    loopback address only from this machine.

    Returns:
        `url`, its host replaced by `driver_ip` when it is 0.0.0.0 / ::.

    Raises:
        ConfigError: the proxy listens on a loopback address (127.0.0.1, localhost, ::1) and `worker_ip` is another
            machine's.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in ("0.0.0.0", "::"):
        ip = f"[{driver_ip}]" if ":" in driver_ip else driver_ip
        return urlunsplit(parts._replace(netloc=f"{ip}:{parts.port}"))
    if host in ("127.0.0.1", "localhost", "::1") and worker_ip != driver_ip:
        raise ConfigError(f"proxy.host={host}: the proxy is private to this machine ({driver_ip}) but a --with-ray "
                          f"episode worker runs on {worker_ip}: set proxy.host=0.0.0.0 (every episode still needs "
                          f"its own key)")
    return url


def _cpus(ray: Any) -> float:
    return float(ray.cluster_resources().get("CPU", 0.0))


def _at(address: str | None) -> str:
    return f" at {address}" if address else ""


def _pickle_user_code_by_value(*objects: Any) -> None:
    """Workflows and judges loaded from a file (`path/to/wf.py:Class`) live in a module the Ray workers cannot
    import: ship their code by value (cloudpickle), as Ray does for functions defined in a script."""
    from ray import cloudpickle

    for obj in objects:
        for mod_name in {type(obj).__module__, getattr(obj, "__module__", None)}:
            if mod_name and mod_name.startswith("ajet_user_") and mod_name in sys.modules:
                cloudpickle.register_pickle_by_value(sys.modules[mod_name])
