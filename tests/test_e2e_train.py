"""End to end: the `ajet` CLI trains a tiny random model for 2 steps through the real proxy and SDK."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


class ToolLoopWorkflow(Workflow):
    """Asks, always consults the tool once, asks again: two calls that the tracker must merge, sampled at
    two temperatures (the client's, under `rollout.sampling_policy: client`)."""

    async def execute(self, task, tuner):
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages, tools=[TOOL],
                                                       temperature=0.3)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": "TOOL RESULT 42"})
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages, tools=[TOOL],
                                                       temperature=1.0)
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text, metrics={"turns": 2})
'''


def test_ajet_cli_trains_two_steps(tiny_model_dir, tmp_path):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    tasks = [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: tiny
        workflow: wf.py:ToolLoopWorkflow
        model: {{path: "{tiny_model_dir}", max_model_len: 1024}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 4, max_tokens: 12, temperature: 1.0, sampling_policy: client}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: 2, tasks_per_step: 2, save_freq: 1, tensorboard: true}}
    """))
    exp = tmp_path / "exp"
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(tmp_path / "conf.yaml"), "--backbone=debug",
                           "--exp-dir", str(exp)], capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 2/2" in proc.stdout

    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/episodes"] == 8 and m["rollout/failed"] == 0 for m in metrics)
    assert all(m["rollout/calls"] == 16 and m["tracker/samples"] == 8 for m in metrics)   # 2 calls -> 1 sample
    assert metrics[1]["policy_version"] == 2
    # one optimizer step per step: the trainer scores fresh data exactly as the engine sampled it
    for m in metrics:
        assert m["train/logprob_diff"] < 1e-3, m
        assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-3) and m["train/clip_frac"] == 0.0, m
    assert list((exp / "tensorboard").iterdir())

    episodes = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 16
    for ep in episodes:
        c0, c1 = ep["calls"]
        assert c0["prompt_ids"] and c0["completion_ids"] and len(c0["completion_logprobs"]) == len(c0["completion_ids"])
        assert c1["prompt_parent"] == c0["call_id"]
        (s,) = ep["samples"]
        n0 = len(c0["completion_ids"])
        tool_part = c1["prompt_ids"][len(s["prompt_ids"]) + n0:]
        # sampled tokens of both calls: mask 1; the tool turn between them: mask 0
        assert s["response_ids"] == c0["completion_ids"] + tool_part + c1["completion_ids"]
        assert s["loss_mask"] == [1] * n0 + [0] * len(tool_part) + [1] * len(c1["completion_ids"])
        assert s["temperatures"] == [0.3] * n0 + [1.0] * (len(tool_part) + len(c1["completion_ids"]))
        assert "TOOL RESULT 42" in _decode(tiny_model_dir, tool_part)

    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(exp / "checkpoints" / "step_2" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "the GRPO update did not change any weight"


def _decode(model_dir, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids)
