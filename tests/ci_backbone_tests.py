"""Where the tests that use a backbone venv run (a pytest plugin, registered by tests/conftest.py).

Those tests (their module imports `venv_python`: tests/test_backbone_conformance.py, tests/test_verl_cpu_train.py,
tests/test_backbone_main_job.py) run verl and Trinity in their own venvs and Ray workers: the slowest tests of the
suite, and the only ones that need the venvs that CI builds while the suite runs. So:

- by default they run last, in their order (a test waits for a venv still being built, see
  tests/backbone_conformance/venvs.py);
- with `AJET_CI_BACKBONE_TESTS_BESIDE=1` (`AJET_CI_BACKBONE_TESTS_BESIDE=1 .ci/run`) the session starts them in
  a pytest process of its own, beside the rest of the suite, once its own collection is done (so after the README
  command's installs), and at its end waits for that process: the session fails when it failed, and prints its
  output (all of it on a failure, its summary line otherwise). The whole files run there, so this is for a run of
  the whole suite (CI).

On the 2-core machine the two processes share the cores with whatever else runs; the backbone tests spend much of
their time starting processes (a venv python that imports verl, Ray's workers) and waiting on them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from tests.backbone_conformance import venvs

BESIDE = "AJET_CI_BACKBONE_TESTS_BESIDE"
WAIT_S = 3600          # at most this long, after the rest of the suite, for the backbone tests' process


def uses_backbone_venv(item: pytest.Item) -> bool:
    """Whether `item`'s module imports `venv_python` (it runs code in a backbone venv)."""
    return getattr(getattr(item, "module", None), "venv_python", None) is venvs.venv_python


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backbone = [i for i in items if uses_backbone_venv(i)]
    if not backbone:
        return
    rest = [i for i in items if not uses_backbone_venv(i)]
    if os.environ.get(BESIDE) != "1" or config.option.collectonly:
        items[:] = rest + backbone
        return
    files = sorted({str(i.path.relative_to(config.rootpath)) for i in backbone})
    log = tempfile.NamedTemporaryFile("w+", prefix="ajet-backbone-tests-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                            cwd=config.rootpath, env={**os.environ, BESIDE: "0"}, stdout=log,
                            stderr=subprocess.STDOUT)
    config.stash[_beside] = (proc, log, files)
    config.hook.pytest_deselected(items=backbone)
    items[:] = rest


_beside = pytest.StashKey[tuple]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    started = session.config.stash.get(_beside, None)
    if started is None:
        return
    proc, log, files = started
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        proc.kill()
    try:
        code = proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        print(f"\nthe backbone tests ran past {WAIT_S} s after the rest of the suite: killed", file=sys.stderr)
    log.seek(0)
    output = log.read()
    log.close()
    os.unlink(log.name)
    lines = output.rstrip().splitlines()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    write(f"\nbackbone tests ({' '.join(files)}), run beside the rest of the suite: exit status {code}")
    for line in (lines if code != 0 else lines[-1:]):
        write(line)
    if code != 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
