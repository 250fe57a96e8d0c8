"""The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
sampling) through `ajet --backbone trinity` on CPU, in Trinity's venv, for 2 steps: killed with kill -9 once step
1's checkpoint is written (step 2 is running), then `--resume`d to the end, and checked against one uninterrupted
run of the debug backbone: every task once, the same tokens and rewards (tests/backbone_conformance/main_job.py
says what and why). verl's run: tests/test_backbone_main_job.py.
"""

from __future__ import annotations

import shutil

from tests.backbone_conformance.main_job import (  # noqa: F401 - debug_run is this module's fixture
    debug_run,
    killed_resumed_and_checked,
)
from tests.backbone_conformance.venvs import venv_python  # noqa: F401 - marks the module as a backbone-venv one


def test_the_main_job_through_trinity_killed_and_resumed_equals_the_debug_backbones(debug_run, tmp_path):  # noqa: F811
    _, exp = killed_resumed_and_checked("trinity", debug_run, tmp_path)
    shutil.rmtree(exp / "checkpoints")          # checked: GBs the suite's disk need not hold (kept on a failure)
