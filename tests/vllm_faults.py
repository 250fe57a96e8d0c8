"""Faults against a real vLLM server (the vLLM venv, SmolLM2-135M; skip/fail rules of tests/vllm_server.py):

- a call whose client disconnects, or whose episode reaches `rollout.episode_timeout_s`, is aborted in vLLM, as vLLM's
  own /metrics shows: no request left running, and its generated-token counter stops far below the call's
  `max_tokens` (calls with `ignore_eos`, so that only `max_tokens` would end them);
- a server that refuses connections: the pool sends its calls to another server, token for token what that server
  samples for the call's seed; with none left, a call fails at once naming each;
- the server a run started, SIGKILLed mid-rollout: the episodes it was serving fail, the episodes already recorded
  stay in the trajectory store, and the run stops with exit status 2 and one line naming the server and its log.

These tests are collected in tests/test_vllm_engine.py's module (one unit of work under xdist, in its memory budget),
so that they share its one server (tests/vllm_server.py); the kill test's run starts its own, first (before the
module's server starts: one server at a time).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from ajet.engines.remote import RemoteEngine, ServerUnreachable
from ajet.engines.vllm import SERVED_NAME, VLLMEngine
from ajet.ports import free_port
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episodes import new_episodes, run_episode
from ajet.task import Task
from ajet.workflow import Workflow, WorkflowOutput
from tests.test_stream_disconnects import _read_to_first_token, _request
from tests.vllm_server import EAGER, START_LIMIT_S, _vllm_direct, _wait_group_gone, vllm_python

LONG = 1800          # tokens each aborted call asks for (the module server's max_model_len is 2048)
SLACK = 400          # tokens vLLM may still decode while a disconnect reaches it (seconds of a loaded machine)


KILL_WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class Answer(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}], max_tokens=24)
        return WorkflowOutput(reward=float(task.answer in (r.choices[0].message.content or "")))
'''


def _watchdog_of(pid: int) -> int | None:
    """The pid of the watchdog (ajet/engines/watchdog.py, leader of the vLLM server's process group) that process
    `pid` started, or None."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == pid and b"watchdog.py" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError):
            pass
    return None


def _recorded(exp: Path) -> list[tuple[str, str | None]]:
    """(episode id, error) of the episodes the run's trajectory store holds (read-only, while the run writes)."""
    db = exp / "trajectories.sqlite"
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
            return con.execute("SELECT episode_id, error FROM episodes ORDER BY rowid").fetchall()
    except sqlite3.OperationalError:           # the schema is not written yet
        return []


def test_the_server_killed_mid_rollout_stops_the_run_in_one_line(model_path, tmp_path):
    """`ajet` with `engine: {kind: vllm}` (its own server), the server's process group SIGKILLed once two episodes of
    step 1 are recorded: exit status 2, one line naming the server and its log, no traceback; the episodes recorded
    before the kill are all still in the store, the ones the server was serving failed naming it."""
    python = vllm_python()
    (tmp_path / "wf.py").write_text(KILL_WORKFLOW)
    tasks = [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:Answer
        model: {{path: "{model_path}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 4, max_tokens: 24, max_concurrency: 2, episode_timeout_s: 900}}
        trainer: {{total_steps: 2, tasks_per_step: 4, tensorboard: false}}
        engine: {{kind: vllm, python: "{python}", kv_cache_gb: 1, start_timeout_s: {START_LIMIT_S},
                  extra_args: {json.dumps(EAGER)}}}
    """))
    exp = tmp_path / "exp"
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        run = subprocess.Popen([sys.executable, "-m", "ajet", "--conf", str(tmp_path / "conf.yaml"),
                                "--backbone=debug", "--exp-dir", str(exp)], stdout=out, stderr=err, cwd=tmp_path)
    pgid = None
    try:
        _wait(lambda: run.poll() is not None or len(_recorded(exp)) >= 2, "no episode recorded",
              START_LIMIT_S + 300)
        assert run.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
        pgid = _watchdog_of(run.pid)
        assert pgid is not None
        os.killpg(pgid, signal.SIGKILL)
        before_kill = _recorded(exp)
        run.wait(600)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    log = exp / "engine" / "vllm.log"
    assert run.returncode == 2, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err, out[-2000:] + err[-3000:]
    line = err.strip().splitlines()[-1]              # (above it: the proxy's warning for each call that failed)
    assert line.startswith("ajet: error: the vLLM server ajet started (http://127.0.0.1:"), line
    assert "stopped during the run (exit status -9)" in line and f"(log: {log})" in line, line
    assert log.exists()
    assert _wait_group_gone(pgid)
    # nothing acknowledged is lost: every episode recorded before the kill is in the store as it was
    after = dict(_recorded(exp))
    assert all(after.get(eid, "missing") == error for eid, error in before_kill), (before_kill, after)
    assert sum(error is None for _, error in before_kill) >= 1
    # the episodes the dead server was serving failed, naming it
    url = line.split("(", 1)[1].split(")", 1)[0]
    failed = [error for eid, error in after.items() if error is not None]
    assert failed and all(url in error for error in failed), failed[:2]
    assert not (exp / "checkpoints").exists()


def _metrics(url: str) -> dict[str, float]:
    """vLLM's own counters (its Prometheus /metrics): requests running, completion tokens generated so far."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=60) as r:
        text = r.read().decode()

    def value(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))

    return {"running": value("vllm:num_requests_running"), "generated": value("vllm:generation_tokens_total")}


def _wait(condition, what: str, limit_s: float = 300.0) -> None:
    """Poll `condition()` every 0.05 s until it holds; fails naming `what` after `limit_s` seconds."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class _NoEos(RemoteEngine):
    """ajet's remote engine, each request with `ignore_eos`: only `max_tokens` ends a call that is not aborted."""

    def request_body(self, *args, **kwargs):
        return {**super().request_body(*args, **kwargs), "ignore_eos": True}


@pytest.fixture(scope="module")
def smollm2_tokenizer(model_path):
    """The served model's tokenizer (the proxy renders the prompts with it)."""
    from ajet.model import load_tokenizer

    return load_tokenizer(model_path)


def _proxy(server, tokenizer, client: str = "aiohttp") -> ProxyServer:
    engine = _NoEos(server["url"], SERVED_NAME, client=client)
    return ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=LONG), max_model_len=2048,
                       seed=0).start()


def _assert_aborted(url: str, before: dict[str, float], left_at: float) -> None:
    """vLLM stops decoding the call: nothing left running, fewer tokens than the call asked for, and at most `SLACK`
    of them after `left_at` (the counter when the client left or the episode's time was up): an orphan request
    would run on to `LONG` tokens."""
    _wait(lambda: _metrics(url)["running"] == 0, "vLLM still runs the call")
    generated = _metrics(url)["generated"] - before["generated"]
    print(f"vLLM generated {generated:.0f} of the call's {LONG} tokens, {left_at - before['generated']:.0f} of them "
          "before its client left")                                              # shown by pytest -rP
    assert 0 < generated < LONG, f"vLLM generated {generated} tokens of a {LONG}-token call"
    assert generated - (left_at - before["generated"]) <= SLACK, (generated, left_at - before["generated"])


@pytest.mark.parametrize("stream,client", [(False, "aiohttp"), (True, "aiohttp"), (False, "httpx")],
                         ids=["plain", "streamed", "plain-httpx"])
def test_a_client_gone_aborts_its_call_in_vllm(server, smollm2_tokenizer, stream, client):
    proxy = _proxy(server, smollm2_tokenizer, client)
    try:
        ep = proxy.open_episode("gone")
        url = ep.base_url + "/chat/completions"
        body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "Count."}]})
        before = _metrics(server["url"])
        u = urlsplit(url)
        with socket.create_connection((u.hostname, u.port), timeout=300) as sock:
            sock.sendall(_request(url, body.encode()))
            if stream:
                _read_to_first_token(sock)
            else:
                _wait(lambda: _metrics(server["url"])["generated"] >= before["generated"] + 8, "never decoded")
            left_at = _metrics(server["url"])["generated"]
        _assert_aborted(server["url"], before, left_at)
        assert proxy.close_episode(ep) == []           # nothing recorded for a call nobody received
    finally:
        proxy.stop()


class _OneLongCall(Workflow):
    async def execute(self, task, tuner):
        await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": "Go."}])
        return WorkflowOutput(reward=1.0)


def test_an_episode_timeout_aborts_its_call_in_vllm(server, smollm2_tokenizer):
    """`rollout.episode_timeout_s` reached while the episode's call decodes (20 s into a call of 1800 tokens, more
    than a minute of decoding here; 20 s so that a loaded machine has sent it to vLLM by then): the episode fails
    with the timeout, and vLLM aborts the call (at most `SLACK` tokens after the limit)."""
    proxy = _proxy(server, smollm2_tokenizer)
    try:
        (episode,) = new_episodes([Task("t0", "Go.", "1")], 1, step=1)
        before = _metrics(server["url"])
        asyncio.run(run_episode(_OneLongCall(), episode, proxy, None, timeout_s=20.0))
        left_at = _metrics(server["url"])["generated"]
        assert episode.error is not None and episode.error.startswith("TimeoutError"), episode.error
        _assert_aborted(server["url"], before, left_at)      # with the proxy still up (its stop ends every call)
    finally:
        proxy.stop()


def test_calls_go_to_another_server_when_one_refuses_connections(server, smollm2_tokenizer, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"       # nothing listens there: every connection is refused
    engine = VLLMEngine([dead, server["url"]], SERVED_NAME, tmp_path / "weights")
    prompts = [smollm2_tokenizer.encode(f"Question {i}: what is {i} plus {i}?", add_special_tokens=False)
               for i in range(4)]
    params = [SamplingParams(temperature=0.8, max_tokens=8, seed=100 + i) for i in range(4)]

    async def calls():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

    try:
        answers = asyncio.run(calls())
        assert list(engine.pool.down) == [0] and dead in engine.pool.down[0]
        alone = VLLMEngine([dead], SERVED_NAME, tmp_path / "weights")
        t0 = time.monotonic()
        with pytest.raises(ServerUnreachable, match="no rollout server can be reached") as e:
            asyncio.run(alone.generate(prompts[0], params[0]))
        assert time.monotonic() - t0 < 60 and dead in str(e.value) and "\n" not in str(e.value)
        alone.close()
    finally:
        engine.close()
    for prompt, p, answer in zip(prompts, params, answers):
        ids, _ = _vllm_direct(server["url"], prompt, max_tokens=8, temperature=0.8, seed=p.seed)
        assert answer.token_ids == ids            # the server that answered sampled what it samples for that seed


def test_the_engine_closed_after_its_proxy_stopped_leaves_no_unclosed_session(server, smollm2_tokenizer, tmp_path,
                                                                              caplog):
    """The end of a run: the trainer stops the proxy (its event loop ends) before the backbone closes the engine;
    the HTTP session the proxy's loop opened is closed all the same (no "Unclosed client session")."""
    engine = VLLMEngine([server["url"]], SERVED_NAME, tmp_path / "weights")
    proxy = ProxyServer(engine, smollm2_tokenizer, SamplingParams(max_tokens=4), max_model_len=2048).start()
    try:
        ep = proxy.open_episode("one")
        r = httpx.post(ep.base_url + "/chat/completions", timeout=300,
                       json={"model": "m", "messages": [{"role": "user", "content": "Hi."}]})
        assert r.status_code == 200, r.text[:300]
        proxy.close_episode(ep)
    finally:
        proxy.stop()
        engine.close()
    del engine, proxy
    gc.collect()
    assert not [rec.getMessage() for rec in caplog.records if "Unclosed" in rec.getMessage()]
