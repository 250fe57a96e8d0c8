"""The backbone venvs (.venvs/verl, .venvs/trinity, built by .ci/make_backbone_env.sh) for the tests that run
verl's or Trinity's own code.

Outside CI a test whose venv is absent skips, naming the build command. In CI (`CI=true`, which `.ci/run`
sets) it FAILS instead: CI builds both venvs, so an absent one is a broken build, not a reason to check
nothing. `AJET_CI_BACKBONE_ENVS=0` (the builds skipped on purpose) restores the skip.

A venv still being built (`.venvs/<name>.building` names the build's process: CI builds the venvs while the rest of
the suite runs, and these tests run last, tests/conftest.py) is waited for, until its build ends or
`AJET_BACKBONE_VENV_WAIT_S` seconds (default 1800) pass.
"""

from __future__ import annotations

import os
import time
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
    wait_for_build(venv)
    if not (venv / ".complete").exists():
        msg = f"the {name} venv is absent: build it with `.ci/make_backbone_env.sh {name}`"
        if must_not_skip():
            pytest.fail(f"{msg} (in CI a backbone test may not skip; set AJET_CI_BACKBONE_ENVS=0 to skip on purpose)")
        pytest.skip(msg)
    return str(venv / "bin" / "python")


def wait_for_build(venv: Path) -> None:
    """Return once `venv` is complete, no build of it runs (`<venv>.building` absent, or its process gone), or
    `AJET_BACKBONE_VENV_WAIT_S` seconds (default 1800) have passed; polls every 2 s."""
    marker = venv.parent / f"{venv.name}.building"
    deadline = time.monotonic() + float(os.environ.get("AJET_BACKBONE_VENV_WAIT_S", "1800"))
    while not (venv / ".complete").exists() and time.monotonic() < deadline:
        try:
            os.kill(int(marker.read_text()), 0)      # the build's process (make_backbone_env.sh) still runs
        except (OSError, ValueError):                # no marker, or its process ended
            return
        time.sleep(2)
