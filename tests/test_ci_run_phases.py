"""`.ci/run` prints how long each of its phases took: the Debian packages, the README's install, the suite (with
pytest's list of its slowest tests, `--durations` in pyproject.toml's addopts) and each background part, a failed
part too. The real script runs in a copy of the checkout where the slow commands are stand-ins (pip, uv, the wheel
check, mkdocs, the linters) and the suite is two tiny tests, run by the README's command as it is (`pytest -n 3`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 1   # each stand-in below that sleeps, sleeps this long


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def _checkout(dst: Path) -> Path:
    (dst / ".ci").mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "run", dst / ".ci" / "run")
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    # the wheel check fails, after a while: its seconds and its log's tail are printed, and the run fails
    _stub(dst / ".ci" / "wheel_check.sh", f"sleep {WAIT_S}; echo 'the wheel would not install' >&2; exit 3")
    _stub(dst / ".venvs" / "docs" / "bin" / "mkdocs", f"sleep {WAIT_S}")
    _stub(dst / ".venvs" / "lint" / "bin" / "ruff", "echo 'All checks passed!'")
    _stub(dst / ".venvs" / "lint" / "bin" / "python", "echo 'Contracts: 4 kept, 0 broken.'")
    (dst / "tests").mkdir()
    (dst / "tests" / "test_tiny.py").write_text(
        f"import time\n\ndef test_sleeps():\n    time.sleep({WAIT_S})\n\ndef test_quick():\n    pass\n")
    return dst


def test_each_phase_prints_its_seconds_and_the_suite_its_slowest_tests(tmp_path):
    checkout = _checkout(tmp_path / "checkout")
    bin_dir = tmp_path / "bin"
    _stub(bin_dir / "id", "echo 1000")                                      # not root: no apt-get
    _stub(bin_dir / "uv", "exit 0")
    _stub(bin_dir / "pip", f'case "$*" in *torch==*) sleep {WAIT_S};; esac; echo "pip $*"')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", AJET_CI_BACKBONE_ENVS="0", AJET_CI_VLLM_ENV="0", TMPDIR=str(tmp_path),
               # pytest with xdist alone: the other installed plugins take ~40 s to load at load 7 in 4 processes
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTEST_ADDOPTS="-p xdist")
    proc = subprocess.run(["bash", ".ci/run"], cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr                        # the wheel part failed
    assert "FAILED: wheel" in proc.stderr, proc.stderr

    assert re.search(r"^\[ci \d+ s\] Debian packages installed: \d+ s$", out, flags=re.M), out
    install = re.search(r"^\[ci \d+ s\] the README's install: (\d+) s$", out, flags=re.M)
    suite = re.search(r"^\[ci \d+ s\] test suite passed: (\d+) s\b", out, flags=re.M)
    assert install and suite, out
    assert int(install.group(1)) >= WAIT_S and int(suite.group(1)) >= WAIT_S, out   # each holds its own sleep
    # pytest's list of the slowest tests comes between the install's line and the suite's
    between = out[install.end():suite.start()]
    assert re.search(r"slowest \d+ durations", between), out
    assert re.search(r"^\d+\.\d+s call +tests/test_tiny\.py::test_sleeps$", between, flags=re.M), out

    # a part that passed: its seconds, then its log's last line
    docs = re.search(r"^\[ci \d+ s\] docs: (\d+) s; mkdocs build --strict passed in \d+ s$", out, flags=re.M)
    assert docs and int(docs.group(1)) >= WAIT_S, out
    assert re.search(r"^\[ci \d+ s\] lint: \d+ s; lint \(import layers, docstring sections\) passed in \d+ s$",
                     out, flags=re.M), out
    # the part that failed: its log's tail, its seconds in it
    wheel = re.search(r"the wheel would not install\n\[ci part took (\d+) s\]", proc.stderr)
    assert wheel and int(wheel.group(1)) >= WAIT_S, proc.stderr
