"""A real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: two raylets, the head with 2 CPUs, the
second with 1) joined by `ajet --ray-address`: the `--with-ray` episode workers spread over both nodes (the head
alone could hold both: packing them there fails the test), a cluster too small for the asked workers is one line
and exit 2, and an address nothing answers at is one too. verl on two nodes: tests/test_backbone_vllm.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.two_nodes import CLUSTER_ENV, write_run

ray = pytest.importorskip("ray", reason="--with-ray needs `ray` (pip install 'ajet[ray]')")


@pytest.fixture(scope="module")
def two_nodes():
    """Two raylets (`node_a` the head with 2 CPUs, `node_b` the second with 1); yields (address, {node ids},
    the head's IP)."""
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)
    small = {"object_store_memory": 80 * 2**20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, **small})
    try:
        second = cluster.add_node(num_cpus=1, resources={"node_b": 1}, **small)
        cluster.wait_for_nodes()
        yield cluster.address, {cluster.head_node.node_id, second.node_id}, cluster.head_node.node_ip_address
    finally:
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ajet(tmp_path: Path, tiny_model_dir: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    write_run(tmp_path, tiny_model_dir)
    ajet = [shutil.which("ajet")] if shutil.which("ajet") else [sys.executable, "-m", "ajet"]
    return subprocess.run(ajet + ["--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp", *args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path,
                          env={**os.environ, **CLUSTER_ENV})


def test_episode_workers_spread_over_both_nodes_and_the_step_trains(two_nodes, tiny_model_dir, tmp_path):
    address, node_ids, ip = two_nodes
    # as on a real cluster, the proxy listens on every address; the workers get this node's IP in its URL
    proc = _ajet(tmp_path, tiny_model_dir, "--with-ray", "2", "--ray-address", address, "--steps", "1",
                 "proxy.host=0.0.0.0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the episodes themselves ran on both nodes (what the workflow saw inside its worker)
    episodes = [json.loads(line) for line in (tmp_path / "exp" / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 and all(e["error"] is None and e["calls"] for e in episodes)
    ran_on = {e["output"]["metadata"]["node_id"] for e in episodes}
    assert ran_on == node_ids, (ran_on, node_ids)
    assert len({e["output"]["metadata"]["pid"] for e in episodes}) == 2
    assert all(e["output"]["metadata"]["base_url"].startswith(f"http://{ip}:") for e in episodes), episodes[0]
    # the run says where its workers are, and records it per step
    line = next(x for x in proc.stderr.splitlines() if "Ray episode workers on" in x)
    assert "2 Ray episode workers on 2 node(s)" in line and all(n[:12] in line for n in node_ids), line
    metrics = [json.loads(x) for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and metrics[0]["rollout/ray_nodes"] == 2
    assert metrics[0]["policy_version"] == 1                       # the step trained
    # the run gave the cluster its CPUs back: another pool of two fits at once
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.available_resources().get("CPU") == 3
    finally:
        ray.shutdown()


def test_more_workers_than_the_cluster_has_cpus_is_one_line(two_nodes, tiny_model_dir, tmp_path):
    address, _, _ = two_nodes
    proc = _ajet(tmp_path, tiny_model_dir, "--with-ray", "4", "--ray-address", address, "--steps", "1")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("ajet: error:")]
    assert len(errors) == 1 and "--with-ray 4" in errors[0] and "3 CPU(s) on 2 node(s)" in errors[0], proc.stderr
    assert "--with-ray 3" in errors[0]                              # what fits, to run instead


def test_a_worker_on_another_machine_gets_a_proxy_url_it_can_reach():
    from ajet.errors import ConfigError
    from ajet.rollout.ray import worker_url

    url = "http://0.0.0.0:8123/ep/ajet-k/v1"
    assert worker_url(url, "10.1.2.3", "10.1.2.4") == "http://10.1.2.3:8123/ep/ajet-k/v1"
    assert worker_url("http://127.0.0.1:8123/ep/ajet-k/v1", "10.1.2.3", "10.1.2.3").startswith("http://127.0.0.1:")
    with pytest.raises(ConfigError, match="proxy.host=127.0.0.1.*runs on 10.1.2.4: set proxy.host=0.0.0.0"):
        worker_url("http://127.0.0.1:8123/ep/ajet-k/v1", "10.1.2.3", "10.1.2.4")


def test_an_address_nothing_answers_at_is_one_line(tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as s:       # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        proc = _ajet(tmp_path, tiny_model_dir, "--with-ray", "2", "--ray-address", f"127.0.0.1:{port}",
                     "--steps", "1", timeout_s=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("ajet: error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "ray start --head" in errors[0], proc.stderr



PRIVATE_RAY = """
import ray
from ajet.ray_cluster import init_address
ray.init(address=init_address(None), num_cpus=1, include_dashboard=False, log_to_driver=False)
print("nodes", len(ray.nodes()))
ray.shutdown()
"""


def test_a_run_without_an_address_starts_its_own_ray_not_the_machines_cluster(two_nodes, monkeypatch, tmp_path):
    """With a cluster running on this machine (the fixture's two nodes; Ray's `ray_current_cluster` file names it),
    the address a run given none passes to `ray.init` starts a private one-node Ray sized as the run asks:
    `ray.init()` would join that cluster, where the backbones' `num_cpus` sizing is refused ("When connecting to an
    existing cluster, num_cpus and num_gpus must not be provided", seen when a Trinity run started beside this
    module). An address that is given, or RAY_ADDRESS, is the user's choice and is kept."""
    from ajet.ray_cluster import init_address

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", PRIVATE_RAY], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={**env, **CLUSTER_ENV})
    assert proc.returncode == 0 and "nodes 1" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert init_address("10.0.0.1:6379") == "10.0.0.1:6379" and init_address("auto") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert init_address(None) is None       # Ray reads RAY_ADDRESS itself: the user named the cluster
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert init_address(None) == "local"
