"""How much memory the heavy test files may hold at once (a pytest plugin, registered by tests/conftest.py).

The files that start a backbone's Ray workers or a vLLM server hold several GB each: the verl and Trinity
kill-and-resume tests through vLLM (tests/test_backbone_vllm.py) about 15 GB. Under pytest-xdist (the README's
`pytest -n 3`) three of them can run at once, and on the 24 GB CI machine three did: Ray's memory monitor killed a
Trinity trainer at 96% of the node's memory and the run failed. So such a file declares what it needs,

    PEAK_MEMORY_GB = 16.0   # the most its processes hold at once, all together (PSS, GB)

and a worker takes that much from a budget the workers share before the file's first fixture is made, giving it
back after its last fixture is torn down (an autouse module-scoped fixture: it is set up before, and torn down after,
the file's other module fixtures). Under xdist the scheduler hands a heavy file to a worker when it fits
(tests/ci_scheduler.py), so waiting here is the exception. A file that asks for more than is free waits; a later
file that fits may go first (the cores stay busy), until the first waiter has waited STARVE_S, so a large file is
not passed over for ever. A file asking for more than the whole budget runs alone. Under xdist the processes a light
file, and of a heavy file small enough to run beside another, start niced (YIELD_NICE) where the worker can set its
niceness back for the largest heavy files (`set_priority`).

The budget is `AJET_TEST_MEMORY_GB`, else 90% of the machine's memory (below the 95% at which Ray's memory monitor
kills workers) less 1 GB for each worker: the light tests the other workers run beside the heavy files. On the
24 GB CI machine with 3 workers: 18.2 GB.
Without xdist (one process, one file at a time) nothing is reserved.

Each worker also measures what its files really held: the sum of the proportional set size (PSS,
/proc/PID/smaps_rollup, as the benchmarks measure it) of the worker and all its descendants (`ajet` runs, Ray's
processes, vLLM servers). Reading PSS walks the page tables of every process it counts, in the kernel: about 35 ms of
CPU per GB resident on the 2-core machine, so once a second it took up to half a core per worker beside a heavy file
(a 15 GB tree). The tree's RSS, a counter the kernel keeps, is read every second instead, and PSS is measured when
that RSS has risen PSS_RISE above what it was at the last measurement (at most every PSS_GAP_S), else every
PSS_REFRESH_S: a peak is measured as memory rises to it (PSS <= RSS, and the two rise together), at a few percent of
the cost. The terminal summary lists, per file that declares a figure or held over
2 GB, the measured peak beside the declared one and the seconds it waited, so the declarations can be kept true;
and, to see where the suite's time goes, the worker that ran it, when it began and ended (seconds since the
suite's start) and how busy the machine's cores were over the whole suite (/proc/stat: below 100%, cores sat idle
while files waited; at 100%, only less work shortens the run). Every file's CPU seconds are counted too (the
worker's and those of the processes it started and waited for, `os.times`), and the summary lists the largest.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

from benchmarks.engines import process_tree_memory

WAIT_LIMIT_S = 45 * 60      # a file waiting longer than this fails (the whole CI run has 90 minutes)
STARVE_S = 300.0            # after the first waiter has waited this long, no later one goes before it
POLL_S = 2.0                # how often a waiting worker looks again
SAMPLE_S = 1.0              # how often the RSS of a worker's process tree is read (cheap: /proc/<pid>/statm)
PSS_GAP_S = 2.0             # the least time between two PSS measurements (each walks every page table it counts)
PSS_REFRESH_S = 15.0        # the most time between two PSS measurements
PSS_RISE = 0.02             # a PSS measurement is due once the tree's RSS is this share above the last one's
REPORT_OVER_GB = 2.0        # undeclared files listed in the summary once they held this much
YIELD_NICE = 10             # under xdist, the niceness of every file but the chain's (`set_priority`)
_RAY_NICENESS = os.environ.get("RAY_worker_niceness")     # as the suite found it (`set_priority`)


def _total_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no MemTotal in /proc/meminfo")


def budget_gb(workers: int) -> float:
    """The GB the heavy files of one run may hold together: `AJET_TEST_MEMORY_GB`, else 0.9 x the machine's
    memory less 1 GB per xdist worker."""
    if env := os.environ.get("AJET_TEST_MEMORY_GB"):
        return float(env)
    return 0.9 * _total_gb() - 1.0 * workers


# --- measuring: the PSS of a process and its descendants ---

def tree_pss_gb(root: int) -> float:
    """The PSS of process `root` and all its descendants together, in GB (2**30 bytes): the benchmarks' measure
    (`benchmarks.engines.process_tree_memory`)."""
    return process_tree_memory(root)[1] / 2**30


def tree_rss_gb(root: int) -> float:
    """The RSS of process `root` and all its descendants, summed, in GB: the kernel's counters (/proc/<pid>/statm),
    no page walk; a page two of them share counts twice, so it is at least their PSS. Processes gone meanwhile are
    skipped. Raises psutil.NoSuchProcess when `root` does not exist."""
    import psutil

    top = psutil.Process(root)
    total = 0
    for p in [top, *top.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**30


class _Sampler(threading.Thread):
    """Measures the worker's process tree (the module docstring says when); `peak` is the largest PSS figure since
    `reset()`, `measured` how many PSS measurements were made (each reading of RSS is not one)."""

    def __init__(self, pid: int | None = None) -> None:
        super().__init__(name="ajet-memory-sampler", daemon=True)
        self.peak = 0.0
        self.measured = 0
        self._pid = os.getpid() if pid is None else pid
        self._lock = threading.Lock()
        self._generation = 0            # a figure measured before the last reset() is not counted after it
        self._last = (time.monotonic(), tree_rss_gb(self._pid))     # (when, the tree's RSS then): the last PSS
        self.stop = threading.Event()   # set: the thread ends

    def _pss(self, rss: float) -> float:
        """The tree's PSS now (GB), its RSS being `rss`."""
        now = tree_pss_gb(self._pid)
        self._last = (time.monotonic(), rss)
        self.measured += 1
        return now

    def reset(self) -> None:
        now = self._pss(tree_rss_gb(self._pid))
        with self._lock:
            self._generation += 1
            self.peak = now

    def due(self, rss: float) -> bool:
        """Whether a PSS measurement is due, the tree's RSS being `rss` GB now."""
        since = time.monotonic() - self._last[0]
        return since >= PSS_REFRESH_S or (since >= PSS_GAP_S and rss > self._last[1] * (1 + PSS_RISE))

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            generation = self._generation
            if self.due(rss := tree_rss_gb(self._pid)):
                now = self._pss(rss)
                with self._lock:
                    if generation == self._generation:
                        self.peak = max(self.peak, now)


# --- the shared budget: a JSON file under a file lock ---

class Budget:
    """The reservations of the run's workers: {"held": {worker: [gb, file, pid]}, "queue": [[worker, pid, since],
    ...]} (`since`: time.time() when it began to wait)."""

    def __init__(self, path: Path, total_gb: float, worker: str) -> None:
        self.path, self.total_gb, self.worker = path, total_gb, worker
        self.lock = FileLock(str(path) + ".lock")

    def _load(self) -> dict:
        state = json.loads(self.path.read_text()) if self.path.exists() else {"held": {}, "queue": []}
        # a worker that died (crashed, killed) holds nothing and waits for nothing
        state["held"] = {w: h for w, h in state["held"].items() if _alive(h[2])}
        state["queue"] = [q for q in state["queue"] if _alive(q[1])]
        return state

    def _save(self, state: dict) -> None:     # whole or not at all: a worker killed mid-write leaves the old state
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)

    def acquire(self, gb: float, file: str) -> float:
        """Takes `gb` for `file`, waiting while the others hold too much. A waiter that fits goes before earlier
        ones that do not, unless the first of them has waited STARVE_S: then they go in order, so a large file is
        not passed over for ever. Returns the seconds waited. Raises `pytest.fail` after WAIT_LIMIT_S."""
        t0 = time.monotonic()
        while True:
            with self.lock:
                state = self._load()
                queue = state["queue"]
                if self.worker not in [q[0] for q in queue]:
                    queue.append([self.worker, os.getpid(), time.time()])
                held = sum(h[0] for h in state["held"].values())
                fits = not state["held"] or held + gb <= self.total_gb
                head, head_since = queue[0][0], queue[0][2]
                if fits and (head == self.worker or time.time() - head_since < STARVE_S):
                    state["queue"] = [q for q in queue if q[0] != self.worker]
                    state["held"][self.worker] = [gb, file, os.getpid()]
                    self._save(state)
                    return time.monotonic() - t0
                self._save(state)
            if time.monotonic() - t0 > WAIT_LIMIT_S:
                self.release()
                pytest.fail(f"{file} waited {WAIT_LIMIT_S} s for {gb} GB of the tests' {self.total_gb:.1f} GB "
                            f"memory budget; held: {state['held']}. Lower what the heavy files declare "
                            "(PEAK_MEMORY_GB) or set AJET_TEST_MEMORY_GB.", pytrace=False)
            time.sleep(POLL_S)

    def release(self) -> None:
        with self.lock:
            state = self._load()
            state["held"].pop(self.worker, None)
            state["queue"] = [q for q in state["queue"] if q[0] != self.worker]
            self._save(state)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- the plugin ---

_sampler: _Sampler | None = None
_budget: Budget | None = None
_records: list[list] = []       # [file, declared GB, peak GB, seconds waited, worker, began, ended (time.time())]
_suite_start: tuple[float, tuple[int, int]] | None = None      # the controller's: time.time(), cpu_jiffies()
_cpu: list[list] = []           # [file, CPU seconds of the worker and the children it waited for], every file
CPU_TOP = 15                    # files listed by CPU in the summary


def cpu_seconds() -> float:
    """CPU seconds (user + system) this process used, and its children that have been waited for (theirs roll up
    through their own waits: an `ajet` run's workers that it waited for are counted, a daemon re-parented to init
    is not)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all the machine's cores since boot (/proc/stat's first line; busy: all but idle
    and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def pytest_configure(config: pytest.Config) -> None:
    global _sampler, _suite_start
    if not os.path.exists("/proc/self/smaps_rollup"):
        return                          # not Linux: nothing measured, nothing reserved
    if not hasattr(config, "workerinput"):
        _suite_start = (time.time(), cpu_jiffies())
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return                          # the xdist controller: it runs no test
    _sampler = _Sampler()
    _sampler.start()


def can_renice() -> bool:
    """Whether this process may set its niceness back to 0 after raising it: root, or an RLIMIT_NICE of 20 (the
    lowest niceness a process may set itself is 20 - RLIMIT_NICE)."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def in_chain(declared: float | None, budget: float) -> bool:
    """Whether a file declaring `declared` GB (None: light) belongs to the chain: more than half the `budget` GB, so
    no two such files run at once and, one after another, they are the suite's longest path (on the 2-core machine
    the backbones and vLLM servers through vLLM, Trinity's main job, the vLLM engine's and verl's vLLM rollout's
    files: about 1,000-1,700 s of the suite's 1,750-1,800)."""
    return declared is not None and declared > budget / 2


def set_priority(chain: bool) -> None:
    """Under xdist, where it can be undone (`can_renice`): the niceness of the calling thread (the worker's, which
    runs the tests and starts their processes, which inherit it) for the next file: 0 for one of the chain
    (`in_chain`), YIELD_NICE for any other, so that the chain gets the cores first and the rest takes what it leaves
    (with equal shares a chain file beside two workers of light files took 1.4-2x as long as beside one). Ray starts
    its workers 15 nicer than the process that started Ray (its `worker_niceness`, `RAY_worker_niceness`), which
    put the chain's trainers below every light file's process: for the chain that variable is 0 (the rest keep
    Ray's default)."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) > 1 and can_renice():
        os.setpriority(os.PRIO_PROCESS, 0, 0 if chain else YIELD_NICE)     # 0: this thread (Linux)
        if chain:
            os.environ["RAY_worker_niceness"] = "0"
        elif _RAY_NICENESS is None:
            os.environ.pop("RAY_worker_niceness", None)
        else:
            os.environ["RAY_worker_niceness"] = _RAY_NICENESS


def _shared_budget(tmp_path_factory: pytest.TempPathFactory) -> Budget | None:
    """The run's budget, in the folder the xdist workers' temporary folders share (pytest removes it with them);
    None without xdist."""
    global _budget
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if _budget is None and workers > 1:
        path = tmp_path_factory.getbasetemp().parent / "ajet-test-memory.json"
        _budget = Budget(path, budget_gb(workers), os.environ.get("PYTEST_XDIST_WORKER", "gw?"))
    return _budget


@pytest.fixture(scope="module", autouse=True)
def _memory_reservation(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Holds the module's PEAK_MEMORY_GB of the shared budget while its fixtures and tests run."""
    declared = getattr(request.module, "PEAK_MEMORY_GB", None)
    file = request.module.__name__.rsplit(".", 1)[-1] + ".py"
    waited = 0.0
    if declared is not None and _shared_budget(tmp_path_factory) is not None:
        waited = _budget.acquire(float(declared), file)
    set_priority(_budget is not None and in_chain(declared, _budget.total_gb))
    began, cpu0 = time.time(), cpu_seconds()
    if _sampler is not None:
        _sampler.reset()
    try:
        yield
    finally:
        if _budget is not None and declared is not None:
            _budget.release()
        _cpu.append([file, round(cpu_seconds() - cpu0, 1)])
        if _sampler is not None and (declared is not None or _sampler.peak >= REPORT_OVER_GB):
            _records.append([file, declared, round(_sampler.peak, 2), round(waited, 1),
                             os.environ.get("PYTEST_XDIST_WORKER", "-"), began, time.time()])


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):          # an xdist worker: hand the records to the controller
        session.config.workeroutput["ajet_memory"] = json.dumps(_records)
        session.config.workeroutput["ajet_cpu"] = json.dumps(_cpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:           # the xdist controller, as each worker ends
    _records.extend(json.loads(getattr(node, "workeroutput", {}).get("ajet_memory", "[]")))
    _cpu.extend(json.loads(getattr(node, "workeroutput", {}).get("ajet_cpu", "[]")))


def pytest_terminal_summary(terminalreporter) -> None:
    if _cpu:
        _cpu_summary(terminalreporter)
    if not _records:
        return
    tr = terminalreporter
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) or getattr(tr.config.option, "numprocesses", 0)
    tr.section("memory of the heavy test files (PSS of each worker's process tree, GB)")
    if isinstance(workers, int) and workers > 1:
        tr.write_line(f"budget shared by the {workers} workers: {budget_gb(workers):.1f} GB")
    t0 = _suite_start[0] if _suite_start else min(r[5] - r[3] for r in _records)
    for file, declared, peak, waited, worker, began, ended in sorted(_records, key=lambda r: -r[2]):
        over = "  MORE THAN DECLARED" if declared is not None and peak > declared else ""
        tr.write_line(f"{file:45s} peak {peak:6.2f}  declared {declared if declared is not None else '-':>5}"
                      f"  waited {waited:6.1f} s  {worker} ran {began - t0:5.0f}-{ended - t0:5.0f} s{over}")
    if _suite_start is not None:
        busy, total = (now - then for now, then in zip(cpu_jiffies(), _suite_start[1]))
        tr.write_line(f"the machine's {os.cpu_count()} cores were {100 * busy / max(total, 1):.0f}% busy over the "
                      f"suite's {time.time() - t0:.0f} s")


def _cpu_summary(tr) -> None:
    """The CPU seconds of all the files together and of the CPU_TOP largest, with their share."""
    total = sum(c for _, c in _cpu)
    tr.section("CPU of the test files (each worker and the processes it waited for, seconds)")
    tr.write_line(f"all {len(_cpu)} files: {total:.0f} s")
    for file, c in sorted(_cpu, key=lambda r: -r[1])[:CPU_TOP]:
        tr.write_line(f"{file:45s} {c:8.1f} s  {100 * c / max(total, 1e-9):4.1f}%")
