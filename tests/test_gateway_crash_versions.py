"""`kill -9` of `ajet gateway` at every point of an update, then `--resume`: the versions stay crash-consistent.

`ajet gateway` on the tiny model in a subprocess (gate off, so every update is served; serving while training,
as shipped). One experiment folder goes through six starts. Each of the first five pauses at one of the update's
fault points (`AJET_TEST_PAUSE_AT`, ajet/faults.py): after the update trained, mid-way through the version's
checkpoint, after the checkpoint, after the version's `versions` row, after the switch. While it is paused the
test asks the live endpoint a fixed greedy question (its answer, logprobs and `X-Ajet-Policy-Version`), then
sends SIGKILL. After each kill, before the next start, the test reads gateway.sqlite itself: the last `versions`
row is the committed version, and the newest policy version any recorded answer carries.

Every restart must serve the committed version (never one older than an answer some client already got), and
every version must answer the greedy question the same way (logprobs bit for bit) each time it is seen: a
version number never comes back with other weights. Killed before the row, the restart removes the version's
checkpoint and trains the same sessions again; at the end every session is trained once in the lineage, and
`ajet export`'s reader (`read_recorded`) holds each rated session once although the trajectory store holds the
re-taken ones several times.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import textwrap
import time
from pathlib import Path

from ajet.faults import PAUSE_ENV
from tests.test_gateway import Gateway, _ledger
from tests.test_gateway_gate import _greedy
from tests.test_gateway_resume import _rate_two

PROBE = "The quick brown fox: what is 0 plus 1?"
STEPS = 2


def _conf(tmp_path: Path, tiny_model_dir: str) -> Path:
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        rollout: {{num_repeat: 2, max_tokens: 6, sampling_policy: client}}
        algorithm: {{lr: 0.01}}
        trainer: {{total_steps: {STEPS}, tasks_per_step: 1, save_freq: 100, tensorboard: false}}
        gateway: {{session_idle_s: 600, after_training: serve}}
    """))
    return tmp_path / "conf.yaml"


def _paused(g: Gateway, point: str) -> None:
    """Until the gateway says it is paused at `point` (bounded: 600 s)."""
    mark = f"ajet-test: paused at {point}"
    deadline = time.monotonic() + 600
    while not any(mark in line for line in g.lines):
        assert time.monotonic() < deadline and g.proc.poll() is None, "".join(g.lines)[-4000:]
        time.sleep(0.2)


def _durable(exp: Path) -> tuple[int, int]:
    """(the version of the last `versions` row, the newest policy version any recorded answer carries), read from
    gateway.sqlite by the test."""
    with sqlite3.connect(exp / "gateway.sqlite") as db:
        committed = db.execute("SELECT version FROM versions ORDER BY serve_id DESC LIMIT 1").fetchone()[0]
        answered = db.execute("SELECT MAX(policy_version) FROM responses").fetchone()[0]
    return committed, answered


def test_kill_9_at_every_point_of_an_update_then_resume(tmp_path, tiny_model_dir, monkeypatch):
    conf, exp = _conf(tmp_path, tiny_model_dir), tmp_path / "exp"
    seen: dict[int, tuple[str, list[float]]] = {}   # version -> its greedy answer and logprobs, as first seen

    def probe(g: Gateway) -> int:
        text, logprobs, version = _greedy(g, PROBE)
        if version in seen:                        # a version number always names the same weights
            assert (text, logprobs) == seen[version], (version, seen[version], (text, logprobs))
        seen[version] = (text, logprobs)
        return version

    # (pause point, whether the test rates two new sessions for that start's update)
    plan = [("gw_update@1", True), ("checkpoint@1", False), ("gw_checkpoint@1", False), ("gw_record@1", False),
            ("gw_publish@2", True), (None, False)]
    sessions: list[str] = []
    expected = 0
    for i, (point, rate) in enumerate(plan):
        if point is None:
            monkeypatch.delenv(PAUSE_ENV, raising=False)
        else:
            monkeypatch.setenv(PAUSE_ENV, point)
        g = Gateway(conf, exp, *(["--resume"] if i else []))
        try:
            served = g.http.get("/healthz").json()["policy_version"]
            assert served == expected, (point, served, expected, "".join(g.lines)[-3000:])
            assert probe(g) == expected
            if point == "gw_record@1":             # the folder of the version never committed was removed
                assert "removed step_1" in "".join(g.lines), "".join(g.lines)[-3000:]
            if rate:
                sessions += _rate_two(g, f"start {i}")
            if point is None:
                g.wait_for(lambda: all(_ledger(exp).get(s) for s in sessions), timeout_s=300)
                break
            _paused(g, point)
            probe(g)                               # what a client gets while the update is at that point
        finally:
            os.kill(g.proc.pid, signal.SIGKILL)
            g.stop()
        committed, answered = _durable(exp)
        assert committed >= answered, (point, committed, answered)   # no answer from a version never committed
        expected = committed
        assert expected == {"gw_record@1": 1, "gw_publish@2": 2}.get(point, 0), (point, expected)

    assert set(seen) == {0, 1, 2}, seen
    assert seen[0] != seen[1] != seen[2], seen                       # each update changed the answer
    with sqlite3.connect(exp / "gateway.sqlite") as db:
        history = db.execute("SELECT version, how FROM versions ORDER BY serve_id").fetchall()
        with sqlite3.connect(exp / "trajectories.sqlite") as tdb:
            stored = tdb.execute("SELECT episode_id, COUNT(*) FROM episodes GROUP BY episode_id").fetchall()
    assert history == [(0, "start"), (1, "ungated"), (2, "ungated")], history
    live = _ledger(exp)
    assert all(len(live[s]) == 1 for s in sessions), live            # each session trained once in the lineage
    assert max(n for sid, n in stored if sid in sessions[:2]) == 4    # the first update's sessions: 4 attempts

    from ajet.commands.sft import read_recorded

    exported = [e.episode_id for e in read_recorded(exp)]
    assert sorted(exported) == sorted(sessions), exported            # each rated session once
