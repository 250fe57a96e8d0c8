import pytest

from tests.tiny_model import build_tiny_model

# the tests that use a backbone venv run first under pytest-xdist, last without it (tests/ci_backbone_tests.py)
from tests.ci_backbone_tests import pytest_collection_modifyitems  # noqa: F401


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
