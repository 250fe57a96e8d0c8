"""The suite's xdist scheduling (tests/ci_scheduler.py), on small suites run by real pytest-xdist workers: a heavy file
that does not fit beside another goes after it while the other worker runs light files (no worker waits for
memory), heavy files wait for a venv build to end while light files run, and what a file outside the chain of the
largest heavy ones starts runs niced (tests/memory_budget.py's `set_priority`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.backbone_conformance.venvs import ROOT
from tests.ci_scheduler import declared_gb
from tests.memory_budget import YIELD_NICE, can_renice

CONFTEST = ("from tests.memory_budget import (  # noqa: F401\n"
            "    _memory_reservation, pytest_configure, pytest_sessionfinish, pytest_terminal_summary,"
            " pytest_testnodedown)\n"
            "from tests.ci_scheduler import pytest_xdist_make_scheduler  # noqa: F401\n")
HEAVY = "import time\n\nPEAK_MEMORY_GB = 1.0\n\n\ndef test_holds():\n    time.sleep(2.0)\n"
LIGHT = "import time\n\n\ndef test_quick():\n    time.sleep(0.3)\n"
LIGHT_FILES = 16


def _project(folder: Path, files: dict[str, str]) -> Path:
    """A pytest project in `folder` with this suite's scheduling and memory plugins and `files` ({name: source})."""
    folder.mkdir()
    (folder / "pytest.ini").write_text("[pytest]\naddopts = --dist loadfile --no-loadscope-reorder\n")
    (folder / "conftest.py").write_text(CONFTEST)
    for name, source in files.items():
        (folder / name).write_text(source)
    return folder


def _pytest_n2(suite: Path, budget_gb: float, *flags: str) -> subprocess.CompletedProcess:
    """`pytest flags... -n 2` on `suite` under a `budget_gb` memory budget; asserts it passed."""
    env = {**os.environ, "AJET_TEST_MEMORY_GB": str(budget_gb), "PYTHONPATH": str(ROOT),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}          # xdist alone: the other plugins' imports take seconds
    proc = subprocess.run([sys.executable, "-m", "pytest", *flags, "-p", "xdist.plugin", "-n", "2", "-p",
                           "no:cacheprovider", str(suite)], capture_output=True, text=True, timeout=300, cwd=suite,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _suite(folder: Path) -> Path:
    """Two heavy files of 1 GB each (a 1.5 GB budget holds one), 2 s each, collected first, then LIGHT_FILES light
    ones (0.3 s each: more than the heavy files' 4 s on the 2 workers)."""
    return _project(folder, {"test_a_heavy.py": HEAVY, "test_b_heavy.py": HEAVY,
                             **{f"test_c_light_{i}.py": LIGHT for i in range(LIGHT_FILES)}})


def _run(suite: Path) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """Runs `suite` on 2 workers under a 1.5 GB budget: (its tests' ("start" | "pass", file) in the order pytest -v
    printed them, the seconds each heavy file waited for memory, from the summary)."""
    proc = _pytest_n2(suite, 1.5, "-v")
    events = [("start", line.split("::")[0]) if line.startswith("test_") else ("pass", line.split("::")[0].split()[-1])
              for line in proc.stdout.splitlines() if "::" in line and (line.startswith("test_") or " PASSED " in line)]
    waited = {line.split()[0]: float(line.split(" waited ")[1].split()[0]) for line in proc.stdout.splitlines()
              if line.startswith("test_") and " waited " in line}
    assert sorted(waited) == ["test_a_heavy.py", "test_b_heavy.py"], proc.stdout[-3000:]
    assert sum(e == "pass" for e, _ in events) == 2 + LIGHT_FILES, proc.stdout[-3000:]
    return events, waited


def test_a_heavy_file_that_does_not_fit_goes_later_and_no_worker_waits(tmp_path):
    # xdist's own scheduling hands the second heavy file to the second worker at once: it waits 2 s for memory
    events, waited = _run(_suite(tmp_path / "suite"))
    started = [f for e, f in events if e == "start"]
    assert max(waited.values()) < 1.0, waited
    # the first heavy file and a light one at once; the second heavy one once the first has passed
    assert set(started[:2]) == {"test_a_heavy.py", "test_c_light_0.py"}, started
    assert events.index(("start", "test_b_heavy.py")) > events.index(("pass", "test_a_heavy.py")), events


def test_heavy_files_wait_for_a_venv_build_while_light_ones_run(tmp_path):
    suite = _suite(tmp_path / "suite")
    venvs = suite / ".venvs"
    venvs.mkdir()
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (venvs / "verl.building").write_text(str(build.pid))      # as .ci/make_backbone_env.sh writes it
        events, _ = _run(suite)
    finally:
        build.kill()
        build.wait()
    started = [f for e, f in events if e == "start"]
    # both heavy files start only once the light ones run out (the last two of those may start after them)
    assert min(started.index("test_a_heavy.py"), started.index("test_b_heavy.py")) >= LIGHT_FILES - 2, started
    # with the build over (its process gone, the marker left behind), heavy files go first again
    after = _suite(tmp_path / "after")
    (after / ".venvs").mkdir()
    (after / ".venvs" / "verl.building").write_text(str(build.pid))
    events, _ = _run(after)
    assert ("start", "test_a_heavy.py") in events[:2], events


NICENESS = """import os, subprocess, sys
{heavy}

def test_records_niceness():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0), os.environ.get('RAY_worker_niceness'))"],
                           capture_output=True, text=True)
    with open(os.path.join(os.path.dirname(__file__), "{name}.nice"), "w") as f:
        f.write(child.stdout)
"""


def test_only_the_largest_heavy_files_processes_run_at_full_priority(tmp_path):
    """Where the worker may set its niceness back (root, as in CI), a process that a file of the chain (more than
    half the budget: 5 of 8 GB) starts runs at niceness 0, and one that a light file or a smaller heavy one (1 GB)
    starts at YIELD_NICE, whichever ran first on the worker; elsewhere none is changed."""
    files = (("test_a_light", ""), ("test_b_chain", "PEAK_MEMORY_GB = 5.0"), ("test_c_light", ""),
             ("test_d_small", "PEAK_MEMORY_GB = 1.0"), ("test_e_chain", "PEAK_MEMORY_GB = 5.0"))
    suite = _project(tmp_path / "suite", {f"{name}.py": NICENESS.format(heavy=heavy, name=name)
                                          for name, heavy in files})
    _pytest_n2(suite, 8, "-q")
    nice = {f.stem: f.read_text().split() for f in suite.glob("*.nice")}
    start = [str(os.nice(0)), "None"]       # what this process (and so the suite's workers) started with
    if can_renice():
        # and Ray, started by a chain file's process, gives its workers that niceness (Ray's default: 15 more)
        chain, other = ["0", "0"], [str(YIELD_NICE), "None"]
        assert nice == {"test_a_light": other, "test_b_chain": chain, "test_c_light": other, "test_d_small": other,
                        "test_e_chain": chain}
    else:
        assert all(v == start for v in nice.values()), nice


def test_declared_gb_reads_the_module_constant(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("PEAK_MEMORY_GB = 10.5   # a comment\n")
    assert declared_gb(path) == 10.5
    path.write_text("x = 1\n# PEAK_MEMORY_GB = 3\n")
    assert declared_gb(path) == 0.0
    # every heavy file of this suite is read as it declares
    assert declared_gb(ROOT / "tests" / "test_backbone_vllm.py") == 16.0
