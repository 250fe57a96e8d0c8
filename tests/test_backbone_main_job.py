"""The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
sampling) through `ajet --backbone verl` on CPU, in verl's venv, for 2 steps: killed with kill -9 once step 1's
checkpoint is written (step 2 is running), then `--resume`d to the end, and checked against one uninterrupted run
of the debug backbone: every task once, the same tokens and rewards (tests/backbone_conformance/main_job.py says
what and why). verl's actor checkpoint also converts (verl's model_merger) to a Hugging Face folder equal to the
weights ajet's engine served. Trinity's run: tests/test_backbone_main_job_trinity.py.
"""

from __future__ import annotations

import shutil

import torch
from transformers import AutoModelForCausalLM

from tests.backbone_conformance.main_job import (  # noqa: F401 - debug_run is this module's fixture
    STEPS,
    assert_verl_checkpoint_merges_to_served_weights,
    debug_run,
    killed_resumed_and_checked,
)
from tests.backbone_conformance.venvs import venv_python  # noqa: F401 - marks the module as a backbone-venv one


def test_the_main_job_through_verl_killed_and_resumed_equals_the_debug_backbones(debug_run, tmp_path):  # noqa: F811
    py, exp = killed_resumed_and_checked("verl", debug_run, tmp_path)

    # verl's actor checkpoint converts (verl's model_merger) to the weights ajet's engine served
    _, served = assert_verl_checkpoint_merges_to_served_weights(py, exp / "checkpoints" / f"step_{STEPS}",
                                                                tmp_path / "merged")
    step1 = AutoModelForCausalLM.from_pretrained(exp / "checkpoints" / "step_1").state_dict()
    assert any(not torch.equal(served[k], step1[k]) for k in served)      # the resumed run's update moved them
    shutil.rmtree(exp / "checkpoints")          # checked: ~4 GB the suite's disk need not hold (kept on a failure)
