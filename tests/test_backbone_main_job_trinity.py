"""The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
sampling) through `ajet --backbone trinity` on CPU, in Trinity's venv, for 2 steps, checked against one run of the
debug backbone: every task once, the same tokens and rewards (tests/backbone_conformance/main_job.py says what and
why). Trinity killed and resumed: tests/test_backbone_vllm.py. verl's run: tests/test_backbone_main_job.py.
"""

from __future__ import annotations

import shutil

from tests.backbone_conformance.main_job import (  # noqa: F401 - debug_run is this module's fixture
    debug_run,
    run_and_check,
)
from tests.backbone_conformance.venvs import venv_python  # noqa: F401 - marks the module as a backbone-venv one

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 9.65 alone on 2026-12-06
PEAK_MEMORY_GB = 10.0


def test_the_main_job_through_trinity_equals_the_debug_backbones(debug_run, tmp_path):  # noqa: F811
    _, exp = run_and_check("trinity", debug_run, tmp_path)
    shutil.rmtree(exp / "checkpoints")          # checked: GBs the suite's disk need not hold (kept on a failure)
