"""When the tests that use a backbone venv run (a pytest plugin, registered by tests/conftest.py).

Those tests (their module imports `venv_python`: tests/test_backbone_conformance.py,
tests/test_backbone_conformance_trinity.py, tests/test_backbone_main_job.py, tests/test_backbone_main_job_trinity.py)
run verl and Trinity in their own venvs and Ray workers: the slowest files of the suite, and the only ones that need the
venvs that CI builds in the background while the README's test install runs (.ci/run). So:

- under pytest-xdist (the README's test command, `python -m pytest -q -n 3`; pyproject's addopts give
  `--dist loadfile --no-loadscope-reorder`: a file is one unit of work) their files come first in the collection;
  which file each worker runs next is then chosen by tests/ci_scheduler.py, which hands out the heavy ones (these
  among them) as soon as their venvs are built and their memory fits, the rest in this order; a test whose venv is
  still being built waits for it (tests/backbone_conformance/venvs.py);
- in one process (no `-n`) they come LAST, in their order: the rest of the suite runs while the venvs build.
"""

from __future__ import annotations

import pytest

from tests.backbone_conformance import venvs


def uses_backbone_venv(item: pytest.Item) -> bool:
    """Whether `item`'s module imports `venv_python` (it runs code in a backbone venv)."""
    return getattr(getattr(item, "module", None), "venv_python", None) is venvs.venv_python


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backbone = [i for i in items if uses_backbone_venv(i)]
    rest = [i for i in items if not uses_backbone_venv(i)]
    under_xdist = hasattr(config, "workerinput")         # an xdist worker: its collection orders the work units
    items[:] = backbone + rest if under_xdist else rest + backbone
