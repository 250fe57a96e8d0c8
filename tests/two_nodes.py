"""What the two-node Ray tests share (tests/test_ray_two_nodes.py, tests/test_backbone_main_job.py,
tests/test_backbone_vllm.py): the workflow that records where it ran, the cluster's environment, the run's files,
and a two-raylet cluster started from verl's venv."""

import json
import os
import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.backbone_conformance.venvs import venv_python

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


def write_run(tmp_path: Path, tiny_model_dir: str) -> None:
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


# started by verl's python: a two-raylet cluster (argv[2] CPUs and argv[3] MiB of object store each); prints its
# address, then, once the file argv[1] exists, the actors it ran (name, class, node) and its node ids as JSON lines,
# and shuts itself down
VERL_CLUSTER = """
import json, os, sys, time
import ray
from ray.cluster_utils import Cluster
small = {"object_store_memory": int(sys.argv[3]) * 2**20, "include_dashboard": False}
cpus = int(sys.argv[2])
c = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "resources": {"node_a": 1}, **small})
try:
    c.add_node(num_cpus=cpus, resources={"node_b": 1}, **small)
    c.wait_for_nodes()
    print(c.address, flush=True)
    deadline = time.monotonic() + 1800
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
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no line from the cluster's process in {timeout_s:g} s"
    return proc.stdout.readline().strip()


@contextmanager
def verl_cluster(folder: Path, cpus_per_node: int, object_store_mib: int) -> Iterator[dict]:
    """A Ray cluster of two raylets on this machine (`ray.cluster_utils.Cluster`, started by verl's python so that
    its workers import verl), `cpus_per_node` logical CPUs and `object_store_mib` of object store each (what a
    step passes through it beyond that spills to disk: a model's weights on their way to a vLLM server).

    Yields `{"address": "IP:PORT"}`; when the block ends without an error the dict gains `"actors"` (`[{"name",
    "cls", "node"}]`, every actor the cluster ran) and `"nodes"` (the alive node ids). The cluster is shut down
    either way (its raylets with it)."""
    stop = folder / "cluster-stop"
    proc = subprocess.Popen([venv_python("verl"), "-c", VERL_CLUSTER, str(stop), str(cpus_per_node),
                             str(object_store_mib)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **CLUSTER_ENV})
    try:
        info = {"address": _read_line(proc, 240)}
        assert ":" in info["address"], info
        yield info
        stop.touch()
        info["actors"] = json.loads(_read_line(proc, 120))
        info["nodes"] = json.loads(_read_line(proc, 60))
    finally:
        stop.touch()               # the script shuts its raylets down itself: give it the time to
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
