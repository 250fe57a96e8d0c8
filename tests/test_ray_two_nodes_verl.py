"""verl on two Ray nodes of this machine: a cluster of two one-CPU raylets started from verl's venv (its workers
import verl), and `ajet --backbone verl --ray-address ADDR verl.trainer.nnodes=2` trains a step with one FSDP rank
(gloo) on each node; `trainer.nnodes=3` on it is one line and exit 2 (verl's placement groups would wait forever).
Without a cluster, `--with-ray` beside verl: the Ray the episode pool starts holds verl's rank too."""

import json
import os
import subprocess

from tests.backbone_conformance.venvs import venv_python
from tests.two_nodes import CLUSTER_ENV, write_run

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 3.32 alone on 2026-12-06
PEAK_MEMORY_GB = 4.0


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
        write_run(tmp_path, tiny_model_dir)
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
        # the ranks write verl's actor checkpoint from their own working folder (the cluster's, not the run's):
        # both shards must be in the run's checkpoint all the same
        shards = sorted(p.name for p in (tmp_path / "exp" / "checkpoints" / "step_1" / "actor").glob("model_*.pt"))
        assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"], shards
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
    write_run(tmp_path, tiny_model_dir)
    run = subprocess.run([py, "-m", "ajet", "--conf", "conf.yaml", "--backbone", "verl", "--exp-dir", "exp",
                          "--with-ray", "2"], capture_output=True, text=True, timeout=480, cwd=tmp_path,
                         env={**os.environ, **CLUSTER_ENV})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 Ray episode workers on 1 node(s)" in run.stderr
    metrics = [json.loads(x) for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["train/optimizer_steps"] == 1.0 and metrics[0]["rollout/ray_nodes"] == 1
