"""The config's checks across sections are its models' validators: a config loaded (or built in Python) for a
command (`load_config(..., mode=)`, `AjetConfig.for_mode`) is refused with one line naming the keys, and the
defaults only a command resolves (the gateway's advantage estimator, the servers' proxy host) are resolved at
validation, in a new config: the loaded one is never changed."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from ajet.config import AjetConfig, load_config
from ajet.errors import ConfigError

SECRET = "s" * 24


def _conf(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "1 + 1", "answer": "2"}\n')
    conf = tmp_path / "c.yaml"
    conf.write_text(textwrap.dedent("""
        workflow: wf.py:W
        data: {train_path: tasks.jsonl}
    """) + textwrap.dedent(extra) + "\n")
    return conf


def test_gateway_defaults_are_resolved_in_a_new_config_and_the_loaded_one_is_unchanged(tmp_path):
    cfg = load_config(_conf(tmp_path, f"gateway: {{host: 0.0.0.0, secret: {SECRET}}}"))
    g = cfg.for_mode("gateway")
    assert (g.algorithm.adv_estimator, g.proxy.host, g.mode) == ("reinforce_plus_plus", "0.0.0.0", "gateway")
    assert (cfg.algorithm.adv_estimator, cfg.proxy.host, cfg.mode) == ("grpo", "127.0.0.1", "train")
    assert g.config_dir == cfg.config_dir == tmp_path and g.for_mode("gateway") is g
    g.trainer.total_steps = 3                      # a later assignment keeps what the mode resolved
    assert (g.algorithm.adv_estimator, g.proxy.host) == ("reinforce_plus_plus", "0.0.0.0")

    best_of = load_config(_conf(tmp_path, "judge: j.py:judge\ngateway: {n: 2}"), mode="gateway")
    assert best_of.algorithm.adv_estimator == "grpo"          # best-of-N candidates share a prompt
    chosen = load_config(_conf(tmp_path, "algorithm: {adv_estimator: rloo}"), mode="gateway")
    assert chosen.algorithm.adv_estimator == "rloo"           # the config's own choice stands
    served = load_config(_conf(tmp_path, f"serve: {{host: 0.0.0.0, secret: {SECRET}}}"), mode="serve")
    assert served.proxy.host == "0.0.0.0" and served.algorithm.adv_estimator == "grpo"


@pytest.mark.parametrize("mode, extra, message", [
    ("gateway", "gateway: {host: 0.0.0.0}", "gateway.host '0.0.0.0' is reachable from other machines: set "
                                            "gateway.secret (or AJET_SECRET)"),
    ("gateway", "gateway: {n: 3}", "gateway.n is 3 (best-of-N) but the config names no `judge`"),
    ("gateway", "gateway: {on_no_feedback: judge}", "gateway.on_no_feedback is `judge` but the config names no "
                                                    "`judge`"),
    ("gateway", "algorithm: {dynamic_sampling: {enabled: true}}", "algorithm.dynamic_sampling.enabled refills "
                                                                  "zero-variance same-prompt groups"),
    ("gateway", "gateway: {gate: {mode: eval}}", "gateway.gate.mode is `eval` but data.val_path is not set"),
    ("gateway", "gateway: {gate: {mode: replay}}", "gateway.gate.mode is `replay` but the config names no `judge`"),
    ("serve", "serve: {host: 10.1.2.3}", "serve.host '10.1.2.3' is reachable from other machines: set serve.secret"),
    ("train", "trainer: {val_freq: 2}", "trainer.val_freq is set but data.val_path is not"),
])
def test_each_rule_of_a_mode_is_one_line_naming_the_keys(tmp_path, monkeypatch, mode, extra, message):
    monkeypatch.delenv("AJET_SECRET", raising=False)
    conf = _conf(tmp_path, extra)
    with pytest.raises(ConfigError) as exc:
        load_config(conf, mode=mode)
    lines = str(exc.value).splitlines()
    assert lines[0] == f"{conf}:" and len(lines) == 2 and lines[1].startswith(message), lines
    if mode != "train":
        cfg = load_config(conf)                    # the same file is fine for training ...
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            cfg.for_mode(mode)                     # ... and refused for the command that needs it
        with pytest.raises(ValueError, match=re.escape(message)):   # built in Python: pydantic's error
            AjetConfig(**{**cfg.model_dump(by_alias=True, exclude_unset=True), "mode": mode})


def test_the_secret_may_come_from_the_environment_and_eval_needs_no_val_path_for_val_freq(tmp_path, monkeypatch):
    monkeypatch.setenv("AJET_SECRET", SECRET)
    assert load_config(_conf(tmp_path, "gateway: {host: 0.0.0.0}"), mode="gateway").proxy.host == "0.0.0.0"
    assert load_config(_conf(tmp_path, "trainer: {val_freq: 2}"), mode="eval").trainer.val_freq == 2   # --data


def test_serve_local_workers_need_a_workflow_and_sft_needs_its_own_folder(tmp_path):
    conf = _conf(tmp_path, "serve: {local_workers: 2}")
    conf.write_text(conf.read_text().replace("workflow: wf.py:W\n", ""))
    with pytest.raises(ConfigError, match="serve.local_workers needs a `workflow`"):
        load_config(conf, mode="serve")
    with pytest.raises(ConfigError, match="is also this run's experiment folder: give the SFT run its own"):
        load_config(_conf(tmp_path), {"sft.from_dir": str(tmp_path / "run"), "trainer.exp_dir": str(tmp_path / "run")})


def test_the_cli_loads_the_config_for_its_command(tmp_path, capsys, monkeypatch):
    """`ajet serve` / `ajet gateway` refuse what their mode refuses in one line naming the file, before anything
    runs; the same file trains (`ajet --conf` would get past the config)."""
    from ajet.cli import main

    monkeypatch.delenv("AJET_SECRET", raising=False)
    conf = _conf(tmp_path, "serve: {host: 10.1.2.3}\ngateway: {host: 10.1.2.3}")
    for command in ("serve", "gateway"):
        rc = main([command, "--conf", str(conf), "--exp-dir", str(tmp_path / "exp")])
        err = capsys.readouterr().err
        assert rc == 2 and f"{conf}:\n{command}.host '10.1.2.3' is reachable from other machines" in err, err
        assert "Traceback" not in err and not (tmp_path / "exp").exists()
    assert load_config(conf).serve.host == "10.1.2.3"
