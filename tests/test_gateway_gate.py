"""`ajet gateway`'s evaluation gate and rollback, on the tiny model in a subprocess (the debug engine and the one
training loop, as shipped).

The held-out file's answers are the serving policy's own greedy answers, fetched from the gateway's live endpoint
before any update, and the workflow rewards an exact match: the serving policy's pass@1 is 1 by construction, and
an update at lr 0.1 (Adam moves every weight by about 0.1; the tiny model's weights are ~0.02) changes the greedy
answers, so its pass@1 drops. With `max_drop` 0.1 the gate must refuse it: recorded with both figures, requests
after it carry version 0, and a fixed greedy request's logprobs are bit for bit those from before the update.
With `max_drop` 1 and lr 1e-5 it is served (version 1, other logprobs); `ajet gateway rollback --to 0` then serves
version 0 again (its logprobs return). That update is small (its greedy answers stay the serving policy's, its
logprobs move) so that nothing else can refuse it: the gate also refuses degenerate answers (mostly empty) whatever
`max_drop` says, and what the tiny model answers after an update at lr 0.1 is not something the test controls."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_gateway import Gateway

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class Exact(Workflow):
    """One greedy call; reward 1 when the answer is exactly the task's answer."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=1.0 if text == task.answer else 0.0, final_answer=text)
'''

# 8 held-out questions: the refusal needs one greedy answer of 8 to change after the harmful update (with 3, all
# three once stayed the same on a CI run and the update was served)
QUERIES = ["Tom has 3 apples and buys 4 more.", "A box holds 12 pens.", "What is 7 plus 9?", "Name a colour.",
           "How many legs has a spider?", "Spell the word cat.", "What comes after Monday?", "Is 15 odd or even?"]
PROBE = "The quick brown fox: what is 0 plus 1?"
MAX_TOKENS = 6


def _conf(tmp_path: Path, tiny_model_dir: str, max_drop: float, lr: float) -> Path:
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"task_id": f"v{i}", "query": q, "answer": "?"}) + "\n"
                                                for i, q in enumerate(QUERIES)))   # answers filled in below
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:Exact
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{val_path: val.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: {MAX_TOKENS}, sampling_policy: client, max_concurrency: 1}}
        algorithm: {{lr: {lr}}}
        trainer: {{total_steps: 3, tasks_per_step: 1, save_freq: 1, tensorboard: false}}
        gateway: {{session_idle_s: 600, gate: {{mode: eval, metric: val/pass@1, max_drop: {max_drop}}}}}
    """))
    return tmp_path / "conf.yaml"


def _greedy(g: Gateway, text: str) -> tuple[str, list[float], int]:
    """(answer, its tokens' logprobs, the X-Ajet-Policy-Version) of a greedy request, alone in the engine."""
    r = g.http.post("/v1/chat/completions", json={"model": "ajet-policy", "temperature": 0, "max_tokens": MAX_TOKENS,
                                                  "logprobs": True, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["message"]["content"] or "", [t["logprob"] for t in choice["logprobs"]["content"]],
            int(r.headers["x-ajet-policy-version"]))


def _start_and_update(tmp_path: Path, tiny_model_dir: str, max_drop: float, lr: float = 0.1):
    """Start the gateway, write the held-out answers (the serving policy's greedy answers), probe, then rate two
    sessions (one step: the update the gate judges) and wait for the gate's decision."""
    conf, exp = _conf(tmp_path, tiny_model_dir, max_drop, lr), tmp_path / "exp"
    g = Gateway(conf, exp)
    answers = [_greedy(g, q)[0] for q in QUERIES]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"task_id": f"v{i}", "query": q, "answer": a}) + "\n"
                                                for i, (q, a) in enumerate(zip(QUERIES, answers))))
    before = _greedy(g, PROBE)
    assert before[2] == 0
    for reward in (1.0, 0.0):
        r = g.http.post("/v1/chat/completions", json={"model": "ajet-policy", "temperature": 1.0, "max_tokens": 6,
                                                      "messages": [{"role": "user", "content": f"Train {reward}"}]})
        sid = r.headers["x-ajet-session"]
        assert g.http.post("/v1/feedback", json={"session_id": sid, "reward": reward}).status_code == 200
        assert g.http.post(f"/v1/sessions/{sid}/close").status_code == 200
    g.wait_for(lambda: g.http.get("/v1/admin/versions").json()["gate"])
    return g, exp, before


def test_a_harmful_update_is_refused_and_the_serving_weights_stay(tmp_path, tiny_model_dir):
    g, exp, before = _start_and_update(tmp_path, tiny_model_dir, max_drop=0.1)
    try:
        (decision,) = g.http.get("/v1/admin/versions").json()["gate"]
        after = _greedy(g, PROBE)
        chat = g.chat("Any question after the refusal?")[1]
        health = g.http.get("/healthz").json()
        metrics = g.http.get("/metrics").text
    finally:
        g.stop()
    assert decision["served"] is False and decision["candidate_version"] == 1 and decision["serving_version"] == 0, (
        decision, "".join(g.lines[-40:]))
    assert decision["serving_figure"] == 1.0                       # the held-out answers are its own
    assert decision["candidate_figure"] is not None and decision["candidate_figure"] < 1.0 - 0.1, decision
    assert "below the best served version's" in decision["reason"]
    with sqlite3.connect(exp / "gateway.sqlite") as db:            # durable, with both figures
        assert db.execute("SELECT served, serving_figure, candidate_figure FROM gate").fetchall() == [
            (0, 1.0, decision["candidate_figure"])]
    assert health["policy_version"] == 0 and chat["x-ajet-policy-version"] == "0"
    assert after == before                                         # the same answer, logprobs bit for bit
    assert "ajet_gateway_gate_refusals_total 1" in metrics
    assert (exp / "gate" / "step_1" / "eval.jsonl").is_file()      # the candidate's evaluation, per task
    assert any("REFUSED" in line for line in g.lines), "".join(g.lines)[-3000:]


def test_a_served_update_then_rollback_serves_the_earlier_version(tmp_path, tiny_model_dir):
    g, exp, before = _start_and_update(tmp_path, tiny_model_dir, max_drop=1.0, lr=1e-5)
    try:
        (decision,) = g.http.get("/v1/admin/versions").json()["gate"]
        served = _greedy(g, PROBE)
        out = subprocess.run([sys.executable, "-m", "ajet", "gateway", "rollback", "--conf", str(tmp_path / "conf.yaml"),
                              "--exp-dir", str(exp), "--to", "0", "--wait", "300"], capture_output=True, text=True,
                             timeout=600, cwd=tmp_path, env=os.environ)
        rolled = _greedy(g, PROBE)
        health = g.http.get("/healthz").json()
        versions = g.http.get("/v1/admin/versions").json()
        unknown = g.http.post("/v1/admin/rollback", json={"to": 7})
        bad = g.http.post("/v1/admin/rollback", json={"to": "one"})
        metrics = g.http.get("/metrics").text
    finally:
        g.stop()
    assert decision["served"] is True and decision["candidate_version"] == 1, (decision, "".join(g.lines[-40:]))
    assert served[2] == 1 and served[1] != before[1]               # the update is served: other weights
    assert out.returncode == 0, out.stdout + out.stderr
    assert "version 0 is served (was 1)" in out.stdout, out.stdout
    assert health["policy_version"] == 0 and rolled[2] == 0
    assert rolled == before                                        # version 0's weights, bit for bit
    assert [v["how"] for v in versions["versions"]] == ["start", "gate", "rollback"]
    assert versions["versions"][-1]["figure"] == 1.0               # version 0's recorded figure
    assert unknown.status_code == 409 and unknown.json()["error"]["code"] == "rollback_refused"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "to"
    assert "ajet_gateway_rollbacks_total 1" in metrics and "ajet_gateway_swaps_total 2" in metrics
