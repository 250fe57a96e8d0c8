"""`ajet serve` without `--conf`: a real job server on 127.0.0.1 (one per module) takes a 1-step job of the tiny model
from `AjetClient.submit` (an `ajet.Job` with its tasks as data), a client runs its episodes through the server's one
URL and the job trains; a bad job is a 400 with the config's "did you mean" and the server keeps waiting; a submit
without the secret or with a wrong one is a 401, with a client key of `--keys` a 403 (the client key runs the
episodes, an admin key submits); a queued job is stopped; `AsyncAjetClient` has the same job methods;
a failed job reports its own exit status; `kill -9` of the server leaves no job process behind, and `--resume`
continues the job."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ajet.client import AjetClient, AjetClientError, AsyncAjetClient, RunFinished
from tests.local_servers import announced_url

SECRET = "jobs-secret-0123456789abcdef"
CLIENT_KEY = "alice-client-key-0123456789"   # --keys: client `alice`; admin `ops` from AJET_TEST_OPS_KEY
OPS_KEY = "ops-admin-key-0123456789abcdef"
KEYS_YAML = ("serve:\n  keys:\n    - {name: alice, key: %s, scope: client}\n"
             "    - {name: ops, key_env: AJET_TEST_OPS_KEY, scope: admin}\n" % CLIENT_KEY)
TASKS = [{"task_id": f"t{i}", "query": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(6)]


def _config(model_dir: str, steps: int = 1) -> dict:
    return {"model": {"path": model_dir, "max_model_len": 256}, "rollout": {"num_repeat": 2, "max_tokens": 4},
            "algorithm": {"lr": 1.0e-3}, "trainer": {"total_steps": steps, "tasks_per_step": 2, "save_freq": 1,
                                                     "tensorboard": False}}


class JobServer:
    """`ajet serve --exp-root ROOT` in a subprocess; `url` once its 'job server on' line is printed."""

    def __init__(self, root: Path, *extra: str):
        self.root = root
        env = {**os.environ, "AJET_SECRET": SECRET, "AJET_TEST_OPS_KEY": OPS_KEY}
        (root.parent / f"{root.name}-keys.yaml").write_text(KEYS_YAML)
        self.proc = subprocess.Popen([sys.executable, "-m", "ajet", "serve", "--exp-root", str(root), "--port", "0",
                                      "--keys", str(root.parent / f"{root.name}-keys.yaml"), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.lines, self.url = announced_url(self.proc, "job server on ", "ajet serve", 120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class Holder:
    """The module's one job server; `restart` replaces it by the same root's server started with --resume."""

    def __init__(self, root: Path):
        self.srv = JobServer(root)

    @property
    def url(self) -> str:
        return self.srv.url

    def restart(self) -> tuple[int, str]:
        rc = self.srv.stop()
        out = "".join(self.srv.lines)
        self.srv = JobServer(self.srv.root, "--resume")
        return rc, out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    holder = Holder(tmp_path_factory.mktemp("jobs"))
    yield holder
    holder.srv.stop()


def _run_episodes(url: str, max_episodes: int = 50) -> int:
    """Episodes of the running job, answered by the tiny model, rewarded 1.0 for a non-empty answer; until the
    run is finished. Returns how many were finished. With `--keys`' client key: the job's own server checks it."""
    done = 0
    with AjetClient(url, secret=CLIENT_KEY, retry_for_s=300) as client:
        for _ in range(max_episodes):
            try:
                with client.episode() as ep:
                    assert ep.base_url.startswith(url + "/ep/")       # the one URL, not the job's own port
                    r = ep.openai().chat.completions.create(
                        model=ep.model, messages=[{"role": "user", "content": ep.task["query"]}], max_tokens=4)
                    ep.finish(reward=float(len(r.choices[0].message.content or "") % 2))
                    done += 1
            except RunFinished:
                return done
    return done


def test_a_submitted_job_trains_on_client_episodes(server, tiny_model_dir):
    import ajet

    job = ajet.Job(tasks=TASKS, **_config(tiny_model_dir))
    with AjetClient(server.url, secret=OPS_KEY) as admin:          # an admin key of --keys submits
        queued = admin.submit(job)
        assert queued["state"] in ("queued", "running") and queued["total_steps"] == 1
        finished = _run_episodes(server.url)
        out = admin.wait(queued["id"], timeout_s=300)
        assert out["state"] == "done", out.get("error")
        assert finished >= 4                                   # one step: 2 tasks x 2 repeats
        assert out["result"]["steps"] == 1 and out["step"] == 1
        rows = [json.loads(line) for line in (Path(out["exp_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r.get("step", 0) >= 1] == [1]
        assert out["result"]["checkpoint"] is not None
        assert [j["id"] for j in admin.jobs()].count(queued["id"]) == 1
        queue = json.loads((Path(out["exp_dir"]).parent / "jobs.json").read_text())
        assert [j["state"] for j in queue["jobs"] if j["id"] == queued["id"]] == ["done"]


def test_a_bad_job_is_a_400_with_did_you_mean(server, tiny_model_dir):
    bad = {**_config(tiny_model_dir), "trainer": {"total_stepz": 1}, "data": {"train_path": "x.jsonl"}}
    with AjetClient(server.url, secret=SECRET) as admin:
        with pytest.raises(AjetClientError) as err:
            admin.submit(bad)
        assert err.value.status == 400 and err.value.code == "invalid_job"
        assert "total_stepz" in err.value.message and "did you mean" in err.value.message
        assert "total_steps" in err.value.message
        assert all(j["state"] != "queued" for j in admin.jobs())   # nothing was queued; the server answers on


def test_submit_and_stop_need_an_admin_key(server, tiny_model_dir):
    """No key or a wrong one: 401 on every job route; a client key of --keys: 403 naming the admin key it needs on
    submit and stop, nothing queued, while it lists and reads jobs; a job may not bring serve.keys."""
    body = {"config": {**_config(tiny_model_dir), "data": {"train_path": "x.jsonl"}}}
    for headers in ({}, {"Authorization": "Bearer not-the-secret"}):
        r = httpx.post(server.url + "/ajet/v1/jobs", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_secret"
    assert httpx.get(server.url + "/ajet/v1/jobs", timeout=30).status_code == 401
    with AjetClient(server.url, secret=CLIENT_KEY) as alice:
        before = [j["id"] for j in alice.jobs()]                 # a client key lists jobs
        for call in (lambda: alice.submit(body), lambda: alice.stop("job-404")):
            with pytest.raises(AjetClientError) as err:
                call()
            assert err.value.status == 403 and err.value.code == "admin_key_required", err.value
            assert "`alice` is a client key" in err.value.message and "needs an admin key" in err.value.message
        assert [j["id"] for j in alice.jobs()] == before         # nothing queued
    r = httpx.get(f"{server.url}/ajet/v1/jobs/job-404", headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_job", r.text   # reads jobs: past the key
    with AjetClient(server.url, secret=OPS_KEY) as admin, pytest.raises(AjetClientError) as err:
        admin.submit({"config": {**_config(tiny_model_dir), "serve": {"keys": [{"name": "x", "key": OPS_KEY}]}},
                      "tasks": {"train": TASKS}})                # a job's keys would be the server's
    assert err.value.status == 400 and "serve.keys" in err.value.message, err.value


def test_stop_a_queued_job(server, tiny_model_dir):
    with AjetClient(server.url, secret=SECRET) as admin:
        first = admin.submit({"config": _config(tiny_model_dir, steps=3), "tasks": {"train": TASKS}})
        second = admin.submit({"config": _config(tiny_model_dir), "tasks": {"train": TASKS}})
        assert admin.stop(second["id"])["state"] == "stopped"     # queued behind the first: leaves the queue
        deadline = time.monotonic() + 120
        while admin.jobs()[-2]["state"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.5)
        admin.stop(first["id"])                                    # running (no client): Ctrl-C's clean stop
        assert admin.wait(first["id"], timeout_s=180)["state"] == "stopped"
        assert admin.wait(second["id"], timeout_s=5)["state"] == "stopped"
        assert not (Path(first["exp_dir"]).parent / second["id"] / "metrics.jsonl").exists()   # never ran


def _wait_step(admin: AjetClient, job_id: str, step: int, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = next(j for j in admin.jobs() if j["id"] == job_id)
        if job["step"] >= step and (Path(job["exp_dir"]) / "checkpoints" / f"step_{step}").is_dir():
            return job
        time.sleep(0.5)
    raise AssertionError(f"{job_id} did not reach step {step}: {job}")


def test_a_restarted_server_resumes_its_running_job_and_keeps_the_queue(server, tiny_model_dir):
    with AjetClient(server.url, secret=SECRET) as admin:
        running = admin.submit({"config": _config(tiny_model_dir, steps=2), "tasks": {"train": TASKS}})
        queued = admin.submit({"config": _config(tiny_model_dir), "tasks": {"train": TASKS}})
    assert _run_episodes(server.url, max_episodes=4) == 4       # step 1's groups (2 tasks x 2 repeats)
    with AjetClient(server.url, secret=SECRET) as admin:
        assert _wait_step(admin, running["id"], 1)["state"] == "running"   # step 1 checkpointed, step 2 waits
    rc, out = server.restart()                                   # Ctrl-C, then the same command with --resume
    assert rc == 130, out
    assert "continue with the same command and --resume" in out and running["id"] in out
    with AjetClient(server.url, secret=SECRET) as admin:
        assert [j["state"] for j in admin.jobs() if j["id"] in (running["id"], queued["id"])] == ["running", "queued"]
        _run_episodes(server.url)                                # step 2 only: step 1 came from the checkpoint
        out = admin.wait(running["id"], timeout_s=300)
        assert out["state"] == "done", out.get("error")
        assert [r["step"] for r in map(json.loads, (Path(out["exp_dir"]) / "metrics.jsonl").read_text().splitlines())
                if r.get("step", 0) >= 1] == [1, 2]
        log = (server.srv.root / ".jobs" / running["id"] / "output.log").read_text()
        assert "resumed from" in log and "no checkpoint yet" not in log
        admin.stop(queued["id"])                                  # the queue went on: its next job runs now
        assert admin.wait(queued["id"], timeout_s=180)["state"] == "stopped"


def test_the_async_client_has_the_job_methods(server, tiny_model_dir):
    """`AsyncAjetClient.submit`, `jobs`, `wait` and `stop` on the module's server: the same 400 for a bad job and 401
    for a wrong secret as `AjetClient`'s; a 1-step job trains (episodes from a thread) while `wait` awaits it."""
    import ajet

    async def main() -> tuple[dict, dict, int]:
        async with AsyncAjetClient(server.url, secret="not-the-secret") as stranger:
            with pytest.raises(AjetClientError) as err:
                await stranger.jobs()
            assert err.value.status == 401 and err.value.code == "invalid_secret"
        async with AsyncAjetClient(server.url, secret=SECRET) as admin:
            with pytest.raises(AjetClientError) as err:
                await admin.submit({**_config(tiny_model_dir), "trainer": {"total_stepz": 1},
                                    "data": {"train_path": "x.jsonl"}})
            assert err.value.status == 400 and "did you mean" in err.value.message, err.value.message
            queued = await admin.submit(ajet.Job(tasks=TASKS, **_config(tiny_model_dir)))
            assert queued["state"] in ("queued", "running") and queued["total_steps"] == 1
            assert queued["id"] in [j["id"] for j in await admin.jobs()]
            with pytest.raises(TimeoutError):                      # no episodes yet: it cannot have finished
                await admin.wait(queued["id"], timeout_s=0)
            episodes = asyncio.ensure_future(asyncio.to_thread(_run_episodes, server.url))
            out = await admin.wait(queued["id"], timeout_s=300, poll_s=0.5)
            with pytest.raises(AjetClientError) as err:
                await admin.stop("job-404")
            assert err.value.status == 404 and err.value.code == "unknown_job"
            return out, await admin.stop(queued["id"]), await episodes

    out, stopped, finished = asyncio.run(main())
    assert out["state"] == "done", out.get("error")
    assert out["result"]["steps"] == 1 and out["result"]["checkpoint"] is not None and finished >= 4
    assert stopped["state"] == "done"                              # a finished job stays as it is


def test_a_job_that_fails_reports_its_own_exit_status(server, tmp_path):
    """A job whose model folder does not exist (a path on the server: checked when the job's run starts) fails
    with the job's own exit status, 2 (the CLI's for bad input), and its last output lines: the one-line error."""
    config = {**_config(str(tmp_path / "no-such-model")), "trainer": {"total_steps": 1, "tasks_per_step": 2}}
    with AjetClient(server.url, secret=SECRET) as admin:
        out = admin.wait(admin.submit({"config": config, "tasks": {"train": TASKS}})["id"], timeout_s=180)
    assert out["state"] == "failed", out
    assert out["error"].startswith("exit status 2: "), out["error"]
    last = out["error"].splitlines()[-1]                           # the job's line, nothing after it
    assert last.startswith(f"ajet: error: model folder {tmp_path / 'no-such-model'} does not exist"), out["error"]


def _proc_stat(pid: str) -> list[str]:
    """Fields 3 on of /proc/PID/stat (state, ppid, pgrp, ...); [] for a process that is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def _job_process(server_pid: int, job_id: str, timeout_s: float = 120) -> int:
    """The pid of the process that the job server `server_pid` started for job `job_id` (its child whose command
    line names the job's job.yaml)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if (entry.name.isdigit() and _proc_stat(entry.name)[1:2] == [str(server_pid)]
                        and f"/{job_id}/job.yaml".encode() in (entry / "cmdline").read_bytes()):
                    return int(entry.name)
            except OSError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"no process of {job_id} under the server {server_pid}")


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a zombie, waiting for init to reap it, holds nothing)."""
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and (st := _proc_stat(e.name))[2:3] == [str(pgid)] and st[0] != "Z"]


def test_a_killed_server_leaves_no_job_process_and_resume_continues_the_job(server, tiny_model_dir):
    """`kill -9` of the job server while its job runs (its own server up, waiting for episodes): the job's process
    group (the job's `ajet serve` and its children) is gone soon after, not orphaned; the same command with --resume
    runs the job again from where it was (no checkpoint yet: from the start) and it trains to the end."""
    with AjetClient(server.url, secret=SECRET, retry_for_s=300) as admin:
        job = admin.submit({"config": _config(tiny_model_dir), "tasks": {"train": TASKS}})
        pgid = os.getpgid(_job_process(server.srv.proc.pid, job["id"]))
        assert admin.status()["total_steps"] == 1                  # the job's own server answers (through the front)
    assert pgid != os.getpgid(server.srv.proc.pid) and _group(pgid)
    server.srv.proc.kill()
    server.srv.proc.wait()
    deadline = time.monotonic() + 90                               # its clean stop, or its SIGKILL after 60 s
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group(pgid), f"left running after kill -9 of the server: {_group(pgid)}"
    server.srv = JobServer(server.srv.root, "--resume")
    with AjetClient(server.url, secret=SECRET) as admin:
        assert next(j for j in admin.jobs() if j["id"] == job["id"])["state"] == "running"
        assert _run_episodes(server.url) >= 4
        out = admin.wait(job["id"], timeout_s=300)
    assert out["state"] == "done" and out["result"]["steps"] == 1, out.get("error")
    log = (server.srv.root / ".jobs" / job["id"] / "output.log").read_text()
    assert "resumed from the start (no checkpoint yet)" in log
