"""Multi-agent training: `algorithm.trainable_targets` chooses which agents' calls train; the others are
served by the same policy and recorded, never trained on."""

import json
import textwrap

from safetensors.torch import load_file

from ajet.config import load_config
from ajet.trainer import run

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class PlannerSolver(Workflow):
    """A planner agent writes a plan, a solver agent answers from it: two agents, two samples."""

    async def execute(self, task, tuner):
        planner, solver = tuner.agent("planner"), tuner.agent("solver")
        plan = await planner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": "Plan: " + task.query}])
        answer = await solver.client.chat.completions.create(model=tuner.model, messages=[
            {"role": "system", "content": plan.choices[0].message.content or ""},
            {"role": "user", "content": task.query}])
        text = answer.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text)
'''


def _conf(tmp_path, tiny_model_dir, targets):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"{i} + {i}?"}) + "\n"
                                                  for i in range(4)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:PlannerSolver
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 4, max_tokens: 8, temperature: 1.0}}
        algorithm: {{lr: 1.0e-2, trainable_targets: {json.dumps(targets)}}}
        trainer: {{total_steps: 1, tasks_per_step: 2, tensorboard: false, exp_dir: "{tmp_path / 'exp'}"}}
    """))
    return load_config(tmp_path / "conf.yaml")


def test_only_the_targeted_agent_trains(tiny_model_dir, tmp_path):
    exp = run(_conf(tmp_path, tiny_model_dir, ["solver"]))
    m = json.loads((exp / "metrics.jsonl").read_text().splitlines()[0])
    assert m["rollout/calls"] == 16 and m["tracker/samples"] == 16           # 8 episodes x 2 agents
    assert m["tracker/trained_samples"] == 8 and m["policy_version"] == 1
    episodes = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    assert {c["agent_tag"] for e in episodes for c in e["calls"]} == {"planner", "solver"}   # both recorded


def test_a_target_no_agent_uses_trains_nothing_and_says_so(tiny_model_dir, tmp_path, caplog):
    exp = run(_conf(tmp_path, tiny_model_dir, ["solvr"]))
    m = json.loads((exp / "metrics.jsonl").read_text().splitlines()[0])
    assert m["tracker/trained_samples"] == 0 and m["policy_version"] == 0
    assert "matched no agent" in caplog.text and "'planner', 'solver'" in caplog.text
    weights = load_file(str(next((exp / "checkpoints").glob("step_*")) / "model.safetensors"))
    original = load_file(f"{tiny_model_dir}/model.safetensors")
    assert all((weights[k] == original[k]).all() for k in original)         # nothing moved
