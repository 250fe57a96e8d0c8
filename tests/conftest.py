import pytest

from tests.backbone_conformance import venvs
from tests.tiny_model import build_tiny_model


def pytest_collection_modifyitems(items):
    """The tests that run a backbone venv (their module imports `venv_python`) run last, in their order: CI builds
    those venvs while the rest of the suite runs (.ci/run), and such a test waits for its venv's build."""
    uses_venv = [i for i in items if getattr(getattr(i, "module", None), "venv_python", None) is venvs.venv_python]
    if uses_venv:
        last = set(map(id, uses_venv))
        items[:] = [i for i in items if id(i) not in last] + uses_venv


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
