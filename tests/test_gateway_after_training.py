"""`ajet gateway` after its last update, and fine-tuning on a gateway's folder, on the tiny model.

One gateway runs `trainer.total_steps: 1`: two rated sessions train the one update, then the gateway keeps
serving (`gateway.after_training: serve`, the default): requests are answered by version 1 and recorded,
feedback on them is accepted, a rollback is still done, and SIGTERM stops it cleanly; a copy of its folder
resumed with `--steps 2` trains the sessions rated after training at step 2. Its folder then holds two
trained sessions (trajectories.sqlite) and two sessions rated after training (gateway.sqlite only): `ajet sft
--from` and `ajet export --format hf` read all four, with the tokens each session's recorded call holds in
gateway.sqlite (read here with plain SQL)."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import textwrap
from pathlib import Path

import pytest

from ajet.cli import main
from tests.test_gateway import Gateway

TRAIN = (("What is 3 plus 4?", 1.0), ("Say hello.", 0.0))
AFTER = (("What is 12 times 3?", 1.0), ("Name a colour.", 0.25))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """Run the gateway as the module docstring says; returns what the test checks."""
    tmp = tmp_path_factory.mktemp("after_training")
    (tmp / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        rollout: {{num_repeat: 2, max_tokens: 6}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: 1, tasks_per_step: 1, save_freq: 1, tensorboard: false}}
        gateway: {{session_idle_s: 600}}
    """))
    exp = tmp / "exp"
    g = Gateway(tmp / "conf.yaml", exp)
    out: dict = {"tmp": tmp, "exp": exp, "trained": [], "after": []}
    try:
        for text, reward in TRAIN:
            _, h = g.chat(text)
            out["trained"].append(h["x-ajet-session"])
            assert g.http.post("/v1/feedback", json={"session_id": h["x-ajet-session"], "reward": reward}).status_code == 200
            assert g.http.post(f"/v1/sessions/{h['x-ajet-session']}/close").status_code == 200
        g.wait_for(lambda: any("training done" in line for line in g.lines))
        out["health"] = g.http.get("/healthz").json()
        for text, reward in AFTER:
            r, h = g.chat(text)
            out["after"].append(h["x-ajet-session"])
            out.setdefault("versions", []).append(h["x-ajet-policy-version"])
            out.setdefault("feedback", []).append(
                g.http.post("/v1/feedback", json={"response_id": r.id, "reward": reward}).status_code)
            out.setdefault("closed", []).append(
                g.http.post(f"/v1/sessions/{h['x-ajet-session']}/close").json()["state"])
        out["rollback"] = g.http.post("/v1/admin/rollback", json={"to": 0})
        out["health_after_rollback"] = g.http.get("/healthz").json()
        out["alive"] = g.proc.poll() is None
        g.proc.send_signal(signal.SIGTERM)
        out["returncode"] = g.proc.wait(120)
    finally:
        g.stop()
    out["lines"] = "".join(g.lines)
    return out


def test_the_gateway_keeps_serving_after_its_last_update(served):
    assert served["health"] == {"status": "ok", "policy_version": 1, "training": "done"}
    assert served["versions"] == ["1", "1"]                  # answered by the last served policy
    assert served["feedback"] == [200, 200] and served["closed"] == ["rated", "rated"]   # kept, not trained
    assert served["rollback"].status_code == 200, served["rollback"].text
    assert served["health_after_rollback"]["policy_version"] == 0
    assert served["alive"] and served["returncode"] == 0, served["lines"][-3000:]
    assert "gateway: stopped" in served["lines"]
    with sqlite3.connect(served["exp"] / "gateway.sqlite") as db:   # the feedback after training is durable
        rewards = dict(db.execute("SELECT session_id, reward FROM feedback"))
    assert [rewards[s] for s in served["after"]] == [r for _, r in AFTER]
    with sqlite3.connect(served["exp"] / "trajectories.sqlite") as db:
        trained = {r[0] for r in db.execute("SELECT episode_id FROM trained")}
    assert trained == set(served["trained"])


def _recorded(exp: Path) -> dict[str, tuple[list[int], list[int], float]]:
    """session id -> (prompt ids, completion ids, latest reward) of every rated single-call session, by plain SQL."""
    with sqlite3.connect(exp / "gateway.sqlite") as db:
        calls = {sid: json.loads(rec) for sid, rec in db.execute("SELECT session_id, record FROM calls")}
        rewards = dict(db.execute("SELECT session_id, reward FROM feedback ORDER BY rowid"))
    return {sid: (calls[sid]["prompt_ids"], calls[sid]["completion_ids"], r) for sid, r in rewards.items()}


def test_sft_from_a_gateway_folder_trains_the_recorded_tokens(served, monkeypatch):
    from ajet.backbones.debug.backbone import DebugBackbone

    recorded = _recorded(served["exp"])
    assert set(recorded) == set(served["trained"]) | set(served["after"])
    fed: list = []
    original = DebugBackbone.update

    def spy(self, samples):
        fed.append(sorted((s.prompt_ids, s.response_ids, s.loss_mask) for s in samples))
        return original(self, samples)

    monkeypatch.setattr(DebugBackbone, "update", spy)
    monkeypatch.chdir(served["tmp"])
    assert main(["sft", "--from", str(served["exp"]), "--min-reward", "1", "--conf", "conf.yaml", "--backbone=debug",
                 "--exp-dir", str(served["tmp"] / "sft"), "--steps", "1"]) == 0
    # reward >= 1: one trained session and one rated after training, each its one call's exact tokens
    expected = sorted((p, c, [1] * len(c)) for p, c, r in recorded.values() if r >= 1)
    assert len(expected) == 2 and fed == [expected]


def test_export_of_a_gateway_folder_reads_back_with_datasets(served):
    import datasets

    out = served["tmp"] / "hf"
    assert main(["export", "--format", "hf", str(served["exp"]), str(out)]) == 0
    ds = datasets.load_from_disk(str(out))
    recorded = _recorded(served["exp"])
    assert sorted(ds["episode_id"]) == sorted(recorded)
    for row in ds:
        prompt, completion, reward = recorded[row["episode_id"]]
        assert (row["prompt_ids"], row["completion_ids"], row["reward"]) == (prompt, completion, reward)
        assert row["loss_mask"] == [1] * len(completion) and row["input_ids"] == prompt + completion
        assert row["messages"][0]["role"] == "user" and row["messages"][-1]["role"] == "assistant"
    # the sessions no update took come after the trained ones, marked step 0
    steps = dict(zip(ds["episode_id"], ds["step"]))
    assert [steps[s] for s in served["trained"]] == [1, 1] and [steps[s] for s in served["after"]] == [0, 0]


def test_resume_with_more_steps_trains_the_sessions_rated_after_training(served, tmp_path):
    exp = tmp_path / "exp"
    shutil.copytree(served["exp"], exp)
    g = Gateway(served["tmp"] / "conf.yaml", exp, "--resume", "--steps", "2")
    try:
        g.wait_for(lambda: sum("training done" in line for line in g.lines) == 1)
    finally:
        g.stop()
    with sqlite3.connect(exp / "trajectories.sqlite") as db:
        by_step = {s: {e for (e,) in db.execute("SELECT episode_id FROM trained WHERE step = ?", (s,))} for s in (1, 2)}
    assert by_step == {1: set(served["trained"]), 2: set(served["after"])}
