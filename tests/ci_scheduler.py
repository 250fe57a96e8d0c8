"""Which test file each pytest-xdist worker runs next (a pytest plugin, registered by tests/conftest.py).

The README's test command runs the suite on 3 workers with `--dist loadfile`: a file is one unit of work. xdist's
own scheduler hands the units out in collection order and gives a worker its next unit while the current one still
runs (when 2 or fewer of its tests are left). A heavy file (one that declares PEAK_MEMORY_GB: a backbone's Ray
workers or a vLLM server, tests/memory_budget.py) handed to a worker while the others hold too much of the memory
budget made that worker wait: in CI two of the three workers waited 932 s and 471 s, the cores 10% idle, while light
files were still queued that they could have run.

This scheduler hands out the same units but chooses which, when a worker asks for work:
- the largest heavy file (most GB declared, then collection order) whose GB fit in the budget beside what the other
  workers' heavy files hold, unless this worker still runs a heavy file of its own (its next heavy one could not
  start before that ends; another worker may get it first) or a venv is still being built (.venvs/<name>.building:
  CI builds them while the suite starts, and every heavy file runs code in one);
- else the next light file in collection order;
- else (only heavy files are left) the largest, and the worker waits for its memory (or its venv) as before.
A worker must always be given a next file: xdist's worker starts a test only once it knows the test after it (or
that none follows), so a worker given nothing would hold back its current file's last test.
What a worker's heavy files hold is the largest GB among its units not yet finished (a worker runs one file at a
time). The workers still take the memory from the shared budget themselves (tests/memory_budget.py), which this
plan only keeps from making them wait. The budget is the workers' (`memory_budget.budget_gb`).

Only for `--dist loadfile` (pyproject's addopts); any other mode keeps xdist's own scheduler.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

from tests.memory_budget import budget_gb

_DECLARED = re.compile(r"^PEAK_MEMORY_GB\s*(?::\s*float\s*)?=\s*([0-9.]+)", re.M)


def declared_gb(path: Path) -> float:
    """The PEAK_MEMORY_GB a test file declares (a module-level `PEAK_MEMORY_GB = <number>`), else 0 (light)."""
    try:
        match = _DECLARED.search(path.read_text(encoding="utf-8"))
    except OSError:
        return 0.0
    return float(match.group(1)) if match else 0.0


def venv_build_running(venvs: Path) -> bool:
    """Whether a venv build runs: a `<venvs>/<name>.building` file names a live process (.ci/make_backbone_env.sh,
    .ci/make_vllm_env.sh write it while they build)."""
    for marker in venvs.glob("*.building"):
        try:
            os.kill(int(marker.read_text()), 0)
        except (OSError, ValueError):
            continue
        return True
    return False


class MemoryAwareScheduling(LoadFileScheduling):
    """xdist's `--dist loadfile` scheduling, with the choice of each worker's next file made as the module docstring
    says; node ids are relative to the run's root folder, whose `.venvs` holds the venvs."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.root = Path(config.rootpath)
        self.venvs = self.root / ".venvs"
        self._gb: dict[str, float] = {}

    def gb(self, scope: str) -> float:
        """The GB the file `scope` (a node id's file part) declares; 0 for a light one."""
        if scope not in self._gb:
            self._gb[scope] = declared_gb(self.root / scope)
        return self._gb[scope]

    def held_gb(self, node) -> float:
        """The GB `node`'s unfinished files hold: the largest any of them declares (one file at a time)."""
        return max((self.gb(scope) for scope, unit in self.assigned_work.get(node, {}).items()
                    if not all(unit.values())), default=0.0)

    def _budget(self) -> float:
        return budget_gb(len(self.nodes))

    def pick(self, node) -> str:
        """The file `node` runs next (module docstring). Called only while files are queued."""
        others = sum(self.held_gb(n) for n in self.nodes if n is not node)
        heavy = sorted((s for s in self.workqueue if self.gb(s) > 0), key=lambda s: -self.gb(s))   # stable
        if heavy and self.held_gb(node) == 0 and not venv_build_running(self.venvs):
            for scope in heavy:
                if others + self.gb(scope) <= self._budget():
                    return scope
        # a light file; else, only heavy ones left, the largest, whose worker waits for its memory (or its venv)
        return next((s for s in self.workqueue if self.gb(s) == 0), heavy[0] if heavy else None)

    def _assign_work_unit(self, node) -> None:
        scope = self.pick(node)
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`MemoryAwareScheduling` for `--dist loadfile`; None (xdist's own) for any other mode."""
    return MemoryAwareScheduling(config, log) if config.getvalue("dist") == "loadfile" else None
