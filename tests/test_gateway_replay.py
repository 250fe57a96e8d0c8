"""`ajet gateway`'s replay gate (`gateway.gate.mode: replay`): a candidate policy and the serving one answer the
first request of the most recently rated sessions, the config's judge scores both, and the gate compares the two
figures.

The judge rewards an answer equal to the serving policy's own greedy answer to that request (fetched from the
gateway's live endpoint before any update, in sessions that get no feedback and so are never replayed): the
serving policy's replay figure is 1 by construction. An update at lr 0.1 changes the greedy answers (Adam moves
every weight by about 0.1; the tiny model's weights are ~0.02), so it is refused with both figures recorded; an
update at lr 1e-7 leaves them as they were and is served. Seven sessions are rated: the four rated first are
closed and trained on (one step of `tasks_per_step * num_repeat` = 4), the three rated last stay open (never
trained on) and, `replay_sessions` being 3, are the replay set (the candidate's own training sessions are left out
of it), each answered once by each policy. Every reward arrives before any session is closed, so the update and
its replay set are the same whatever the trainer's timing."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

from ajet.gateway.store import GatewayStore
from tests.test_gateway import Gateway

JUDGE = '''
import json
from pathlib import Path

HERE = Path(__file__).parent


def score(task, output):
    """1 when the answer is the serving policy's greedy answer to the request (expected.json), else 0."""
    expected = json.loads((HERE / "expected.json").read_text())
    with open(HERE / "judged.jsonl", "a") as f:
        f.write(json.dumps({"session": task.metadata.get("session"), "query": task.query,
                            "answer": output.final_answer}) + "\\n")
    return 1.0 if output.final_answer == expected.get(task.query) else 0.0
'''

QUERIES = ["Tom has 3 apples and buys 4 more.", "A box holds 12 pens.", "What is 7 plus 9?", "Name a prime number."]
MAX_TOKENS = 6


def _conf(tmp_path: Path, tiny_model_dir: str, lr: float) -> Path:
    (tmp_path / "judge.py").write_text(JUDGE)
    (tmp_path / "expected.json").write_text("{}")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        judge: judge.py:score
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        rollout: {{num_repeat: 4, max_tokens: {MAX_TOKENS}, sampling_policy: client, max_concurrency: 1}}
        algorithm: {{lr: {lr}}}
        trainer: {{total_steps: 3, tasks_per_step: 1, save_freq: 1, tensorboard: false}}
        gateway: {{session_idle_s: 600, gate: {{mode: replay, metric: reward_mean, max_drop: 0.1,
                                                replay_sessions: 3}}}}
    """))
    return tmp_path / "conf.yaml"


def _run(tmp_path: Path, tiny_model_dir: str, lr: float):
    """Start the gateway, write expected.json (the serving policy's greedy answers), rate four sessions of the same
    requests (sampled at temperature 1: one step) and then three more of the last three requests, close the first
    four and wait for the gate's decision. Returns (decision, the rated session ids in rating order, the greedy
    answers, /healthz, what the judge saw, exp dir)."""
    conf, exp = _conf(tmp_path, tiny_model_dir, lr), tmp_path / "exp"
    g = Gateway(conf, exp)
    try:
        greedy = {}
        for q in QUERIES:
            r = g.http.post("/v1/chat/completions", json={"model": "ajet-policy", "temperature": 0, "max_tokens": MAX_TOKENS,
                                                          "messages": [{"role": "user", "content": q}]})
            assert r.status_code == 200, r.text
            greedy[q] = r.json()["choices"][0]["message"]["content"] or ""
        (tmp_path / "expected.json").write_text(json.dumps(greedy))
        rated = []
        for q, reward in zip(QUERIES + QUERIES[1:], (1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 1.0)):
            r = g.http.post("/v1/chat/completions", json={"model": "ajet-policy", "temperature": 1.0,
                                                          "max_tokens": MAX_TOKENS,
                                                          "messages": [{"role": "user", "content": q}]})
            sid = r.headers["x-ajet-session"]
            assert g.http.post("/v1/feedback", json={"session_id": sid, "reward": reward}).status_code == 200
            rated.append(sid)
        for sid in rated[:4]:                                    # the update's four; the last three stay open
            assert g.http.post(f"/v1/sessions/{sid}/close").status_code == 200
        g.wait_for(lambda: g.http.get("/v1/admin/versions").json()["gate"])
        (decision,) = g.http.get("/v1/admin/versions").json()["gate"]
        health = g.http.get("/healthz").json()
    finally:
        g.stop()
    judged = [json.loads(line) for line in (tmp_path / "judged.jsonl").read_text().splitlines()]
    return decision, rated, greedy, health, judged, exp


def _replayed(exp: Path, sub: str) -> list[str]:
    return [json.loads(line)["task_id"] for line in (exp / "gate" / "step_1" / sub / "eval.jsonl").read_text().splitlines()]


def test_a_harmful_update_is_refused_by_the_replay_gate(tmp_path, tiny_model_dir):
    decision, rated, greedy, health, judged, exp = _run(tmp_path, tiny_model_dir, lr=0.1)
    assert decision["served"] is False and (decision["candidate_version"], decision["serving_version"]) == (1, 0)
    assert decision["metric"] == "replay:reward_mean"
    assert decision["serving_figure"] == 1.0                     # the judge's answers are the serving policy's own
    assert decision["candidate_figure"] < 1.0 - 0.1, decision
    assert "below the serving policy's" in decision["reason"]
    with sqlite3.connect(exp / "gateway.sqlite") as db:          # durable, with both figures
        assert db.execute("SELECT served, serving_figure, candidate_figure FROM gate").fetchall() == [
            (0, 1.0, decision["candidate_figure"])]
    assert health["policy_version"] == 0
    # the three sessions rated last were replayed, by both policies, and only they (not the greedy fetches, not the
    # four the candidate trained on)
    last3 = {f"replay-{s}" for s in rated[4:]}
    assert set(_replayed(exp, "serving")) == set(_replayed(exp, ".")) == last3
    assert len(judged) == 6 and {j["session"] for j in judged} == set(rated[4:])
    serving, candidate = judged[:3], judged[3:]
    assert all(j["answer"] == greedy[j["query"]] for j in serving)
    assert any(j["answer"] != greedy[j["query"]] for j in candidate)


def test_a_harmless_update_is_served_by_the_replay_gate(tmp_path, tiny_model_dir):
    decision, rated, greedy, health, judged, exp = _run(tmp_path, tiny_model_dir, lr=1e-7)
    assert decision["served"] is True and decision["candidate_version"] == 1, decision
    assert decision["serving_figure"] == decision["candidate_figure"] == 1.0
    assert decision["reason"] == "served (replay of 3 sessions)"
    assert health["policy_version"] == 1
    assert len(judged) == 6 and all(j["answer"] == greedy[j["query"]] for j in judged)


def test_the_replay_set_is_the_latest_rated_sessions_first_requests(tmp_path):
    store = GatewayStore(tmp_path / "gateway.sqlite")

    def call(sid, idx, text):
        return {"call_id": f"{sid}-{idx}", "index": idx, "messages": [{"role": "user", "content": text}],
                "tools": None}
    try:
        for sid in ("a", "b", "c", "d", "e"):
            store.open_session(sid, sid, "new")
        for sid in ("a", "b", "c", "d"):
            store.add_response(sid, f"r-{sid}", 0, [call(sid, 0, f"first {sid}"), call(sid, 1, f"second {sid}")])
        store.add_feedback("a", 1.0, None, "client", at=1.0)
        store.add_feedback("b", 0.0, None, "client", at=2.0)
        store.add_feedback("e", 1.0, None, "client", at=3.0)      # rated, but no recorded call: never replayed
        store.add_feedback("c", 0.5, None, "judge", at=4.0)
        store.add_feedback("a", 0.25, None, "client", at=5.0)     # a later reward moves `a` to the front
        # d has calls but no feedback: never replayed
        got = store.replay_set(3)
        assert [(sid, reward, rec["messages"][0]["content"]) for sid, reward, rec in got] == [
            ("a", 0.25, "first a"), ("c", 0.5, "first c"), ("b", 0.0, "first b")]
        assert [sid for sid, _, _ in store.replay_set(2)] == ["a", "c"]
    finally:
        store.close()
