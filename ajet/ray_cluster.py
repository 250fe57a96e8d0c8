"""Whether a Ray cluster can hold what a run asks of it, checked before anything waits on it.

Ray never refuses a request it cannot meet: `ray.init(address=...)` retries an address nothing answers at for
minutes, and a placement group that no node can hold stays pending forever (verl's `RayResourcePool` waits on
its groups with a plain `ray.get`). Used by the `--with-ray` episode pool (`ajet.rollout.ray`) and the verl
backbone (`trainer.nnodes` x `trainer.n_gpus_per_node`), each check turns such a wait into one `ConfigError`
naming what the cluster has and what to change. `start_ray` is how ajet starts Ray: `ray.init`, then the running
command's stop handlers back in place. `torch_threads_env` is how many torch threads a CPU rank on Ray trains with.

Reference: Ray's placement groups, https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ajet import interrupt
from ajet.errors import ConfigError

CONNECT_TIMEOUT_S = 5.0   # how long `check_reachable` waits for the head node's port, seconds


def start_ray(ray: Any, **init_kwargs: Any) -> None:
    """`ray.init(**init_kwargs)`, then the running command's SIGINT/SIGTERM handlers put back: `ray.init` sets the
    driver's SIGTERM handler to `sys.exit(signum)`, under which SIGTERM skipped ajet's clean stop and the process
    ended in Ray's crash dump (exit 134; `ajet.interrupt.reinstall`). Every ajet start of Ray goes through here.

    Raises:
        whatever `ray.init` raises (the handlers are then left as they were).
    """
    ray.init(**init_kwargs)
    interrupt.reinstall()


def torch_threads_env(ranks_per_node: int) -> dict[str, str]:
    """`{"OMP_NUM_THREADS": N}` for the Ray workers that train on CPU (verl's and Trinity's FSDP ranks): N is the value
    this process's environment sets, else this machine's cores shared by the `ranks_per_node` ranks a node holds
    (at least 1), as torch takes one thread per core in a process of its own (`ajet --help`).

    Ray sets OMP_NUM_THREADS to a worker's CPU share when its environment lacks the variable: 1 for verl's ranks,
    which hold a share of 1, so without this a CPU rank trained on one thread whatever the machine's cores (Ray:
    `set_omp_num_threads_if_unset`). Raises ValueError when `ranks_per_node` < 1."""
    if ranks_per_node < 1:
        raise ValueError(f"torch_threads_env: ranks_per_node must be >= 1, got {ranks_per_node}")
    given = os.environ.get("OMP_NUM_THREADS")
    return {"OMP_NUM_THREADS": given if given else str(max(1, (os.cpu_count() or 1) // ranks_per_node))}


def init_address(address: str | None) -> str | None:
    """The `address` to give `ray.init` for a run whose config says `address` (`rollout.ray_address`): that address
    when one is set; None when the environment names a cluster (`RAY_ADDRESS`, which Ray reads itself); else "local", a
    private Ray for this run. Without "local", `ray.init()` joins any cluster another program started on this
    machine (Ray's `ray_current_cluster` file), where the run's own sizing (`num_cpus`) is refused."""
    if address is not None:
        return address
    return None if os.environ.get("RAY_ADDRESS", "local") != "local" else "local"


def check_reachable(address: str | None) -> None:
    """Refuse a `HOST:PORT` (or `ray://HOST:PORT`) nothing accepts a connection at within `CONNECT_TIMEOUT_S`;
    None and `auto` (Ray finds the cluster itself) pass.

    Raises:
        ConfigError: not HOST:PORT, or no connection.
    """
    if address in (None, "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"rollout.ray_address={address!r}: give HOST:PORT of the cluster's head node (what "
                          f"`ray start --head` printed, e.g. 10.0.0.1:6379) or `auto`")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(f"rollout.ray_address={address}: no Ray head answers there ({exc.strerror or exc}): start "
                          f"it with `ray start --head --port {port}` on {host}, or correct the address") from None


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    """The cluster's alive nodes, as `ray.nodes()` gives them (each with its total `Resources`)."""
    return [n for n in ray.nodes() if n.get("Alive")]


def check_groups(ray: Any, groups: int, per_group: int, resource: str, what: str, fix: str) -> None:
    """Refuse `groups` placement groups of `per_group` units of `resource` (each group on one node, as verl's
    STRICT_PACK / PACK groups of one node's ranks) when the alive nodes cannot hold them all beside the placement
    groups already created on the cluster (e.g. `--with-ray`'s episode workers, one CPU on each of their nodes).

    Args:
        ray: the `ray` module, initialized.
        groups: how many groups (e.g. verl's trainer.nnodes).
        per_group: units of `resource` in each (e.g. trainer.n_gpus_per_node ranks x 1).
        resource: "CPU" or "GPU".
        what: the request in the config's words, first in the message.
        fix: what to change, last in the message.

    Raises:
        ConfigError: "WHAT: the Ray cluster has N node(s) with R RESOURCE(s) [(H held by placement groups)], room
            for ...: FIX".
    """
    nodes = alive_nodes(ray)
    held = held_by_placement_groups(ray, resource)
    totals = [float(n.get("Resources", {}).get(resource, 0.0)) for n in nodes]
    free = [t - held.get(n["NodeID"], 0.0) for n, t in zip(nodes, totals)]
    fits = sum(int(max(f, 0.0) // per_group) for f in free) if per_group > 0 else groups
    if fits < groups:
        order = sorted(range(len(nodes)), key=lambda i: -totals[i])
        have = ", ".join(f"{totals[i]:g}" for i in order) or "none"
        taken = ", ".join(f"{held.get(nodes[i]['NodeID'], 0.0):g}" for i in order)
        held_note = f" ({taken} held by placement groups)" if any(held.values()) else ""
        raise ConfigError(f"{what}: the Ray cluster has {len(nodes)} node(s) with {have} {resource}(s){held_note}, "
                          f"room for {fits} group(s) of {per_group}: {fix}")


def held_by_placement_groups(ray: Any, resource: str) -> dict[str, float]:
    """Units of `resource` that the cluster's created placement groups reserve, per node id (Ray's
    `placement_group_table`): room that a new placement group cannot have."""
    held: dict[str, float] = {}
    for pg in ray.util.placement_group_table().values():
        if pg.get("state") != "CREATED":
            continue
        where = pg.get("bundles_to_node_id") or {}
        for index, bundle in (pg.get("bundles") or {}).items():
            if where.get(index):
                held[where[index]] = held.get(where[index], 0.0) + float(bundle.get(resource, 0.0))
    return held


def check_cpus(ray: Any, needed: int, what: str, fix: str) -> None:
    """Refuse `needed` one-CPU workers when the alive nodes hold fewer CPUs in all.

    Raises:
        ConfigError: "WHAT: the Ray cluster has C CPU(s) on N node(s) ...: FIX".
    """
    nodes = alive_nodes(ray)
    total = sum(float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes)
    if total < needed:
        raise ConfigError(f"{what}: the Ray cluster has {total:g} CPU(s) on {len(nodes)} node(s) and each takes 1: "
                          f"{fix}")
