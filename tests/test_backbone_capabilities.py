"""The one capability contract of the backbones (ajet/backbones/capabilities.py): every config field is declared
for every backbone; a setting the chosen backbone does not honour is a ConfigError naming the key, the backbone
and the backbones that do honour it, raised by the real entry point before any backbone package is imported;
the support table of docs/backbones.md is the one the declarations generate."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from ajet.backbones import base
from ajet.backbones import capabilities as cap
from ajet.cli import main
from ajet.config import AjetConfig, TrainerConfig, load_config
from ajet.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
BACKBONES = ["debug", "verl", "trinity"]


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of `model` by its YAML path, recursing into each field that holds a pydantic model (`M` or
    `M | None`); written here, apart from the module's own walk, so that it checks that walk too."""
    out = []
    for name, info in model.model_fields.items():
        if info.exclude is True:
            continue
        path = prefix + (info.alias or name)
        ann = info.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] \
            if typing.get_origin(ann) in (typing.Union, types.UnionType) else [ann]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out += [path] + _leaves(args[0], path + ".")
        else:
            out.append(path)
    return out


def _not_declared(backbone: str, model: type[BaseModel] = AjetConfig) -> list[str]:
    """The fields of `model` below which (itself included) `backbone` declares nothing, and no section above them."""
    declared = cap.AJET_SIDE | set(cap.DECLARATIONS[backbone])
    paths = _leaves(model)
    sections = {p.rpartition(".")[0] for p in paths}
    missing = []
    for p in paths:
        parts = p.split(".")
        covered = any(".".join(parts[:i]) in declared for i in range(1, len(parts) + 1))
        below = any(d.startswith(p + ".") for d in declared)    # a section declared leaf by leaf
        if not covered and not (p in sections and below):
            missing.append(p)
    return missing


@pytest.mark.parametrize("backbone", BACKBONES)
def test_every_config_field_is_declared_for_every_backbone(backbone):
    assert _not_declared(backbone) == []
    assert cap.undeclared(backbone) == []           # the module's own walk agrees


def test_the_declarations_are_well_formed():
    # the same backbones everywhere: the config's choice, the loader's table, the declarations
    assert set(typing.get_args(AjetConfig.model_fields["backbone"].annotation)) == set(BACKBONES)
    assert set(base._BACKBONES) == set(cap.DECLARATIONS) == set(BACKBONES)
    paths = set(_leaves(AjetConfig))
    own = set(cap.DECLARATIONS["debug"])
    for b in BACKBONES:
        decl = set(cap.DECLARATIONS[b])
        assert decl == own, f"{b} declares other paths than debug: {sorted(decl ^ own)}"
        assert not decl & cap.AJET_SIDE, f"{b}: both ajet-side and its own: {sorted(decl & cap.AJET_SIDE)}"
    declared = own | cap.AJET_SIDE
    assert declared <= paths, f"declarations of fields that do not exist: {sorted(declared - paths)}"
    nested = [(a, b) for a in declared for b in declared if b.startswith(a + ".")]
    assert nested == [], f"a section and a field inside it both declared: {nested}"
    for b in BACKBONES:
        for path, s in cap.DECLARATIONS[b].items():
            assert s.kind in ("honoured", "translated", "refused"), (b, path)
            assert s.kind == "honoured" or s.note, f"{b}: {path} is {s.kind} without a key or a reason"


class _TrainerWithANewField(TrainerConfig):
    new_knob: bool = True


class _ConfigWithANewField(AjetConfig):
    trainer: _TrainerWithANewField = _TrainerWithANewField()


def test_a_new_field_without_a_declaration_fails_the_walk_and_is_refused_when_set(monkeypatch):
    """A field added to a section without a declaration is reported by the walk for every backbone; at run time
    it is refused once set to a non-default value (never ignored)."""
    for b in BACKBONES:
        assert _not_declared(b, _ConfigWithANewField) == ["trainer.new_knob"]
    assert [cap.undeclared(b, _ConfigWithANewField) for b in BACKBONES] == [["trainer.new_knob"]] * 3
    cfg = _ConfigWithANewField.model_validate({"data": {"train_path": "t.jsonl"}})
    assert [cap.refusals(cfg, b) for b in BACKBONES] == [[], [], []]    # at its default: nothing to refuse
    cfg.trainer.new_knob = False
    for b in BACKBONES:
        (r,) = cap.refusals(cfg, b)
        assert (r.path, r.value, r.honoured_by) == ("trainer.new_knob", False, ())
        assert "no declaration" in r.message() and f"the {b} backbone" in r.message()
    # a declaration removed: the walk names that field
    monkeypatch.delitem(cap.TRINITY, "trainer.async.max_staleness")
    assert _not_declared("trinity") == ["trainer.async.max_staleness"]


# backbone, the YAML that sets what it does not honour, the message's key=value, the backbones that honour it
REFUSED = [
    ("trinity", "trainer: {async: {max_staleness: 2}}", "trainer.async.max_staleness=2", ["debug"]),
    ("trinity", "algorithm: {mini_batches: 2}", "algorithm.mini_batches=2", ["debug", "verl"]),
    ("trinity", "model: {lora: {rank: 4}}", 'model.lora={"rank": 4}', ["debug", "verl"]),
    ("trinity", "algorithm: {loss_scale_factor: 512}", "algorithm.loss_scale_factor=512.0", ["debug", "verl"]),
    ("trinity", "rollout: {top_p: 0.9}", "rollout.top_p=0.9", ["debug"]),
    ("trinity", "verl: {trainer: {nnodes: 2}}", 'verl={"trainer": {"nnodes": 2}}', ["verl"]),
    ("verl", "trainer: {async: {max_staleness: 1}}", "trainer.async.max_staleness=1", ["debug"]),
    ("verl", "trainer: {async: {is_cap: 3.0}}", "trainer.async.is_cap=3.0", ["debug"]),
    ("verl", "algorithm: {episode_weight: sample}", "algorithm.episode_weight=sample", ["debug", "trinity"]),
    ("verl", "algorithm: {distill: {teacher: /t}}", 'algorithm.distill={"teacher": "/t"}', ["debug"]),
    ("verl", "trinity: {algorithm: {policy_loss_fn: gspo}}", 'trinity={"algorithm": {"policy_loss_fn": "gspo"}}',
     ["trinity"]),
    ("debug", "verl: {trainer: {nnodes: 2}}", 'verl={"trainer": {"nnodes": 2}}', ["verl"]),
    ("debug", "trinity: {algorithm: {policy_loss_fn: gspo}}", 'trinity={"algorithm": {"policy_loss_fn": "gspo"}}',
     ["trinity"]),
]


def _write(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "1 + 1", "answer": "2"}\n')
    (tmp_path / "wf.py").write_text("from ajet.workflow import Workflow\nclass W(Workflow):\n    pass\n")
    conf = tmp_path / "c.yaml"
    conf.write_text(textwrap.dedent("""
        workflow: wf.py:W
        data: {train_path: tasks.jsonl}
        model: {path: Qwen/Qwen2.5-0.5B-Instruct}
    """) + extra + "\n")
    return conf


@pytest.mark.parametrize("backbone, extra, setting, honoured_by", REFUSED)
def test_the_cli_refuses_what_the_chosen_backbone_does_not_honour(tmp_path, capsys, backbone, extra, setting,
                                                                  honoured_by):
    """`ajet --conf X --backbone=B` (train) and `ajet serve`: exit 2 with one line naming the key and value, the
    backbone and the backbones that honour it, before the backbone's packages are looked for (trinity and verl
    are not installed here: without the check the error would be the missing package)."""
    conf = _write(tmp_path, extra)
    for command in ([], ["serve"]):
        rc = main([*command, "--conf", str(conf), f"--backbone={backbone}", "--exp-dir", str(tmp_path / "exp")])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert err.startswith(f"ajet: error: {setting}: the {backbone} backbone honours it only "), err
        assert f"honoured by {', '.join(honoured_by)}: remove it, or run with --backbone={honoured_by[0]}" in err
        assert "pip install" not in err and "Traceback" not in err
        assert not (tmp_path / "exp").exists()           # refused before the run made anything


@pytest.mark.parametrize("backbone, extra", [
    ("trinity", "trainer: {async: {max_staleness: 0}}"),     # K = 0: nothing is off-policy
    ("trinity", "algorithm: {mini_batches: 1, episode_weight: sample}\nrollout: {top_p: 1.0}"),
    ("verl", "trainer: {async: {is_cap: 2.0}}\nalgorithm: {episode_weight: episode}"),   # the defaults, written
    ("verl", "verl: {trainer: {nnodes: 2}}"),
    ("trinity", "trinity: {algorithm: {policy_loss_fn: gspo}}"),
])
def test_what_the_backbone_honours_passes_the_check(tmp_path, backbone, extra):
    cfg = load_config(_write(tmp_path, extra), {"backbone": backbone})
    assert cap.refusals(cfg) == []
    cap.check_supported(cfg)


def test_an_honoured_setting_gets_past_the_check_to_the_backbone(tmp_path, capsys):
    """max_staleness 0 on trinity is honoured: the CLI goes on to load the backbone, which (without the trinity
    package, as here) says which extra to install."""
    import importlib.util

    if importlib.util.find_spec("trinity") is not None:
        pytest.skip("trinity is installed: this run would train")
    conf = _write(tmp_path, "trainer: {async: {max_staleness: 0}}")
    rc = main(["--conf", str(conf), "--backbone=trinity", "--exp-dir", str(tmp_path / "exp")])
    assert rc == 2 and "pip install 'ajet[trinity]'" in capsys.readouterr().err


def test_python_callers_of_trainer_run_and_eval_get_the_check(tmp_path):
    """`ajet.trainer.run` and `ajet eval` called from Python (no CLI) refuse a setting the backbone does not honour
    with the same one-line ConfigError, before anything is written (verl is not installed here: without the check
    the error would be the missing package, after the tasks and workflow load)."""
    from ajet.commands import eval as eval_command
    from ajet import trainer

    conf = _write(tmp_path, "algorithm: {distill: {teacher: /t}}")
    cfg = load_config(conf, {"backbone": "verl", "trainer.exp_dir": str(tmp_path / "exp")})
    refused = 'algorithm.distill={"teacher": "/t"}: the verl backbone honours it only '
    with pytest.raises(ConfigError, match="^" + re.escape(refused)):
        trainer.run(cfg)
    with pytest.raises(ConfigError, match="^" + re.escape(refused)):
        eval_command.main(str(conf), data=str(tmp_path / "tasks.jsonl"), backbone="verl", out=str(tmp_path / "eval"))
    assert not (tmp_path / "exp").exists() and not (tmp_path / "eval").exists()


def test_several_refused_settings_are_one_line_each(tmp_path):
    cfg = load_config(_write(tmp_path, "trainer: {async: {max_staleness: 2}}\nalgorithm: {mini_batches: 4}"),
                      {"backbone": "trinity"})
    with pytest.raises(ConfigError) as exc:
        cap.check_supported(cfg)
    lines = str(exc.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["algorithm.mini_batches=4", "trainer.async.max_staleness=2"]
    # the same config is fine for the backbone that honours both
    assert cap.refusals(cfg, "debug") == []


def test_the_trinity_and_verl_translations_read_the_declaration(tmp_path):
    """Called from Python (no CLI), the verl and trinity translations refuse what their declaration refuses,
    whatever `backbone` the config names; `load_backbone(name, cfg)` does before importing the backbone."""
    from ajet.backbones.trinity.config import trinity_dict
    from ajet.backbones.verl.config import verl_overrides

    cfg = load_config(_write(tmp_path, "trainer: {async: {max_staleness: 2}}"))
    with pytest.raises(ConfigError, match=r"^trainer\.async\.max_staleness=2: the trinity backbone"):
        trinity_dict(cfg, "MODEL", str(tmp_path / "ckpt"), 1, on_cpu=True)
    with pytest.raises(ConfigError, match=r"^trainer\.async\.max_staleness=2: the verl backbone"):
        verl_overrides(cfg, cuda=True)
    with pytest.raises(ConfigError, match=r"^trainer\.async\.max_staleness=2: the trinity backbone"):
        base.load_backbone("trinity", cfg)
    assert base.load_backbone("debug", cfg).__name__ == "DebugBackbone"


def test_importing_the_declarations_imports_no_backbone_package():
    code = ("import sys, ajet.backbones.capabilities, ajet.backbones.base; "
            "print(sorted({'torch', 'verl', 'trinity', 'ray', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def _committed_table() -> str:
    text = (ROOT / "docs" / "backbones.md").read_text()
    assert cap.BEGIN in text and cap.END in text, "docs/backbones.md lost its capabilities markers"
    return text.split(cap.BEGIN, 1)[1].split(cap.END, 1)[0].strip("\n")


def test_the_docs_table_is_the_generated_one():
    """Regenerate with `python -m ajet.backbones.capabilities --write docs/backbones.md`."""
    assert _committed_table() == cap.markdown_table()


def test_the_generated_table_follows_the_declarations(tmp_path, monkeypatch):
    table = cap.markdown_table()
    assert ("| `trainer.async.max_staleness` | yes: with K > 0 the loss is importance-corrected token by token | "
            "**only when unset or 0**:") in table
    assert "| `algorithm.mini_batches` | yes | yes: ajet splits the step by episode" in table
    assert "`actor_rollout_ref.actor.optim.lr`" in table and "`algorithm.optimizer.lr`" in table
    assert "- `proxy`: `host`, `max_body_bytes`, `accepted_models`, `retry_after_s`" in table
    # a changed declaration changes the table, and --write puts it between the markers
    doc = tmp_path / "b.md"
    doc.write_text(f"intro\n{cap.BEGIN}\nstale\n{cap.END}\noutro\n")
    monkeypatch.setitem(cap.TRINITY, "trainer.async.max_staleness", cap.HONOURED)
    assert cap.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"intro\n{cap.BEGIN}\n| config key |") and text.endswith(f"\n{cap.END}\noutro\n")
    row = next(line for line in text.splitlines() if line.startswith("| `trainer.async.max_staleness`"))
    assert row.endswith("| yes |")
    assert cap.write_docs(doc) is False                  # already up to date
    with pytest.raises(ValueError, match="markers"):
        (tmp_path / "none.md").write_text("no markers")
        cap.write_docs(tmp_path / "none.md")
