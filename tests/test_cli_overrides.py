"""`KEY=VALUE` overrides after `--conf`: the parser, the same checks as the YAML's own keys, every command that reads
a config, and a real run that they change."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ajet.cli import _parse, build_parser, main
from ajet.config import load_config, parse_overrides
from ajet.errors import ConfigError
from tests.tiny_experiment import WORKFLOW

BASE = """
workflow: wf.py:W
data: {train_path: tasks.jsonl}
trainer: {total_steps: 4}
"""
AJET = [shutil.which("ajet")] if shutil.which("ajet") else [sys.executable, "-m", "ajet"]


def _write(folder: Path, text: str = BASE, name: str = "conf.yaml") -> Path:
    p = folder / name
    p.write_text(textwrap.dedent(text))
    return p


def _ajet(*args: str, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(AJET + list(args), capture_output=True, text=True, timeout=timeout_s, cwd=cwd)


def test_values_are_read_as_yaml():
    got = parse_overrides(["a.b=[1, 2]", "t=true", "n=null", "e=", "f=0.7", "s='5'", "eq=a=b", "w=wf.py:W",
                           "m={x: 1}", "h.claude-code.version=1.0.3", "d.train.0.weight=2"])
    assert got == {"a.b": [1, 2], "t": True, "n": None, "e": None, "f": 0.7, "s": "5", "eq": "a=b", "w": "wf.py:W",
                   "m": {"x": 1}, "h.claude-code.version": "1.0.3", "d.train.0.weight": 2}
    assert parse_overrides(["k=1", "k=2"]) == {"k": 2}     # the later wins


@pytest.mark.parametrize("word", ["foo", "=3", "a..b=1", ".a=1", "a.=1", "1a=2", " =2"])
def test_malformed_override_is_refused(word):
    with pytest.raises(ConfigError, match="is not an override: write KEY=VALUE"):
        parse_overrides([word])


def test_value_that_is_not_yaml_is_refused():
    with pytest.raises(ConfigError, match=r"override `x=\[1,2`: the value is not valid YAML"):
        parse_overrides(["x=[1,2"])


def test_overrides_are_validated_like_the_yamls_keys(tmp_path):
    conf = _write(tmp_path)
    cfg = load_config(conf, parse_overrides(["trainer.total_steps=2", "rollout.temperature=0.7",
                                             "engine.kind=vllm", "trainer.loggers=[console, jsonl]"]))
    assert (cfg.trainer.total_steps, cfg.rollout.temperature, cfg.engine.kind) == (2, 0.7, "vllm")
    assert cfg.trainer.loggers == ["console", "jsonl"]
    with pytest.raises(ConfigError) as typo_on_the_command_line:
        load_config(conf, parse_overrides(["trainer.total_stepz=2"]))
    with pytest.raises(ConfigError) as typo_in_the_yaml:
        load_config(_write(tmp_path, BASE.replace("total_steps: 4", "total_stepz: 2"), "typo.yaml"))
    cli, yml = str(typo_on_the_command_line.value), str(typo_in_the_yaml.value)
    assert cli.startswith("command line: unknown key `trainer.total_stepz`. did you mean `trainer.total_steps`?")
    assert cli.removeprefix("command line: ") == yml.removeprefix(f"{tmp_path / 'typo.yaml'}: ")
    with pytest.raises(ConfigError, match=r"`trainer.total_steps`: Input should be a valid integer.*'abc'.* \(from "
                                          r"the command line\)"):
        load_config(conf, parse_overrides(["trainer.total_steps=abc"]))


def test_list_items_by_index(tmp_path):
    conf = _write(tmp_path, """
        workflow: wf.py:W
        data: {train: [{name: a, path: a.jsonl}, {name: b, path: b.jsonl}]}
    """)
    cfg = load_config(conf, parse_overrides(["data.train.1.weight=3"]))
    assert [d.weight for d in cfg.data.train] == [1.0, 3.0]
    with pytest.raises(ConfigError, match=r"`data.train` is a list of 2 items; name one by its index, 0 to 1"):
        load_config(conf, parse_overrides(["data.train.2.weight=3"]))
    with pytest.raises(ConfigError, match=r"`data.val_path` is a value, not a section"):
        load_config(conf, parse_overrides(["data.val_path=v.jsonl", "data.val_path.x=1"]))


def test_overrides_between_and_after_the_flags():
    args = _parse(build_parser(), ["--conf", "c.yaml", "a=1", "--steps", "1", "b=2", "--with-ray", "c.d=3"])
    assert (args.steps, args.with_ray, sorted(args.overrides)) == (1, 2, ["a=1", "b=2", "c.d=3"])
    assert _parse(build_parser(), ["--conf", "c.yaml", "--with-ray", "3", "a=1"]).with_ray == 3


@pytest.mark.parametrize("command", [[], ["serve"], ["gateway"], ["eval"], ["sft", "--from", "x"],
                                     ["gateway", "rollback"], ["harnesses"]])
def test_every_command_with_a_config_takes_overrides(tmp_path, capsys, command):
    """A typo'd override key is the did-you-mean error (exit 2) in each: the words reach the loader."""
    conf = _write(tmp_path)
    assert main([*command, "--conf", str(conf), "trainer.total_stepz=2"]) == 2
    assert "did you mean `trainer.total_steps`?" in capsys.readouterr().err


def test_an_override_before_the_flags(tmp_path, capsys):
    assert main(["trainer.total_stepz=2", "--conf", str(_write(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "did you mean `trainer.total_steps`?" in err and "unknown command" not in err


def test_a_flag_and_an_override_of_the_same_key(tmp_path, capsys):
    conf = str(_write(tmp_path))
    assert main(["--conf", conf, "--steps", "2", "trainer.total_steps=3"]) == 2
    assert "--steps and the override `trainer.total_steps=...` both set trainer.total_steps" in capsys.readouterr().err
    assert main(["eval", "--conf", conf, "--n", "2", "eval.n=3"]) == 2
    assert "--n and the override `eval.n=...`" in capsys.readouterr().err


@pytest.mark.parametrize("words, expected", [
    (["trainer.total_stepz=2"], "did you mean `trainer.total_steps`?"),
    (["trainer.total_steps=abc"], "Input should be a valid integer"),
    (["foo"], "`foo` is not an override"),
    (["=3"], "`=3` is not an override"),
])
def test_bad_override_is_one_clean_error(tmp_path, words, expected):
    proc = _ajet("--conf", str(_write(tmp_path)), *words, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ajet: error:") and expected in proc.stderr and "Traceback" not in proc.stderr


def test_overrides_change_a_real_run(tmp_path, tiny_model_dir):
    """The YAML (in its own folder) says 4 steps, its own task file and every logger; the command line says 1 step,
    a task file in the current directory and no tensorboard: the run does what the command line says."""
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "wf.py").write_text(WORKFLOW)
    (folder / "tasks.jsonl").write_text(json.dumps({"task_id": "yaml_task", "query": "What is 1 plus 1?",
                                                    "answer": "2"}) + "\n")
    (tmp_path / "cli_tasks.jsonl").write_text(json.dumps({"task_id": "cli_task", "query": "What is 2 plus 2?",
                                                          "answer": "4"}) + "\n")
    conf = _write(folder, f"""
        workflow: wf.py:ToolLoopWorkflow
        model: {{path: "{tiny_model_dir}", max_model_len: 1024}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 8}}
        trainer: {{total_steps: 4, tasks_per_step: 1, save_freq: 0}}
    """)
    proc = _ajet("--conf", str(conf), "--backbone=debug", "trainer.total_steps=1", "data.train_path=cli_tasks.jsonl",
                 "trainer.loggers=[console, jsonl]", "trainer.exp_dir=exp", "--quiet", cwd=tmp_path, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exp = tmp_path / "exp"
    assert len((exp / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (exp / "tensorboard").exists()
    tasks = {json.loads(line)["task"]["task_id"] for line in (exp / "trajectories.jsonl").read_text().splitlines()}
    assert tasks == {"cli_task"}


def test_overrides_without_a_config_and_the_help(capsys):
    assert main(["harnesses", "trainer.seed=1"]) == 2
    assert "KEY=VALUE overrides change a config: give it with --conf X.yaml" in capsys.readouterr().err
    for command in (["eval"], ["serve"], ["gateway", "rollback"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert "KEY=VALUE" in capsys.readouterr().out
