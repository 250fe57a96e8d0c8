"""tutorial/example_live_gateway: its config loads as a gateway config, and its client script (the unmodified
OpenAI SDK plus httpx) runs one conversation and its feedback against a real `ajet gateway` subprocess: the
tutorial's own config with only the model swapped for the tiny model fixture."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ajet.config import load_config
from ajet.errors import ConfigError
from ajet.judges.math_answer import extract_final_number
from tests.test_gateway import SECRET, Gateway

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tutorial" / "example_live_gateway"


def test_the_tutorial_config_loads_as_a_gateway_config():
    conf = TUTORIAL / "gateway.yaml"
    assert "data" not in yaml.safe_load(conf.read_text())                # no task file: live traffic
    cfg = load_config(conf, mode="gateway")
    assert cfg.data.task_sources() == []
    for mode in ("train", "serve", "eval"):                             # the modes that read tasks need one
        with pytest.raises(ConfigError, match="missing required key `data`"):
            load_config(conf, mode=mode)
        with pytest.raises(ConfigError, match=r"name exactly one task source: .* \(got none\)"):
            load_config(conf, {"data.shuffle": False}, mode=mode)
    assert load_config(conf, {"data.shuffle": False}, mode="sft").data.task_sources() == []
    assert cfg.model.path == "smollm2-135m-instruct"                    # the embedded real model
    assert (cfg.gateway.port, cfg.gateway.on_no_feedback, cfg.gateway.n) == (8766, "drop", 1)
    assert cfg.trainer.total_steps >= 10_000                            # a long-running gateway
    assert not cfg.algorithm.dynamic_sampling.enabled                   # the gateway refuses it


def test_the_tutorial_client_sends_one_request_and_its_feedback(tmp_path, tiny_model_dir):
    data = yaml.safe_load((TUTORIAL / "gateway.yaml").read_text())
    data["model"] = {"path": tiny_model_dir, "max_model_len": 256}
    data["rollout"]["max_tokens"] = 8
    data["trainer"]["tensorboard"] = False
    conf = tmp_path / "gateway.yaml"
    conf.write_text(yaml.safe_dump(data))
    exp = tmp_path / "exp"
    g = Gateway(conf, exp)
    try:
        run = subprocess.run([sys.executable, str(TUTORIAL / "client.py"), "--base-url", g.url, "--n", "1",
                              "--seed", "3"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "AJET_SECRET": SECRET})
        assert run.returncode == 0, run.stdout + run.stderr
        (line,) = run.stdout.splitlines()
        out = json.loads(line)
        state = g.http.get(f"/v1/sessions/{out['session_id']}").json()
    finally:
        g.stop()
    train = [json.loads(t) for t in (ROOT / "tutorial/example_math_agent/tasks/train.jsonl").read_text().splitlines()]
    assert out["question"] in {t["query"] for t in train}
    assert out["reward"] in (0.0, 1.0) and out["feedback"]["session_id"] == out["session_id"]
    assert out["policy_version"] == "0"
    assert state["state"] == "rated" and state["reward"] == out["reward"]          # closed, then rated
    assert state["responses"] == {out["response_id"]: 0}
    with sqlite3.connect(exp / "gateway.sqlite") as db:                            # acknowledged = durable
        assert db.execute("SELECT session_id, response_id, reward, source FROM feedback").fetchall() == [
            (out["session_id"], None, out["reward"], "client")]
        assert db.execute("SELECT session_id FROM closes").fetchall() == [(out["session_id"],)]
        (record,) = [json.loads(r) for (r,) in db.execute("SELECT record FROM calls")]
    recorded = record["response_message"]["content"] or ""
    assert recorded == out["answer"] and record["messages"][-1]["content"] == out["question"]
    expected = next(t["answer"] for t in train if t["query"] == out["question"])
    assert out["reward"] == (1.0 if extract_final_number(recorded) == expected else 0.0)    # the reward sent is right
