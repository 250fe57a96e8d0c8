"""`ajet gateway --resume` after `kill -9` serves what was served, on the tiny model in a subprocess (the debug
engine and the one training loop, as shipped; the gate off, so every update is served at once).

The first gateway serves versions 1, 2 and 3 (two rated sessions per update), is rolled back to 2, and serves a
new 3; a fixed greedy request's answer and logprobs are taken from it, then it is killed. The trainer's own
checkpoint interval (`trainer.save_freq` 100) is never reached, so only the versions' checkpoints can carry the
state across. The resumed gateway must serve version 3 with the same answer and logprobs (bit for bit), keep the
version history with its rollback, and count the eight sessions as trained. It then trains a fifth update and is
killed by the test's fault point right after the update, before the trainer writes its ledger; the third start
must serve version 4 and count its two sessions as trained. Every session is trained exactly once over the three
attempts (the trajectory store's `trained` rows), and with `keep_versions: 2` only the checkpoints of the two
versions served last are left."""

from __future__ import annotations

import os
import signal
import sqlite3
import textwrap
from pathlib import Path

from ajet.faults import ENV as KILL_AT
from tests.test_gateway import Gateway
from tests.test_gateway_gate import _greedy

PROBE = "The quick brown fox: what is 0 plus 1?"


def _conf(tmp_path: Path, tiny_model_dir: str) -> Path:
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        rollout: {{num_repeat: 2, max_tokens: 6, sampling_policy: client}}
        algorithm: {{lr: 0.01}}
        trainer: {{total_steps: 5, tasks_per_step: 1, save_freq: 100, tensorboard: false}}
        gateway: {{session_idle_s: 600, gate: {{keep_versions: 2}}}}
    """))
    return tmp_path / "conf.yaml"


def _rate_two(g: Gateway, tag: str) -> list[str]:
    """Two sessions (one update's group), each with one answer, rated and closed; returns their ids."""
    sessions = []
    for reward in (1.0, 0.0):
        _, h = g.chat(f"Session {tag} with reward {reward}: what is 2 plus 2?")
        sid = h["x-ajet-session"]
        assert g.http.post("/v1/feedback", json={"session_id": sid, "reward": reward}).status_code == 200
        assert g.http.post(f"/v1/sessions/{sid}/close").status_code == 200
        sessions.append(sid)
    return sessions


def _wait_served(g: Gateway, rows: int, version: int) -> None:
    """Until the versions history has `rows` rows and `version` is served."""
    g.wait_for(lambda: len(g.http.get("/v1/admin/versions").json()["versions"]) == rows
               and g.http.get("/healthz").json()["policy_version"] == version, timeout_s=600)


def _trained_rows(exp: Path) -> dict[str, int]:
    """episode id -> how many `trained` rows name it, over every attempt (trajectories.sqlite)."""
    with sqlite3.connect(exp / "trajectories.sqlite") as db:
        return dict(db.execute("SELECT episode_id, COUNT(*) FROM trained GROUP BY episode_id").fetchall())


def _live(exp: Path) -> dict[str, list]:
    from tests.test_gateway import _ledger

    return _ledger(exp)


def _checkpoints(exp: Path) -> list[str]:
    """The checkpoint folders of the experiment (none: [])."""
    root = exp / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) if root.is_dir() else []


def test_kill_9_then_resume_serves_the_served_version_and_never_trains_a_session_twice(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    conf, exp = _conf(tmp_path, tiny_model_dir), tmp_path / "exp"
    g = Gateway(conf, exp)
    sessions: list[str] = []
    try:
        start = _greedy(g, PROBE)
        for version in (1, 2, 3):
            sessions += _rate_two(g, f"v{version}")
            _wait_served(g, version + 1, version)
        rolled = g.http.post("/v1/admin/rollback", json={"to": 2})
        assert rolled.status_code == 200 and rolled.json()["status"] == "done", rolled.text
        sessions += _rate_two(g, "v3-again")
        _wait_served(g, 6, 3)
        g.wait_for(lambda: all(_live(exp).get(s) for s in sessions), timeout_s=300)
        before = _greedy(g, PROBE)
        history = g.http.get("/v1/admin/versions").json()
        kept_before = _checkpoints(exp)
    finally:
        os.kill(g.proc.pid, signal.SIGKILL)
        g.stop()
    assert before[2] == 3 and before[1] != start[1], (start, before)   # another policy than the start's
    assert [(v["version"], v["how"]) for v in history["versions"]] == [
        (0, "start"), (1, "ungated"), (2, "ungated"), (3, "ungated"), (2, "rollback"), (3, "ungated")]

    monkeypatch.setenv(KILL_AT, "update@5")       # the next update: killed before the trainer's ledger
    g = Gateway(conf, exp, "--resume")
    try:
        health = g.http.get("/healthz").json()
        after = _greedy(g, PROBE)
        resumed = g.http.get("/v1/admin/versions").json()
        states = {s: g.http.get(f"/v1/sessions/{s}").json()["state"] for s in sessions}
        late = g.http.post("/v1/feedback", json={"session_id": sessions[0], "reward": 0.5})
        newer = _rate_two(g, "v4")
        assert g.proc.wait(600) == -signal.SIGKILL, "".join(g.lines)[-3000:]
    finally:
        g.stop()
    assert health["policy_version"] == 3, "".join(g.lines)[-3000:]
    assert after == before                                             # the same weights, logprobs bit for bit
    assert resumed["versions"] == history["versions"] and resumed["gate"] == history["gate"]
    assert set(states.values()) == {"trained"}, states
    assert late.status_code == 409                                     # trained: feedback cannot change it

    monkeypatch.delenv(KILL_AT)
    g = Gateway(conf, exp, "--resume")
    try:
        health = g.http.get("/healthz").json()
        final = g.http.get("/v1/admin/versions").json()
        states = {s: g.http.get(f"/v1/sessions/{s}").json()["state"] for s in newer}
    finally:
        g.stop()
    assert health["policy_version"] == 4, "".join(g.lines)[-3000:]
    assert [(v["version"], v["how"]) for v in final["versions"]][-2:] == [(3, "ungated"), (4, "ungated")]
    assert set(states.values()) == {"trained"}, states
    rows = _trained_rows(exp)
    assert rows == {s: 1 for s in sessions + newer}, rows              # each trained once, over three attempts
    live = _live(exp)
    assert all(len(live[s]) == 1 for s in sessions + newer), live      # and that update is in the lineage
    assert kept_before == ["step_2", "step_4"], kept_before            # versions 2 and the new 3 (keep_versions 2)
    assert _checkpoints(exp) == ["step_4", "step_5"]                   # versions 3 and 4
    assert final["kept"] == [3, 4]


class _LoraLayout:
    """Writes what the debug backbone writes with `model.lora`: the adapter, the merged weights beside it, the
    optimizer state and the tokenizer."""

    def save_checkpoint(self, path: Path) -> None:
        (path / "adapter").mkdir(parents=True)
        (path / "adapter" / "adapter_model.safetensors").write_bytes(b"a" * 10)
        for name in ("model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
            (path / name).write_bytes(b"w" * 1000)
        for name in ("backbone_state.pt", "config.json", "tokenizer.json"):
            (path / name).write_bytes(b"s")


def test_a_lora_version_is_written_without_the_merged_weights(tmp_path):
    from ajet import checkpoint
    from ajet.gateway.versions import VersionStore

    versions = VersionStore(tmp_path, keep=2, adapter_only=True)
    folder = versions.write(_LoraLayout(), version=5, step=7, attempt=0, trained=[("s-1", 0)])
    assert folder == tmp_path / "checkpoints" / "step_7"
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == [
        "adapter_model.safetensors", "backbone_state.pt", "config.json", "tokenizer.json", "trainer_state.pt"]
    state = checkpoint.load_trainer_state(folder)
    assert state["step"] == 7 and state["rollout"] == {"gateway": {"version": 5, "step": 7, "attempt": 0,
                                                                   "trained": [["s-1", 0]]}}
    full = checkpoint.save(tmp_path, 8, _LoraLayout(), {"step": 8})   # the trainer's own: everything
    assert (full / "model.safetensors").is_file()
    assert versions.folder(5) == folder and versions.kept() == [5]   # step_8 names no gateway version
