"""What the two-node Ray tests share (tests/test_ray_two_nodes.py, tests/test_ray_two_nodes_verl.py): the
workflow that records where it ran, the cluster's environment, and the run's files."""

import json
from pathlib import Path

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
