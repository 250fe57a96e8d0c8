"""The backbone venvs (.venvs/verl, .venvs/trinity, built by .ci/make_backbone_env.sh) for the tests that run
verl's or Trinity's own code.

Outside CI a test whose venv is absent skips, naming the build command. In CI (`CI=true`, which `.ci/run`
sets) it FAILS instead: CI builds both venvs, so an absent one is a broken build, not a reason to check
nothing. `AJET_CI_BACKBONE_ENVS=0` (the builds skipped on purpose) restores the skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def must_not_skip() -> bool:
    """Whether a missing backbone venv is a failure: in CI, unless the builds were turned off on purpose."""
    return os.environ.get("CI", "").lower() in ("true", "1") and os.environ.get("AJET_CI_BACKBONE_ENVS", "1") != "0"


def venv_python(name: str) -> str:
    """The python of the `name` backbone venv (verl | trinity).

    Raises:
        pytest.skip.Exception: the venv is absent (outside CI, or in CI with AJET_CI_BACKBONE_ENVS=0).
        pytest.fail.Exception: the venv is absent in CI (see the module docstring).
    """
    venv = ROOT / ".venvs" / name
    if not (venv / ".complete").exists():
        msg = f"the {name} venv is absent: build it with `.ci/make_backbone_env.sh {name}`"
        if must_not_skip():
            pytest.fail(f"{msg} (in CI a backbone test may not skip; set AJET_CI_BACKBONE_ENVS=0 to skip on purpose)")
        pytest.skip(msg)
    return str(venv / "bin" / "python")
