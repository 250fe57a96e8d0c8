"""`model.path` (or `ajet doctor --model`) naming a folder without a model: one line saying what the folder should
hold (config.json, weights, tokenizer files), not a transformers traceback about tokenizer backends."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ajet.errors import ConfigError
from ajet.model import load_model, load_tokenizer
from tests.tiny_experiment import WORKFLOW


def _run(args: list[str], cwd: Path) -> tuple[int, str]:
    """`python -m ajet ARGS` in `cwd`, stdout and stderr to a file; returns (exit status, the output)."""
    out = cwd / "out.txt"
    with out.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "ajet", *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                            timeout=180).returncode
    return rc, out.read_text()


def _error_line(rc: int, text: str) -> str:
    assert rc == 2, text
    assert "Traceback" not in text and "sentencepiece" not in text, text
    return text.strip().splitlines()[-1]


@pytest.fixture
def not_a_model(tmp_path) -> Path:
    folder = tmp_path / "my_model"
    folder.mkdir()
    (folder / "README.md").write_text("weights to come\n")
    return folder


def test_training_on_a_folder_without_a_model_says_what_it_needs(not_a_model, tmp_path):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t0", "query": "1 plus 1?", "answer": "2"}) + "\n")
    (tmp_path / "conf.yaml").write_text(yaml.safe_dump({
        "workflow": "wf.py:ToolLoopWorkflow", "model": {"path": "my_model"}, "data": {"train_path": "tasks.jsonl"}}))
    line = _error_line(*_run(["--conf", "conf.yaml", "--steps", "1", "--exp-dir", "exp", "-q"], tmp_path))
    assert line.startswith("ajet: error: ") and "my_model" in line
    for part in ("config.json", "weights", "tokenizer", "README.md"):   # what is missing, and what is there
        assert part in line, line


def test_doctor_on_a_folder_without_a_tokenizer_says_what_it_needs(not_a_model, tmp_path):
    line = _error_line(*_run(["doctor", "--model", str(not_a_model)], tmp_path))
    assert "tokenizer" in line and str(not_a_model) in line, line


def test_a_local_path_that_is_no_folder_is_not_sent_to_the_hub(tmp_path):
    line = _error_line(*_run(["doctor", "--model", "./models/missing"], tmp_path))
    assert "./models/missing" in line and "does not exist" in line, line


def test_tokenizer_only_folder_loads_a_tokenizer_but_no_model(tiny_model_dir, tmp_path):
    """A folder with the tokenizer files but no weights: the tokenizer loads (ajet doctor needs no more), the
    model is refused naming the weights."""
    folder = tmp_path / "tok_only"
    folder.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    assert load_tokenizer(str(folder)).eos_token
    with pytest.raises(ConfigError, match=r"lacks the weights \(model\.safetensors"):
        load_model(str(folder), device="cpu")
    assert load_model(tiny_model_dir, device="cpu") is not None   # the full folder passes the check
