"""Record real episodes for the backbone conformance checks: the real proxy in front of the tiny model's
engine, a multi-turn tool workflow whose last call forks (a rewritten system prompt), merged by the context
tracker, with GRPO advantages. Runs in the core environment; the result is a JSON file the verl and
Trinity environments load (they never import the proxy).

    python -m tests.backbone_conformance.record MODEL_DIR OUT.json
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from ajet.workflow import Workflow, WorkflowOutput

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


class ToolThenForkWorkflow(Workflow):
    """Two calls with a tool result between them (one merged sample), then a call under another system prompt
    (the prompt no longer extends the history: the tracker forks a second sample)."""

    async def execute(self, task, tuner):
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages, tools=[TOOL])
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": "TOOL RESULT 42"})
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages, tools=[TOOL])
        text = r.choices[0].message.content or ""
        review = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": f"{task.query} The answer is {text[:40]}"}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=review)
        final = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float((len(text) + len(final)) % 4), final_answer=final)


def record(model_dir: str, num_tasks: int = 2, num_repeat: int = 3, max_tokens: int = 10, seed: int = 0) -> dict:
    """Roll out `num_tasks x num_repeat` episodes through the real proxy; returns {"pad_id", "samples",
    "logprobs"}: the samples (advantages set) and the tiny model's current logprobs of each sample's response
    tokens `[response_len]` (what a trainer would compute before its first update).

    Deterministic: the same model and `seed` give the same tokens in every recording. Each call samples from
    its own seeded stream (`call_seed(seed, episode id, call index)`, the proxy's `seed`), not from the
    engine's generator in arrival order, and the episodes run one at a time, so no call is decoded in a batch
    whose make-up depends on timing (batched rows' logprobs differ in the last bits: up to 4.8e-7 in 4 of 12
    samples between two recordings of 8 episodes at once; under load, tokens too). A recording that changed
    from run to run moved the backbone comparisons' measured differences with it."""
    from ajet.backbones.debug.backbone import DebugBackbone, token_logprobs
    from ajet.config import AjetConfig
    from ajet.algorithm.advantage import assign_advantages
    from ajet.llm_call import SamplingParams
    from ajet.proxy.server import ProxyServer
    from ajet.rollout.episodes import rollout
    from ajet.task import Task
    from ajet.tracker import merge_calls

    cfg = AjetConfig.model_validate({"workflow": "x:y", "data": {"train_path": "x"},
                                     "model": {"path": model_dir, "max_model_len": 1024, "device": "cpu"},
                                     "rollout": {"max_tokens": max_tokens, "temperature": 1.0}})
    backbone = DebugBackbone(cfg)
    proxy = ProxyServer(backbone.engine, backbone.tokenizer, SamplingParams(temperature=1.0, top_p=1.0,
                                                                             max_tokens=max_tokens), seed=seed).start()
    try:
        tasks = [Task(f"t{i}", f"What is {i} plus {i + 1}?", str(2 * i + 1)) for i in range(num_tasks)]
        episodes = asyncio.run(rollout(ToolThenForkWorkflow(), tasks, num_repeat, proxy, None, 1, 1, 600.0))
    finally:
        proxy.stop()
    bad = [e.error for e in episodes if not e.ok]
    if bad:
        raise RuntimeError(bad[0])
    for e in episodes:
        e.samples = merge_calls(e.calls, e.group_id)
    samples = [s for e in episodes for s in e.samples]
    assign_advantages(samples, {e.episode_id: e.reward for e in episodes})
    logprobs = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            temps = torch.tensor([[1.0] * len(s.prompt_ids) + s.temperatures])
            tops = torch.tensor([[1.0] * len(s.prompt_ids) + s.top_ps])
            lp, _ = token_logprobs(backbone.model, ids, torch.ones_like(ids), temps, tops)
            logprobs.append(lp[0, len(s.prompt_ids):].tolist())
    backbone.close()
    return {"pad_id": backbone.tokenizer.pad_token_id, "samples": [s.to_dict() for s in samples],
            "logprobs": logprobs}


if __name__ == "__main__":
    with open(sys.argv[2], "w") as f:
        json.dump(record(sys.argv[1]), f)
