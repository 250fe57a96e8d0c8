"""The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
sampling) through `ajet --backbone trinity` on CPU, in Trinity's venv, for 2 steps: killed with kill -9 once step
1's checkpoint is written (step 2 is running), then `--resume`d to the end, and checked against one uninterrupted
run of the debug backbone: every task once, the same tokens and rewards (tests/backbone_conformance/main_job.py
says what and why). verl's run: tests/test_backbone_main_job.py.
"""

from __future__ import annotations

import shutil

import pytest

from tests.backbone_conformance.main_job import (
    check_against_debug,
    debug_reference,
    killed_and_resumed,
)
from tests.backbone_conformance.venvs import venv_python


@pytest.fixture(scope="module")
def debug_run(request, tmp_path_factory):
    return debug_reference(request, tmp_path_factory)


def test_the_main_job_through_trinity_killed_and_resumed_equals_the_debug_backbones(debug_run, tmp_path):
    py = venv_python("trinity")
    conf, debug = debug_run
    exp = tmp_path / "trinity"
    killed_and_resumed(py, conf, "trinity", exp)
    check_against_debug(exp, debug)
    shutil.rmtree(exp / "checkpoints")          # checked: GBs the suite's disk need not hold (kept on a failure)
