"""A real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: two raylets, the head with 2 CPUs, the
second with 1) joined by `ajet --ray-address`: the `--with-ray` episode workers spread over both nodes (the head
alone could hold both: packing them there fails the test), a cluster too small for the asked workers is one line
and exit 2, and an address nothing answers at is one too.

verl on two nodes: a cluster of two one-CPU raylets started from verl's venv (its workers import verl), and
`ajet --backbone verl --ray-address ADDR verl.trainer.nnodes=2` trains a step with one FSDP rank (gloo) on each
node; `trainer.nnodes=3` on it is one line and exit 2 (verl's placement groups would wait forever).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backbone_conformance.venvs import venv_python

ray = pytest.importorskip("ray", reason="--with-ray needs `ray` (pip install 'ajet[ray]')")

WORKFLOW = '''
import ray
from ajet.workflow import Workflow, WorkflowOutput


class WhereAmI(Workflow):
    """One call; the output's metadata names the Ray node and process the episode ran in."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model, max_tokens=4,
                                                       messages=[{"role": "user", "content": task.query}])
        import os
        return WorkflowOutput(reward=float(len(r.choices[0].message.content or "") % 2), final_answer="x",
                              metadata={"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                                        "base_url": tuner.base_url})
'''

# Ray's memory monitor kills workers at 95% of the machine's memory by default; the machine is shared with
# other runs (a vLLM server, verl), so this cluster only kills at 98%
CLUSTER_ENV = {"RAY_memory_usage_threshold": "0.98"}


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


def _write_run(tmp_path: Path, tiny_model_dir: str) -> None:
    """conf.yaml (one step of 2 tasks x 2 episodes of `WhereAmI` on the tiny model), wf.py and tasks.jsonl."""
    (tmp_path / "wf.py").write_text(WORKFLOW)
    tasks = [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (tmp_path / "conf.yaml").write_text(f"""
experiment_name: two_nodes
workflow: wf.py:WhereAmI
model: {{path: "{tiny_model_dir}", max_model_len: 512}}
data: {{train_path: tasks.jsonl}}
rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
algorithm: {{lr: 1.0e-3}}
trainer: {{total_steps: 1, tasks_per_step: 2, tensorboard: false}}
""")


def _ajet(tmp_path: Path, tiny_model_dir: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    _write_run(tmp_path, tiny_model_dir)
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


# started by verl's python: a two-raylet cluster (1 CPU each); prints its address, then, once the file argv[1]
# exists, the actors it ran (name, class, node) and its node ids as JSON lines, and shuts itself down
VERL_CLUSTER = """
import json, os, sys, time
import ray
from ray.cluster_utils import Cluster
small = {"object_store_memory": 80 * 2**20, "include_dashboard": False}
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, **small})
try:
    c.add_node(num_cpus=1, resources={"node_b": 1}, **small)
    c.wait_for_nodes()
    print(c.address, flush=True)
    deadline = time.monotonic() + 900
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.5)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    from ray._private import state
    print(json.dumps([{"name": a["Name"], "cls": a["ActorClassName"], "node": a["Address"]["NodeID"]}
                      for a in state.actors().values()]), flush=True)
    print(json.dumps([n["NodeID"] for n in ray.nodes() if n["Alive"]]), flush=True)
    ray.shutdown()
finally:
    c.shutdown()
"""


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line `proc` prints, within `timeout_s` (a line it never prints fails the test, not hangs it)."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no line from the cluster's process in {timeout_s:g} s"
    return proc.stdout.readline().strip()


def test_verl_trains_a_step_with_one_rank_on_each_of_two_nodes(tiny_model_dir, tmp_path):
    py = venv_python("verl")
    stop = tmp_path / "stop"
    cluster = subprocess.Popen([py, "-c", VERL_CLUSTER, str(stop)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **CLUSTER_ENV})
    try:
        address = _read_line(cluster, 240)
        assert ":" in address, address
        _write_run(tmp_path, tiny_model_dir)
        cmd = [py, "-m", "ajet", "--conf", "conf.yaml", "--backbone", "verl", "--ray-address", address]
        env = {**os.environ, **CLUSTER_ENV}
        # three groups of one CPU on a cluster of two one-CPU nodes: refused at once, in one line
        too_many = subprocess.run(cmd + ["--exp-dir", "exp3", "verl.trainer.nnodes=3"], capture_output=True,
                                  text=True, timeout=300, cwd=tmp_path, env=env)
        errors = [x for x in too_many.stderr.splitlines() if x.startswith("ajet: error:")]
        assert too_many.returncode == 2 and "Traceback" not in too_many.stderr, too_many.stderr[-3000:]
        assert len(errors) == 1 and "trainer.nnodes=3" in errors[0] and "2 node(s) with 1, 1 CPU(s)" in errors[0], \
            too_many.stderr[-3000:]
        run = subprocess.run(cmd + ["--exp-dir", "exp", "verl.trainer.nnodes=2"], capture_output=True, text=True,
                             timeout=480, cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        metrics = [json.loads(x) for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1] and metrics[0]["policy_version"] == 1
        assert metrics[0]["train/optimizer_steps"] == 1.0
    finally:
        stop.touch()
    try:
        actors, nodes = json.loads(_read_line(cluster, 120)), set(json.loads(_read_line(cluster, 60)))
        cluster.wait(timeout=120)
    finally:
        if cluster.poll() is None:
            cluster.kill()
    ranks = {a["name"].rsplit("AjetActorWorker_", 1)[1]: a["node"] for a in actors if a["cls"] == "AjetActorWorker"}
    assert sorted(ranks) == ["0:0", "1:0"] and set(ranks.values()) == nodes and len(nodes) == 2, (ranks, nodes)


def test_verl_with_ray_workers_on_the_ray_ajet_starts(tiny_model_dir, tmp_path):
    """No cluster: the episode pool starts the local Ray (before verl's backbone loads, which joins it) with room
    for verl's rank beside the workers' CPUs, whatever the machine's core count."""
    py = venv_python("verl")
    _write_run(tmp_path, tiny_model_dir)
    run = subprocess.run([py, "-m", "ajet", "--conf", "conf.yaml", "--backbone", "verl", "--exp-dir", "exp",
                          "--with-ray", "2"], capture_output=True, text=True, timeout=480, cwd=tmp_path,
                         env={**os.environ, **CLUSTER_ENV})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 Ray episode workers on 1 node(s)" in run.stderr
    metrics = [json.loads(x) for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["train/optimizer_steps"] == 1.0 and metrics[0]["rollout/ray_nodes"] == 1
