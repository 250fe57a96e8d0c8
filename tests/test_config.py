"""Config loading: defaults, overrides, and errors that name the key, the file and the fix."""

import pickle
import textwrap
from pathlib import Path

import pytest

from ajet.config import load_config, resolve_path
from ajet.errors import ConfigError, WorkflowLoadError
from ajet.importing import load_object

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
    with pytest.raises(ConfigError, match="missing required key `data`"):
        load_config(_write(tmp_path, "workflow: wf.py:W\n"))
    with pytest.raises(ConfigError, match=r"conf.yaml:\d+: invalid YAML"):
        load_config(_write(tmp_path, "workflow: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


def test_empty_section_overrides_and_all_errors_at_once(tmp_path):
    cfg = load_config(_write(tmp_path, BASE + "rollout:\n"),
                      {"proxy.retry_after_s": 5, "trainer.exp_dir": "/x/{experiment_name}"})
    assert cfg.rollout.num_repeat == 4 and cfg.proxy.retry_after_s == 5  # `rollout:` alone = defaults
    assert cfg.exp_path() == Path("/x/ajet")
    with pytest.raises(ConfigError, match=r"override `data.train_path.x`: `data.train_path` is a value"):
        load_config(_write(tmp_path, BASE), {"data.train_path.x": 1})
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE + "backbone: gpu\nmodel: {dtype: fp8}\n"))
    lines = str(e.value).splitlines()
    assert lines[0].endswith("conf.yaml:") and len(lines) == 3  # one line per error
    assert any("`backbone`" in ln and "'gpu'" in ln and "'debug', 'verl' or 'trinity'" in ln for ln in lines)
    assert any("`model.dtype`" in ln and "'fp8'" in ln for ln in lines)


def test_resolve_path_prefers_the_config_folder_then_cwd(tmp_path, monkeypatch):
    cfg = load_config(_write(tmp_path, BASE))
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_path(cfg, "/abs/t.jsonl") == Path("/abs/t.jsonl")
    assert resolve_path(cfg, "absent.jsonl") == tmp_path.parent / "absent.jsonl"  # not in the config dir


# ---- the `workflow:` / `judge:` entries (ajet.importing) -------------------------------------------
def test_load_object_from_file_and_module(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "wf.py").write_text(
        "from dataclasses import dataclass\n@dataclass\nclass Point:\n    x: int = 1\n")
    Point = load_object("sub/wf.py:Point", base_dir=tmp_path)
    assert pickle.loads(pickle.dumps(Point(3))) == Point(3)  # registered in sys.modules
    assert load_object("sub/wf.py:Point", base_dir=tmp_path) is Point  # loaded once
    monkeypatch.chdir(tmp_path)
    assert load_object("sub/wf.py:Point") is Point  # cwd fallback, same file
    assert load_object("ajet.judges:math_answer_judge").__name__ == "math_answer_judge"


def test_load_object_errors_say_what_was_tried(tmp_path):
    (tmp_path / "wf.py").write_text("class W: pass\n")
    with pytest.raises(WorkflowLoadError, match="not of the form `module:Name`"):
        load_object("wf.py.W")
    with pytest.raises(WorkflowLoadError, match=r"file not found: nope.py \(looked in .*nope.py"):
        load_object("nope.py:W", base_dir=tmp_path)
    with pytest.raises(WorkflowLoadError, match=r"wf.py has no attribute 'V'; it defines: W"):
        load_object("wf.py:V", base_dir=tmp_path)
    (tmp_path / "never_loaded").mkdir()
    (tmp_path / "never_loaded" / "agent_x9.py").write_text("class W: pass\n")
    with pytest.raises(WorkflowLoadError, match=r"no module named 'agent_x9'.*write `agent_x9.py:W`"):
        load_object("agent_x9:W", base_dir=tmp_path / "never_loaded")
