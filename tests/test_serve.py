"""`ajet serve` with real processes on 127.0.0.1 and the tiny model: two Python clients and a Node.js client
train it two steps while a SIGKILL'd client's episode is abandoned and its task completes elsewhere; bad
input to the episode API gets a 4xx; the server killed with SIGKILL resumes and trains every episode that
was finished before the kill exactly once."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from ajet.trajectory_store import TrajectoryStore
from tests.local_servers import announced_url, free_port

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "tutorial" / "serve_agents"
SECRET = "test-secret-0123456789abcdef"

STUCK_CLIENT = '''
import sys, time
from ajet.client import AjetClient
ep = AjetClient(sys.argv[1], secret=sys.argv[2]).begin()
print(ep.episode_id, ep.episode_token, flush=True)
time.sleep(600)                      # never calls, never finishes: killed by the test
'''


def _setup(tmp_path, tiny_model_dir, idle_s=8, steps=2):
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"What is {i} plus 1?",
                                                              "answer": str(i + 1)}) + "\n" for i in range(12)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 4}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, save_freq: 1, tensorboard: false}}
        serve: {{episode_idle_timeout_s: {idle_s}}}
    """))
    return tmp_path / "conf.yaml"


class Server:
    """`ajet serve` in a subprocess; `url` once its 'proxy on' line is printed."""

    def __init__(self, conf: Path, exp: Path, *extra: str, port: int = 0, kill_at: str | None = None):
        env = {**os.environ, "AJET_SECRET": SECRET}
        env.pop("AJET_TEST_KILL_AT", None)
        if kill_at:
            env["AJET_TEST_KILL_AT"] = kill_at                  # ajet/faults.py: SIGKILL itself at that point
        self.proc = subprocess.Popen([sys.executable, "-m", "ajet", "serve", "--conf", str(conf), "--exp-dir", str(exp),
                                      "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, cwd=conf.parent, text=True)
        self.lines, self.url = announced_url(self.proc, "proxy on ", "ajet serve", 180)

    def output(self) -> str:
        return "".join(self.lines)

    def http(self, secret: str = SECRET) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30)


def _client(server: Server, script: list[str], retry_s: float = 30, max_episodes: int = 1000) -> subprocess.Popen:
    env = {**os.environ, "AJET_URL": server.url, "AJET_SECRET": SECRET, "AJET_RETRY_S": str(retry_s),
           "AJET_MAX_EPISODES": str(max_episodes)}
    return subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def _kill_running(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def _finished_by_clients(procs, server: Server) -> list[dict[str, float]]:
    """Per client process: {episode_id: reward} of the episodes it finished."""
    out = []
    for p in procs:
        stdout, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:] + "\nthe server's output:\n" + server.output()[-3000:]
        out.append({row["episode_id"]: row["reward"] for row in map(json.loads, stdout.splitlines())})
    return out


def _check_ledger(exp: Path, steps: int, tasks_per_step: int = 2, num_repeat: int = 2):
    """Every ok episode is trained exactly once by a live update; each step trained complete groups."""
    store = TrajectoryStore(exp / "trajectories.sqlite")
    ledger, records = store.ledger(), {(r["episode_id"]): r for r in store.episodes()}
    store.close()
    for e in ledger:
        if e["ok"]:
            assert len(e["trained_in"]) == 1, e
        else:
            assert e["trained_in"] == [], e
    per_step = {}
    for e in ledger:
        for step, _ in e["trained_in"]:
            per_step.setdefault(step, []).append(records[e["episode_id"]])
    assert sorted(per_step) == list(range(1, steps + 1))
    for step, recs in per_step.items():
        groups = {}
        for r in recs:
            groups.setdefault(r["group_id"], []).append(r["repeat_index"])
        assert len(groups) == tasks_per_step and all(sorted(v) == list(range(num_repeat)) for v in groups.values())
    return ledger, records


def test_python_and_node_clients_train_two_steps_bad_input_and_a_killed_client(tiny_model_dir, tmp_path):
    conf, exp = _setup(tmp_path, tiny_model_dir, idle_s=12), tmp_path / "exp"
    server = Server(conf, exp)
    try:
        http = server.http()
        # a client that begins an episode and is SIGKILLed: abandoned after the idle timeout
        (tmp_path / "stuck.py").write_text(STUCK_CLIENT)
        stuck = subprocess.Popen([sys.executable, str(tmp_path / "stuck.py"), server.url, SECRET],
                                 stdout=subprocess.PIPE, text=True)
        stuck_id, stuck_token = stuck.stdout.readline().split()
        os.kill(stuck.pid, signal.SIGKILL)
        stuck.wait()

        # bad input: 4xx with a clear message, and the server goes on
        assert server.http("wrong-secret").get("/ajet/v1/status").status_code == 401
        as_json = {"Content-Type": "application/json"}
        r = http.post("/ajet/v1/episodes", content=b"{not json", headers=as_json)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = http.post("/ajet/v1/episodes/nope/finish", json={"reward": 1.0})
        assert r.status_code == 404 and "no running episode 'nope'" in r.json()["error"]["message"]
        stuck_auth = {"X-Ajet-Episode-Token": stuck_token}
        r = http.post(f"/ajet/v1/episodes/{stuck_id}/finish", content=b'{"reward": NaN}',
                      headers={**stuck_auth, **as_json})
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
        r = http.post("/ajet/v1/episodes", json={"client_id": "x", "colour": "red"})
        assert r.status_code == 400 and "colour" in r.json()["error"]["message"]

        # 8 places in 2 steps, 7 of them for the clients (one is ours, below): with at most 3 + 3 + 2
        # episodes each, every client must run some for the run to finish (Node when it is on PATH)
        node = shutil.which("node")
        clients = [_client(server, [sys.executable, str(AGENTS / "python_agent.py")], max_episodes=3 if node else 1000)
                   for _ in range(2)]
        if node:
            clients.append(_client(server, [node, str(AGENTS / "node_agent.mjs")], max_episodes=2))
        # one episode of our own, held open (heartbeats) until the stuck one is abandoned: the run cannot end
        # before the late finish below; then finished twice
        ep = http.post("/ajet/v1/episodes", json={"client_id": "test"}).json()
        chat = httpx.post(ep["base_url"] + "/chat/completions", headers={"Authorization": f"Bearer {ep['api_key']}"},
                          json={"model": ep["model"], "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert chat.status_code == 200
        auth = {"X-Ajet-Episode-Token": ep["episode_token"]}

        deadline = time.monotonic() + 120
        while http.get("/ajet/v1/status").json()["episodes"]["abandoned"] < 1:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
            assert http.post(f"/ajet/v1/episodes/{ep['episode_id']}/heartbeat", headers=auth).status_code == 200
            time.sleep(0.5)
        r = http.post(f"/ajet/v1/episodes/{stuck_id}/finish", json={"reward": 1.0}, headers=stuck_auth)   # after abandon
        assert r.status_code == 410 and r.json()["error"]["code"] == "episode_abandoned", r.text

        assert http.post(f"/ajet/v1/episodes/{ep['episode_id']}/finish", json={"reward": 0.5}, headers=auth).status_code == 200
        r = http.post(f"/ajet/v1/episodes/{ep['episode_id']}/finish", json={"reward": 0.5}, headers=auth)
        assert r.status_code == 409 and r.json()["error"]["code"] == "episode_already_finished"

        per_client = _finished_by_clients(clients, server)
        assert all(per_client), per_client                 # every client ran episodes (Node too, when present)
        rewards = {k: v for c in per_client for k, v in c.items()}
        rewards[ep["episode_id"]] = 0.5
        assert server.proc.wait(timeout=120) == 0, server.output()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    out = server.output()
    assert "step 2/2" in out

    ledger, records = _check_ledger(exp, steps=2)
    stuck_rec = records[stuck_id]
    assert stuck_rec["error"].startswith("abandoned: no call or heartbeat for 12s")
    trained_groups = {records[e["episode_id"]]["group_id"] for e in ledger if e["trained_in"]}
    assert stuck_rec["group_id"] in trained_groups          # its task completed through another client
    for eid, reward in rewards.items():                     # rewards landed on the right episodes
        assert records[eid]["reward"] == reward
    for rec in records.values():                            # calls recorded under their own episode, merged exactly
        assert all(c["episode_id"] == rec["episode_id"] for c in rec["calls"])
    rows = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    for row in rows:
        (call,), (sample,) = row["calls"], row["samples"]
        assert sample["prompt_ids"] == call["prompt_ids"] and sample["response_ids"] == call["completion_ids"]
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert metrics[-1]["serve/clients"] == 4 + bool(shutil.which("node"))   # stuck, test, 2 Python, Node
    assert metrics[-1]["serve/abandoned"] >= 1               # the stuck client's (a starved client's too, rarely)


def test_server_sigkill_then_resume_trains_every_finished_episode_once(tiny_model_dir, tmp_path):
    conf, exp = _setup(tmp_path, tiny_model_dir, idle_s=60), tmp_path / "exp"
    port = free_port()                                     # one port for both servers: the clients keep their URL
    server = Server(conf, exp, port=port, kill_at="rollout@2")   # step 2's first finished episode stored: SIGKILL
    clients = [_client(server, [sys.executable, str(AGENTS / "python_agent.py")], retry_s=240) for _ in range(2)]
    try:
        assert server.proc.wait(timeout=180) == -signal.SIGKILL, server.output()
        store = TrajectoryStore(exp / "trajectories.sqlite")
        before = {e["episode_id"] for e in store.ledger() if e["ok"]}
        store.close()
        assert len(before) >= 3

        server = Server(conf, exp, "--resume", port=port)
        per_client = _finished_by_clients(clients, server)           # they retried through the restart and went on
        assert server.proc.wait(timeout=120) == 0, server.output()
    finally:
        _kill_running(server.proc, *clients)
    assert "step 2/2" in server.output()
    ledger, records = _check_ledger(exp, steps=2)
    trained = {e["episode_id"] for e in ledger if e["trained_in"]}
    assert before <= trained                                  # every episode finished before the kill: trained once
    assert {r["attempt"] for r in ledger} == {0, 1}
    finished_after = {k for c in per_client for k in c}
    assert finished_after and all(records[k]["reward"] == c[k] for c in per_client for k in c)


def test_clients_waiting_for_a_server_resumed_after_its_last_step_hear_run_finished(tiny_model_dir, tmp_path):
    """The server was stopped after its last checkpoint (here: it finished) while clients went on retrying
    its port; `--resume` has nothing left to train and still answers them 410 `run_finished` before it
    stops: they exit cleanly instead of retrying a refused connection until `AJET_RETRY_S`, then failing."""
    conf, exp = _setup(tmp_path, tiny_model_dir), tmp_path / "exp"
    port = free_port()
    server = Server(conf, exp, port=port)
    _finished_by_clients([_client(server, [sys.executable, str(AGENTS / "python_agent.py")])], server)
    assert server.proc.wait(timeout=120) == 0, server.output()
    late = [_client(server, [sys.executable, str(AGENTS / "python_agent.py")], retry_s=60) for _ in range(2)]
    try:
        time.sleep(3.0)                                        # they retry the refused connections
        server = Server(conf, exp, "--resume", port=port)
        assert _finished_by_clients(late, server) == [{}, {}]  # RunFinished at their first answer
        assert server.proc.wait(timeout=60) == 0, server.output()
    finally:
        _kill_running(server.proc, *late)
    assert "next step 3" in server.output()
