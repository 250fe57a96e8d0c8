"""Config loading: defaults, overrides, and errors that name the key, the file and the fix."""

import textwrap

import pytest

from ajet.config import load_config, resolve_path
from ajet.errors import ConfigError

BASE = """
workflow: wf.py:W
data: {train_path: tasks.jsonl}
"""


def _write(tmp_path, text):
    p = tmp_path / "conf.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(_write(tmp_path, BASE), {"trainer.total_steps": 3, "backbone": "debug"})
    assert cfg.rollout.num_repeat == 4 and cfg.algorithm.clip_ratio_low == 0.2
    assert cfg.trainer.total_steps == 3 and cfg.model.path == "smollm2-135m-instruct"
    assert cfg.config_dir == tmp_path.resolve()
    assert str(cfg.exp_path()) == "experiments/ajet"
    (tmp_path / "tasks.jsonl").write_text("{}")
    assert resolve_path(cfg, "tasks.jsonl") == tmp_path.resolve() / "tasks.jsonl"


def test_unknown_key_suggests_the_right_one(tmp_path):
    p = _write(tmp_path, BASE + "rollout: {num_repaet: 8}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "`rollout.num_repaet`" in msg and "did you mean `rollout.num_repeat`?" in msg
    assert "max_tokens" in msg  # lists what is allowed


def test_wrong_type_and_bad_value_name_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE + "trainer: {total_steps: many}\nrollout: {temperature: -1}\n"))
    msg = str(e.value)
    assert "`trainer.total_steps`" in msg and "'many'" in msg
    assert "`rollout.temperature`" in msg and "greater than 0" in msg


def test_missing_file_missing_key_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="missing required key `workflow`"):
        load_config(_write(tmp_path, "data: {train_path: x}\n"))
    with pytest.raises(ConfigError, match=r"conf.yaml:\d+: invalid YAML"):
        load_config(_write(tmp_path, "workflow: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
