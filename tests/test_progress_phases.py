"""What each long phase shows on the progress display (ajet/progress.py): the update's mini-batches done / total and
the checkpoint write of a real run, a harness workflow's runs (running the harness, running its tests, done), the
episodes `ajet serve` has in flight per client, and `ajet gateway --quiet` printing only its address and the step
lines. The phases are read from a recording reporter (every change of every phase, in order); nothing is timed."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

import ajet.progress
from ajet.progress import Phase, Reporter
from tests.test_gateway import gw  # noqa: F401 - the served gateway fixture

TASKS = Path(__file__).resolve().parent.parent / "tutorial" / "example_swe_tasks"


class Recorder(Reporter):
    """A plain-mode reporter (its periodic lines an hour apart) that records each phase's opening, every change
    (name, done, total, fields) and its closing."""

    def __init__(self):
        super().__init__(Console(file=io.StringIO()), enabled=True, interval_s=3600.0, live=False)
        self.events: list[tuple] = []
        self._events_lock = threading.Lock()

    def phase(self, name, total=None, **fields) -> Phase:
        with self._events_lock:
            self.events.append(("open", name, total))
        return super().phase(name, total, **fields)

    def _changed(self, p: Phase) -> None:
        with self._events_lock:
            self.events.append(("set", p.name, p.done, p.total, dict(p.fields)))
        super()._changed(p)

    def _closed(self, p: Phase) -> None:
        with self._events_lock:
            self.events.append(("close", p.name))
        super()._closed(p)

    def of(self, name: str) -> list[tuple]:
        return [e for e in self.events if e[1] == name]


def _record(monkeypatch) -> Recorder:
    """Make every reporter the process configures (and the current one) a Recorder; returns the current one."""
    rec = Recorder()
    monkeypatch.setattr(ajet.progress, "_reporter", rec)
    monkeypatch.setattr(ajet.progress, "configure", lambda *a, **k: rec)   # the trainer's own configure call
    return rec


WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class Chat(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        return WorkflowOutput(reward=float(task.task_id == "t0"), final_answer=r.choices[0].message.content or "")
'''


def test_the_update_shows_mini_batches_done_of_total_and_the_checkpoint_write(tiny_model_dir, tmp_path, monkeypatch):
    """A real 1-step run of the debug backbone with 2 PPO epochs x 2 mini-batches: the update phase counts 1, 2, 3,
    4 of 4 optimizer steps (epoch 1 then 2) and closes; the step's checkpoint is written inside a phase of its own."""
    from ajet.config import load_config
    from ajet.trainer import run

    rec = _record(monkeypatch)
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"Say {i}."}) + "\n"
                                                  for i in range(2)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: phases
        workflow: wf.py:Chat
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3, ppo_epochs: 2, mini_batches: 2}}
        trainer: {{total_steps: 1, tasks_per_step: 2, val_freq: 0, save_freq: 1, tensorboard: false}}
    """))
    monkeypatch.chdir(tmp_path)
    run(load_config(tmp_path / "conf.yaml", {"trainer.exp_dir": str(tmp_path / "exp")}))
    update = rec.of("update")
    assert update[0] == ("open", "update", 4) and update[-1] == ("close", "update"), update
    sets = [e for e in update if e[0] == "set"]
    counted = [(e[2], e[4].get("epoch")) for prev, e in zip([("set", "", 0)] + sets, sets) if e[2] != prev[2]]
    # each optimizer step advances the count by one (the epoch field is set before each mini-batch)
    assert [d for d, _ in counted] == [1, 2, 3, 4] and [ep for _, ep in counted] == [1, 1, 2, 2], update
    assert all(e[3] == 4 for e in update if e[0] == "set")
    ckpt = rec.of("checkpoint step 1")
    assert ckpt == [("open", "checkpoint step 1", None), ("close", "checkpoint step 1")], rec.events
    rollout = rec.of("step 1/1 rollout")
    assert rollout[0] == ("open", "step 1/1 rollout", 4) and max(e[2] for e in rollout if e[0] == "set") == 4


def test_a_harness_workflow_shows_its_runs(tmp_path, monkeypatch):
    """Two concurrent episodes of a harness (here the interpreter, printing a line) on a repository task: one
    phase "harness NAME" open from the first to the last, showing runs of the harness and of the tests in
    progress, counting 2 done, then closed."""
    from ajet.config import HarnessSpec, HarnessWorkflowConfig
    from ajet.harnesses.workflow import HarnessWorkflow
    from ajet.tasks import read_jsonl_tasks
    from ajet.workflow import Tuner

    rec = _record(monkeypatch)
    spec = HarnessSpec(executable=sys.executable, api="chat", argv=["-c", "print('looked at the repository')"])
    conf = HarnessWorkflowConfig.model_validate({"harness": "interp", "timeout_s": 120, "test_timeout_s": 300,
                                                 "sandbox": {"isolation": "none"}})
    workflow = HarnessWorkflow(conf, {"interp": spec}, TASKS)
    task = next(t for t in read_jsonl_tasks(TASKS / "tasks.jsonl") if t.task_id == "median")
    tuner = Tuner(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", episode_id="e")

    async def both():
        return await asyncio.gather(workflow.execute(task, tuner), workflow.execute(task, tuner))

    outputs = asyncio.run(both())
    assert all(o.metadata["exit_status"] == 0 for o in outputs), outputs   # the harness ran
    events = rec.of("harness interp")
    assert [e[0] for e in events].count("open") == 1 and events[0] == ("open", "harness interp", None), events
    assert events[-1] == ("close", "harness interp")
    sets = [e for e in events if e[0] == "set"]
    assert any(e[4]["running"] >= 1 for e in sets) and any(e[4]["testing"] >= 1 for e in sets), sets
    assert [e[2] for e in sets][-1] == 2 and sets[-1][4] == {"running": 0, "testing": 0}, sets
    assert not rec.of("harness interp install")   # on PATH: nothing to install


def test_ajet_harnesses_install_shows_the_install(tmp_path, monkeypatch, capsys):
    """`ajet harnesses --install NAME` opens a phase "harness NAME install" around the install (npm or pip may
    take minutes) and prints the executable's path on stdout; here a harness already on PATH."""
    from ajet.cli import main

    rec = _record(monkeypatch)
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        data: {{train_path: tasks.jsonl}}
        harnesses: {{interp: {{executable: "{sys.executable}", api: chat}}}}
    """))
    assert main(["harnesses", "--conf", str(tmp_path / "conf.yaml"), "--install", "interp"]) == 0
    assert capsys.readouterr().out.strip() == sys.executable
    assert rec.of("harness interp install") == [("open", "harness interp install", None),
                                                 ("close", "harness interp install")], rec.events


def test_serve_shows_the_episodes_in_flight_per_client(monkeypatch):
    """The episode queue of `ajet serve` sets the step's phase: episodes in flight in all and per client (busiest
    first), as clients begin, finish and abort episodes."""
    from tests.test_episode_queue import _queue

    rec = _record(monkeypatch)
    q, _ = _queue(datasets=None, tasks_per_step=3)
    with ajet.progress.phase("step 1/3 rollout", 6) as bar:
        a1, a2, b1 = q.begin("alice"), q.begin("alice"), q.begin("bob")
        assert (bar.fields["in flight"], bar.fields["per client"]) == (3, "alice 2, bob 1")
        q.finish(a1["episode_id"], reward=1.0, token=a1["episode_token"])
        assert (bar.fields["in flight"], bar.fields["per client"]) == (2, "alice 1, bob 1")
        q.abort(b1["episode_id"], "gave up", token=b1["episode_token"])
        assert (bar.fields["in flight"], bar.fields["per client"]) == (1, "alice 1")
        q.finish(a2["episode_id"], reward=0.0, token=a2["episode_token"])
        assert bar.fields["in flight"] == 0 and bar.fields["per client"] is None
        assert "in flight 0" in bar.line() and "per client" not in bar.line()
    q.begin("alice")                        # no step phase open: nothing is shown, nothing fails
    with ajet.progress.phase("step 2/3 rollout", 6) as bar:
        q.begin("c0")
        for i in range(6):                  # more clients than are shown: the busiest 5, then how many more
            q.begin(f"c{i}")
        assert bar.fields["per client"] == "c0 2, alice 1, c1 1, c2 1, c3 1, +2 more", bar.fields
        assert bar.fields["in flight"] == 8


def test_a_gateway_step_shows_the_sessions_it_waits_for(gw, monkeypatch):
    """While a gateway step waits for rated sessions (a real session book and app over HTTP), its phase shows the
    sessions open, awaiting feedback (closed, not rated) and rated of the 2 it needs, as they change."""
    import httpx
    import openai

    from ajet.gateway.source import GatewaySource
    from tests.test_gateway import SECRET, _chat

    url, book, clock = gw
    rec = _record(monkeypatch)
    recorded = []
    ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(num_repeat=2),
                                              trainer=SimpleNamespace(tasks_per_step=1)),
                          attempt=0, record=lambda step, ep: recorded.append(ep.episode_id))
    source = GatewaySource(ctx, None, None)
    source.book = book
    client = openai.OpenAI(base_url=url + "/v1", api_key=SECRET, max_retries=0)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=60)

    def shown(bar, **want) -> dict:
        """The phase's fields once they equal `want` (bounded wait: the step looks every TICK_S)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and {k: bar.fields.get(k) for k in want} != want:
            time.sleep(0.05)
        return {k: bar.fields.get(k) for k in want}

    with ajet.progress.phase("step 1/1 rollout", 2) as bar:
        taken = []
        step = threading.Thread(target=lambda: taken.extend(source.collect(1)), daemon=True)
        step.start()
        _, ha = _chat(client, [{"role": "user", "content": "First conversation."}])
        _, hb = _chat(client, [{"role": "user", "content": "Second conversation."}])
        a, b = ha["x-ajet-session"], hb["x-ajet-session"]
        want = {"sessions open": 2, "awaiting feedback": 0, "rated": "0/2"}
        assert shown(bar, **want) == want
        assert http.post(f"/v1/sessions/{a}/close").status_code == 200
        want = {"sessions open": 1, "awaiting feedback": 1, "rated": "0/2"}
        assert shown(bar, **want) == want
        assert http.post("/v1/feedback", json={"session_id": a, "reward": 1.0}).status_code == 200
        want = {"sessions open": 1, "awaiting feedback": 0, "rated": "1/2"}
        assert shown(bar, **want) == want
        assert step.is_alive()                                 # one rated session is not yet a step
        http.post("/v1/feedback", json={"session_id": b, "reward": 0.0})
        http.post(f"/v1/sessions/{b}/close")
        step.join(60)
    assert not step.is_alive() and sorted(recorded) == sorted([a, b])


def test_gateway_quiet_prints_its_address_and_the_step_lines_only(tmp_path, tiny_model_dir):
    """`ajet gateway --quiet` with progress lines due every 0.05 s: stdout is the address it listens on, then the
    step line of its one step (two rated sessions), and nothing else (no start line, no progress lines, nothing
    when it stops); stderr has no library progress bar (loading and writing the weights)."""
    import httpx

    from tests.test_gateway import SECRET, _conf

    conf, exp = _conf(tmp_path, tiny_model_dir, steps=1), tmp_path / "exp"
    env = {**os.environ, "AJET_SECRET": SECRET, "AJET_PROGRESS_INTERVAL_S": "0.05", "COLUMNS": "400"}
    err = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ajet", "gateway", "--quiet", "--conf", str(conf), "--exp-dir",
                             str(exp), "--port", "0"], stdout=subprocess.PIPE, stderr=err, env=env,
                            cwd=tmp_path, text=True)
    try:
        first = proc.stdout.readline()        # blocks until the address is printed (or the process ends)
        assert first.startswith("proxy on http://"), first + (tmp_path / "stderr.txt").read_text()
        url = first.split("proxy on ")[1].strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=300) as http:
            for text, reward in (("What is 3 plus 4?", 1.0), ("Say hello.", 0.0)):
                r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": text}]})
                assert r.status_code == 200, r.text
                session = r.headers["x-ajet-session"]
                assert http.post("/v1/feedback", json={"session_id": session, "reward": reward}).status_code == 200
                http.post(f"/v1/sessions/{session}/close")
            rest = [proc.stdout.readline()]   # the step line (or "" when the process ended)
            # a gateway that keeps serving after its last step (gateway.after_training: serve) is stopped once
            # /healthz says training is done; one that stops by itself has ended by then
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if http.get("/healthz", timeout=10).json().get("training") == "done":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rest.append(proc.communicate(timeout=600)[0])
        rest = "".join(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        err.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode in (0, -signal.SIGTERM), first + rest + stderr
    lines = [first.rstrip("\n")] + [line for line in rest.splitlines() if line.strip()]
    assert len(lines) == 2, "\n".join(lines)
    assert re.fullmatch(r"proxy on http://127\.0\.0\.1:\d+", lines[0]), lines
    assert re.match(r"^step 1/1 \| episodes 2 \(0 failed\) \| reward 0\.500 ", lines[1]), lines
    assert "Loading weights" not in stderr and "Writing model shards" not in stderr, stderr
