"""A real experiment folder for the viewer tests: the `ajet` CLI trains the tiny random model for 2 steps.

The workflow calls the policy twice around a tool result (the tracker merges the calls into one sample)
and raises on one task, so the folder holds merged samples, advantages and failed episodes. The run is
started as the README's is: from its folder, with a relative config and a relative experiment folder,
tensorboard and the held-out evaluation on, so it leaves every output the README lists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


class ToolLoopWorkflow(Workflow):
    """Asks, consults the tool once, asks again; the task "boom" raises after its first call."""

    async def execute(self, task, tuner):
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages, tools=[TOOL])
        if task.task_id == "boom":
            raise RuntimeError("the lookup service is down")
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": "TOOL RESULT 42"})
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages, tools=[TOOL])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text, metrics={"turns": 2, "length": len(text)})
'''


def make_tiny_experiment(root: Path, model_dir: str, steps: int = 2, timeout_s: float = 240) -> Path:
    """Run `ajet` (debug backbone, tiny model) in `root`; returns the experiment folder `root/exp`.

    Raises:
        AssertionError: the run failed (its output is the message).
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "wf.py").write_text(WORKFLOW)
    tasks = [{"task_id": "boom", "query": "Look up the capital of nowhere.", "answer": "0"}]
    tasks += [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(3)]
    (root / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (root / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: tiny
        workflow: wf.py:ToolLoopWorkflow
        model: {{path: "{model_dir}", max_model_len: 1024}}
        data: {{train_path: tasks.jsonl, val_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 3, max_tokens: 12, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, val_freq: {steps}, stop_on_invalid_eval: false}}
    """))
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp"],
                          capture_output=True, text=True, timeout=timeout_s, cwd=root,
                          env={**os.environ, "AJET_PLOTS": "1"})   # every output, plots too (the suite's default: none)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (root / "run.log").write_text(proc.stdout + proc.stderr)
    return root / "exp"
