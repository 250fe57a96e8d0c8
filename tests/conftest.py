import pytest

from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama + BPE tokenizer with ajet's tool chat template, saved in HF format."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))
