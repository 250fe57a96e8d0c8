"""The heavy test files' shared memory budget (tests/memory_budget.py): who waits, who goes first, and that the
measurement sees memory a child process holds."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from tests import memory_budget
from tests.memory_budget import Budget, tree_pss_gb


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(memory_budget, "POLL_S", 0.05)
    monkeypatch.setattr(memory_budget, "WAIT_LIMIT_S", 5)    # a wrong budget fails the test, not hangs it


def _taker(budget_path, worker: str, gb: float, log: list, done: threading.Event | None = None):
    """A thread standing for xdist worker `worker`: takes `gb`, logs when, holds until `done` is set."""
    def body():
        Budget(budget_path, 16.0, worker).acquire(gb, f"{worker}.py")
        log.append(worker)
        if done is not None:
            done.wait(10)
            Budget(budget_path, 16.0, worker).release()
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def _wait_until(pred, limit_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < limit_s, "timed out"
        time.sleep(0.02)


def _queue(path) -> list[str]:
    return [q[0] for q in json.loads(path.read_text())["queue"]] if path.exists() else []


def _gw0_holds_10_and_gw1_waits_for_8(path, log: list) -> threading.Event:
    """gw0 takes 10 of 16 GB, then gw1 asks for 8 and waits; returns the event that makes gw0 give its 10 back."""
    release0 = threading.Event()
    _taker(path, "gw0", 10, log, release0)
    _wait_until(lambda: log == ["gw0"])
    _taker(path, "gw1", 8, log)
    _wait_until(lambda: _queue(path) == ["gw1"])
    return release0


def test_a_file_that_does_not_fit_waits_and_a_smaller_one_that_fits_goes_first(tmp_path, fast_poll):
    """gw0 holds 10 of 16 GB. gw1 asks 8 (does not fit) and waits; gw2 then asks 2, which fits, and goes at once
    (the first waiter has not waited STARVE_S). When gw0 gives its 10 back, gw1 goes (8 + 2 <= 16)."""
    path, log = tmp_path / "budget.json", []
    release0 = _gw0_holds_10_and_gw1_waits_for_8(path, log)
    _taker(path, "gw2", 2, log)
    _wait_until(lambda: log == ["gw0", "gw2"])
    time.sleep(0.3)                                         # several polls: gw1 still waits
    assert log == ["gw0", "gw2"] and _queue(path) == ["gw1"]
    release0.set()
    _wait_until(lambda: len(log) == 3)
    held = json.loads(path.read_text())["held"]
    assert {w: h[0] for w, h in held.items()} == {"gw1": 8, "gw2": 2}


def test_once_the_first_waiter_has_waited_long_enough_no_one_passes_it(tmp_path, fast_poll, monkeypatch):
    """As above, but gw1 has waited STARVE_S when gw2 asks: gw2 waits behind it (else a stream of small files could
    keep a large one out for ever), and goes after it."""
    monkeypatch.setattr(memory_budget, "STARVE_S", 0.2)
    path, log = tmp_path / "budget.json", []
    release0 = _gw0_holds_10_and_gw1_waits_for_8(path, log)
    time.sleep(0.3)
    _taker(path, "gw2", 2, log)
    _wait_until(lambda: _queue(path) == ["gw1", "gw2"])
    time.sleep(0.3)
    assert log == ["gw0"]
    release0.set()
    _wait_until(lambda: len(log) == 3)
    assert log == ["gw0", "gw1", "gw2"]


def test_a_file_larger_than_the_budget_runs_alone(tmp_path, fast_poll):
    path, log = tmp_path / "budget.json", []
    release = threading.Event()
    _taker(path, "gw0", 1, log, release)
    _wait_until(lambda: log == ["gw0"])
    _taker(path, "gw1", 20, log)                            # more than all 16: only when nothing else is held
    _wait_until(lambda: _queue(path) == ["gw1"])
    time.sleep(0.3)
    assert log == ["gw0"]
    release.set()
    _wait_until(lambda: log == ["gw0", "gw1"])


def test_what_a_dead_worker_held_is_free(tmp_path, fast_poll):
    """A worker that crashed while holding memory, or while first in the queue, must not block the others until
    the wait limit."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"held": {"gw0": [15, "crashed.py", dead.pid]},
                                "queue": [["gw2", dead.pid, time.time() - 3600]]}))   # nor what it waited for
    waited = Budget(path, 16.0, "gw1").acquire(8, "next.py")
    assert waited < 5


def test_the_measurement_counts_a_childs_memory():
    """A child that holds 400 MB (written, so resident) raises this process tree's PSS by about that much."""
    before = tree_pss_gb(memory_budget.os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys,time; b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        grown = tree_pss_gb(memory_budget.os.getpid()) - before
    finally:
        child.kill()
        child.wait()
    assert 0.38 <= grown <= 0.5, grown                       # 400 MiB = 0.39 GB, plus the child's interpreter


GROWER = """
import sys, time
blocks = []
for _ in range(4):                      # 4 x 100 MB, written (resident), 0.6 s apart, then held
    b = bytearray(100 * 2**20)
    b[::4096] = b"x" * len(b[::4096])
    blocks.append(b)
    print(len(blocks), flush=True)
    time.sleep(0.6)
time.sleep(30)
"""


def test_the_sampler_measures_a_rise_to_its_peak_and_little_else(monkeypatch):
    """The sampler reads the tree's RSS every tick and measures PSS only as RSS rises (or after PSS_REFRESH_S): a
    child growing to 400 MB in four steps is measured at its peak, within a few measurements, and 3 s of a steady
    tree (30 ticks) add at most 2 (the worker's own memory may grow meanwhile, a step's measurement may come late
    on a loaded machine). A sampler that measured PSS at every tick made ~25 measurements in the rise and ~30 in the
    steady part; one that ignored the rise never saw the child's memory."""
    monkeypatch.setattr(memory_budget, "SAMPLE_S", 0.1)
    monkeypatch.setattr(memory_budget, "PSS_GAP_S", 0.3)
    monkeypatch.setattr(memory_budget, "PSS_REFRESH_S", 120.0)
    sampler = memory_budget._Sampler()
    sampler.reset()
    base, first = sampler.peak, sampler.measured
    sampler.start()
    child = subprocess.Popen([sys.executable, "-c", GROWER], stdout=subprocess.PIPE, text=True)
    try:
        assert [child.stdout.readline().strip() for _ in range(4)] == ["1", "2", "3", "4"]
        deadline = time.monotonic() + 10                       # the last step measured (a loaded machine: seconds)
        while sampler.peak - base < 0.38 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        risen = sampler.measured - first
        grown = sampler.peak - base
        time.sleep(3.0)                                        # steady: the child's RSS does not rise
        steady = sampler.measured - first - risen
    finally:
        sampler.stop.set()
        child.kill()
        child.wait()
        sampler.join(5)
    assert 0.38 <= grown <= 0.5, grown                         # 400 MiB = 0.39 GB, plus the child's interpreter
    assert 1 <= risen <= 10, risen
    assert steady <= 2, steady


HEAVY_FILE = '''
import time

PEAK_MEMORY_GB = 1.0


def test_spins():
    t0 = time.process_time()
    while time.process_time() - t0 < 1.5:     # 1.5 s of CPU: the suite's cores are busy
        pass
'''


def test_the_summary_says_when_each_heavy_file_ran_and_how_busy_the_cores_were(tmp_path):
    """Two files of 1 GB each under a 1.5 GB budget on two xdist workers: the summary lists each file's worker and
    its span (seconds since the suite's start), the second beginning once the first has ended, each file's CPU
    seconds, and the cores' busy share over the suite."""
    from tests.backbone_conformance.venvs import ROOT

    (tmp_path / "conftest.py").write_text(
        "from tests.memory_budget import (  # noqa: F401\n"
        "    _memory_reservation, pytest_configure, pytest_sessionfinish, pytest_terminal_summary,"
        " pytest_testnodedown)\n")
    for name in ("test_heavy_a.py", "test_heavy_b.py"):
        (tmp_path / name).write_text(HEAVY_FILE)
    env = {**memory_budget.os.environ, "AJET_TEST_MEMORY_GB": "1.5", "PYTHONPATH": str(ROOT),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}          # xdist alone: the other plugins' imports take seconds
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist.plugin", "-n", "2", "--dist", "loadfile",
                           "-p", "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("test_heavy_") and " ran " in line:
            name, rest = line.split(maxsplit=1)
            worker, span = rest.split(" ran ")
            began, ended = (float(x) for x in span.removesuffix(" s").split("-"))
            rows[name] = (worker.split()[-1], began, ended)
    assert sorted(rows) == ["test_heavy_a.py", "test_heavy_b.py"], proc.stdout[-3000:]
    assert {w for w, _, _ in rows.values()} == {"gw0", "gw1"}                # one file per worker
    first, second = sorted(rows.values(), key=lambda r: r[1])
    assert 0 <= first[1] and first[2] - first[1] >= 1          # it spun 1.5 s of CPU (whole seconds printed)
    assert second[1] >= first[2]                                # waited for the first's gigabyte
    # each file's CPU: the 1.5 s it spun, counted once per file
    cpu = {line.split()[0]: float(line.split()[1]) for line in proc.stdout.splitlines()
           if line.startswith("test_heavy_") and " ran " not in line}
    assert sorted(cpu) == ["test_heavy_a.py", "test_heavy_b.py"] and all(1.5 <= c < 6 for c in cpu.values()), cpu
    busy = [line for line in proc.stdout.splitlines() if "cores were" in line]
    assert len(busy) == 1, proc.stdout[-3000:]
    share = float(busy[0].split(" were ")[1].split("%")[0])
    assert 0 < share <= 100, busy
