"""The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
sampling) through `ajet --backbone verl --with-ray 2` on CPU, in verl's venv, for 2 steps, checked against one run of
the debug backbone (in process, without Ray): every task once, the same tokens and rewards
(tests/backbone_conformance/main_job.py says what and why). The episodes run in two Ray episode workers on the Ray
that the episode pool starts before verl loads, with room for verl's rank beside the workers' CPUs whatever the
machine's core count (verl then joins it). verl's actor checkpoint also converts (verl's model_merger) to a Hugging
Face folder equal to the weights ajet's engine served. verl killed and resumed, and verl on a cluster of two Ray
nodes: tests/test_backbone_vllm.py. Trinity's run: tests/test_backbone_main_job_trinity.py.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM

from ajet.model import resolve_model_path
from tests.backbone_conformance.main_job import (  # noqa: F401 - debug_run is this module's fixture
    STEPS,
    assert_verl_checkpoint_merges_to_served_weights,
    debug_run,
    run_and_check,
)
from tests.backbone_conformance.venvs import venv_python  # noqa: F401 - marks the module as a backbone-venv one
from tests.two_nodes import CLUSTER_ENV

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 6.95 alone on 2026-12-06, 6.39 with the two Ray episode workers on
# 2026-12-07 (above 7.7 it could not run beside the 10.5 GB files)
PEAK_MEMORY_GB = 7.5


def test_the_main_job_through_verl_equals_the_debug_backbones(debug_run, tmp_path):  # noqa: F811
    py, exp = run_and_check("verl", debug_run, tmp_path, "--with-ray", "2",
                            env={**os.environ, **CLUSTER_ENV})
    metrics = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/ray_nodes"] for m in metrics] == [1.0] * STEPS        # the episodes ran in Ray workers

    # verl's actor checkpoint converts (verl's model_merger) to the weights ajet's engine served
    _, served = assert_verl_checkpoint_merges_to_served_weights(py, exp / "checkpoints" / f"step_{STEPS}",
                                                                tmp_path / "merged")
    start = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct")).state_dict()
    assert any(not torch.equal(served[k], start[k]) for k in served)      # the updates moved them
    shutil.rmtree(exp / "checkpoints")          # checked: ~2 GB the suite's disk need not hold (kept on a failure)
