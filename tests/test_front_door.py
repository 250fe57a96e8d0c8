"""What a newcomer meets first: `ajet --help` lists every command, an unknown command lists them, a known key at
the wrong level names where it belongs, every config field (also those set by the loader) is described, and the
LICENSE that the metadata names is in the wheel. Console checks run the real `python -m ajet` with its output in
a file."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from pydantic import BaseModel

import ajet.config
from tests.test_packaging import wheel  # noqa: F401  (the wheel built from the checkout, a fixture)

ROOT = Path(__file__).resolve().parent.parent
# the commands a user can run, as the docs name them (docs/getting-started.md and the command pages)
COMMANDS = ["serve", "gateway", "doctor", "eval", "view", "show", "sft", "export", "harnesses", "init",
            "backbone-env"]


def _ajet(args: list[str], cwd: Path, timeout_s: float = 120) -> tuple[int, str]:
    """`python -m ajet ARGS` in `cwd` with stdout and stderr to a file; returns (exit status, the output)."""
    out = cwd / "ajet_out.txt"
    with out.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "ajet", *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                            timeout=timeout_s).returncode
    return rc, out.read_text()


def test_help_lists_every_command(tmp_path):
    rc, text = _ajet(["--help"], tmp_path)
    assert rc == 0, text
    listed = text.split("commands:", 1)[1]
    for name in COMMANDS + ["gateway rollback"]:
        assert f"\n  ajet {name} " in listed, (name, listed)


def test_unknown_command_lists_the_commands(tmp_path):
    rc, text = _ajet(["serv", "--conf", "x.yaml"], tmp_path)
    assert rc == 2 and "Traceback" not in text, text
    line = text.strip().splitlines()[-1]
    assert "unknown command `serv`" in line and "did you mean `serve`" in line, line
    for name in COMMANDS:
        assert name in line, (name, line)


def test_a_key_at_the_wrong_level_names_where_it_belongs(tmp_path):
    (tmp_path / "conf.yaml").write_text("workflow: wf.py:W\ndata: {train_path: t.jsonl}\nlr: 1.0e-5\n"
                                        "algorithm: {total_steps: 3}\nmax_tokens: 64\n")
    rc, text = _ajet(["--conf", "conf.yaml"], tmp_path)
    assert rc == 2 and "Traceback" not in text, text
    assert "unknown key `lr`. It belongs under `algorithm` (`algorithm.lr`)." in text
    assert "unknown key `algorithm.total_steps`. It belongs under `trainer` (`trainer.total_steps`)." in text
    assert "`rollout.max_tokens`" in text and "`llm_judge.max_tokens`" in text   # every place the key lives


def test_every_config_field_has_a_description_including_the_loaders():
    """docs/configuration.md covers the settings; a field the loader sets (excluded from dumps) is described in
    ajet/config/ all the same."""
    models = [m for _, m in inspect.getmembers(ajet.config, inspect.isclass)
              if issubclass(m, BaseModel) and m.__module__.startswith("ajet.config.")]
    missing = [f"{m.__name__}.{name}" for m in models for name, info in m.model_fields.items()
               if not (info.description or "").strip()]
    assert missing == []
    assert "load_config" in ajet.config.AjetConfig.model_fields["config_dir"].description


def test_license_is_apache_2_and_in_the_wheel_with_the_main_job_and_the_venv_builder(wheel):
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    names = zipfile.ZipFile(wheel).namelist()
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    assert licenses, names
    assert zipfile.ZipFile(wheel).read(licenses[0]).decode() == text
    for shipped in ("ajet/init_templates/example_math_agent/math_agent.yaml",
                    "ajet/init_templates/example_math_agent/math_workflow.py",
                    "ajet/init_templates/example_math_agent/tasks/train.jsonl", "ajet/backbone_env/make_backbone_env.sh",
                    "ajet/backbone_env/constraints-verl.txt", "ajet/backbone_env/constraints-trinity.txt",
                    "ajet/backbone_env/uv_cpu_torch.sh"):
        assert shipped in names, (shipped, [n for n in names if "init_templates" in n or "backbone_env" in n])


def test_init_math_writes_the_main_job_as_the_tutorial_holds_it(tmp_path):
    rc, text = _ajet(["init", "job", "--kind", "math"], tmp_path)
    assert rc == 0, text
    assert "cd job && ajet --conf math_agent.yaml --backbone=debug" in text
    assert "ajet view experiments/math_agent" in text
    tutorial = ROOT / "tutorial" / "example_math_agent"
    for rel in ("math_agent.yaml", "math_workflow.py", "calculator.py", "tasks/train.jsonl", "tasks/val.jsonl",
                "tasks/test.jsonl"):
        assert (tmp_path / "job" / rel).read_text() == (tutorial / rel).read_text(), rel
    cfg = ajet.config.load_config(tmp_path / "job" / "math_agent.yaml")   # its relative paths resolve there
    assert cfg.experiment_name == "math_agent" and ajet.config.resolve_path(cfg, cfg.data.train_path).is_file()


def test_backbone_env_from_the_wheel_reads_the_installed_metadata(wheel, tmp_path):
    """The shipped script, run from an extracted wheel (no checkout around it), takes its requirements from the
    installed ajet's metadata: `--cache-path` names a cached venv keyed on them."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = site / "ajet" / "backbone_env" / "make_backbone_env.sh"
    env = {**os.environ, "AJET_CI_VENV_CACHE": str(tmp_path / "cache"), "AJET_PYTHON": sys.executable,
           "AJET_PACKAGE": str(site / "ajet")}
    out = subprocess.run(["bash", str(script), "trinity", "--cache-path"], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(re.escape(str(tmp_path / "cache")) + r"/trinity-[0-9a-f]{16}", out.stdout.strip()), out.stdout
    rc, text = _ajet(["backbone-env", "verl", "--cache-path"], tmp_path)   # the command, through this checkout
    assert rc == 0 and re.search(r"/verl-[0-9a-f]{16}$", text.strip()), text


def test_a_missing_backbone_points_to_the_command(tmp_path):
    from ajet.backbones.base import load_backbone
    from ajet.errors import BackboneUnavailable

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    with pytest.raises(BackboneUnavailable, match=r"`ajet backbone-env verl` builds \.venvs/verl"):
        load_backbone("verl")
