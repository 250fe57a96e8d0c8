import os

# torch's threads under pytest-xdist: the workers share the machine's cores, so each worker, and what it starts
# (`ajet` runs, Ray workers, backbone venvs' processes: they inherit it), uses cores / workers OpenMP threads, one
# each on the 2-core CI machine with the README's `-n 3`. With torch's default (a thread per core in every process)
# each parallel region waits for threads the other workers hold off the cores: on that machine a bundle of CPU-bound
# test files ran in 53 s instead of 56-65 s. Set before torch is imported (OpenMP reads it once); an
# OMP_NUM_THREADS already set is kept.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))

# The end-of-run plots (matplotlib, about 2 s of CPU a run) are left out of the suite's hundred-odd runs; the tests
# that check them turn them on (AJET_PLOTS=1 in their run's environment: tests/tiny_experiment.py and others).
os.environ.setdefault("AJET_PLOTS", "0")

import pytest  # noqa: E402

from tests.tiny_model import build_tiny_model  # noqa: E402

# the tests that use a backbone venv run first under pytest-xdist, last without it (tests/ci_backbone_tests.py)
from tests.ci_backbone_tests import pytest_collection_modifyitems  # noqa: F401

# under pytest-xdist each worker's next file is chosen so that the heavy ones (below) fit beside each other without
# waiting (tests/ci_scheduler.py)
from tests.ci_scheduler import pytest_xdist_make_scheduler  # noqa: E402, F401

# the heavy test files (backbones, vLLM servers) take their memory from a budget the xdist workers share, and the
# summary lists what each really held (tests/memory_budget.py)
from tests.memory_budget import (  # noqa: E402, F401
    _memory_reservation, pytest_configure, pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama + BPE tokenizer with ajet's tool chat template, saved in HF format."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (one per test module: a module may patch it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_experiment(tiny_model_dir, tmp_path_factory):
    """An experiment folder written by a real 2-step `ajet` run of the tiny model (tests/tiny_experiment.py):
    merged two-call samples with advantages, and one task whose episodes all fail."""
    from tests.tiny_experiment import make_tiny_experiment

    return make_tiny_experiment(tmp_path_factory.mktemp("tiny_experiment"), tiny_model_dir)
