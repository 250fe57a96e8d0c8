"""The job queue of `ajet serve` started without `--conf`: jobs submitted over HTTP (ajet/serve/jobs_api.py), run one
after another, each as its own `ajet serve --conf JOB.yaml` on a loopback port in its own experiment folder
(`ROOT/<job id>/`), the queue kept in `ROOT/jobs.json` (written atomically: a temporary file renamed over it).

A job is a config mapping (the YAML's keys, checked by the same models as a file: `config_from_mapping`) and,
optionally, its tasks as data (`{"train": [rows], "val": [...], "test": [...]}`, written to
`ROOT/.jobs/<job id>/<split>.jsonl`). Its states: queued -> running -> done | failed | stopped.

A job's process runs under the watchdog of the vLLM server (ajet/engines/watchdog.py): the watchdog leads the job's
process group and holds the read end of a pipe whose write end only this server holds. Closing it (a stop of the job,
or of this server) or this server's death (`kill -9` included) makes the watchdog send the job SIGTERM, the clean stop
of Ctrl-C (ajet/interrupt.py), then SIGKILL the group after `STOP_GRACE_S`: a job never outlives its server. A server
stopped (or killed) keeps its running job `running` in jobs.json, and `ajet serve --exp-root ROOT --resume` continues
it with `--resume` (from its newest checkpoint), then the rest of the queue.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ajet.engines import watchdog
from ajet.errors import ConfigError
from ajet.ports import free_port
from ajet.serve.keys import KEYS_ENV, to_env

STATES = ("queued", "running", "done", "failed", "stopped")
SPLIT_KEYS = {"train": "train_path", "val": "val_path", "test": "test_path"}
STATE_FILE = "jobs.json"
START_TIMEOUT_S = 600.0   # at most this long a job's server may take to load its model and answer, seconds
OUTPUT_TAIL = 40          # lines of a failed job's output kept for its `error`
STOP_GRACE_S = 60.0       # how long a stopped job may take to stop cleanly before its group is SIGKILLed, seconds


class JobQueue:
    """The jobs of one root folder and the thread that runs them.

    Args:
        root: the server's folder (jobs.json, one experiment folder per job).
        secret: the secret every job's server checks (the admin key of the queue; None: only `keys`).
        resume: continue the queue in `root/jobs.json` (its running job with `--resume`).
        backbone: the `--backbone` each job runs with (None: the job's config decides).
        keys: (name, key, scope) of the server's `--keys`, which every job's server checks too: handed over in the
            environment (ajet/serve/keys.py), as the secret is, never written to the job's files.

    Raises:
        ConfigError: `root` holds a queue with unfinished jobs and `resume` is off.
    """

    def __init__(self, root: Path, secret: str | None, resume: bool = False, backbone: str | None = None,
                 keys: list[tuple[str, str, str]] = ()):
        self.root, self.secret, self.backbone, self.keys = Path(root).resolve(), secret, backbone, list(keys)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._proc: subprocess.Popen | None = None   # the running job's watchdog (the leader of its process group)
        self._owner_fd: int | None = None             # the write end of its watchdog's pipe: closed, the job stops
        self.child_url: str | None = None   # the running job's server, once it answers
        self._stop_requested: set[str] = set()
        self._thread = threading.Thread(target=self._run_all, name="ajet-jobs", daemon=True)
        state = self._read()
        unfinished = [j for j in state["jobs"] if j["state"] in ("queued", "running")]
        if unfinished and not resume:
            raise ConfigError(f"{self.root} holds a job queue ({len(unfinished)} unfinished job(s), first "
                              f"{unfinished[0]['id']}): continue it with --resume, or pick an empty --exp-root")
        for job in state["jobs"]:
            job["resume"] = job["state"] == "running"
        self.state = state

    # ---- the queue ----------------------------------------------------------------------------------------------
    def submit(self, config: Any, tasks: Any = None) -> dict[str, Any]:
        """Validate a job and queue it; returns its public record.

        Args:
            config: the experiment's config keys, nested by section (a YAML file's mapping).
            tasks: None, or {"train"|"val"|"test": [task rows]}: the job's tasks as data.

        Raises:
            ConfigError: not a mapping, unknown keys (with a "did you mean"), bad values, bad task rows, a setting
                the backbone does not honour, `serve.keys` (the server's own are every job's): the message says
                what to fix; nothing is queued.
        """
        import shutil

        import yaml

        from ajet.backbones.capabilities import check_supported
        from ajet.config.loading import config_from_mapping

        if not isinstance(config, dict):
            raise ConfigError(f"job: `config` must be a mapping of config keys, got {type(config).__name__}")
        if isinstance(config.get("serve"), dict) and "keys" in config["serve"]:
            raise ConfigError("job: `serve.keys` is the job server's (`ajet serve --keys FILE`), and its keys reach "
                              "every job's server: remove serve.keys from the job")
        if tasks is not None and (not isinstance(tasks, dict) or set(tasks) - set(SPLIT_KEYS)):
            raise ConfigError(f"job: `tasks` must map {', '.join(SPLIT_KEYS)} to lists of task rows")
        with self._lock:
            job_id = f"job-{self.state['next']}"
            self.state["next"] += 1
        inputs = self.root / ".jobs" / job_id
        inputs.mkdir(parents=True, exist_ok=True)
        try:
            data = {k: v for k, v in config.items() if k != "mode"}
            data["trainer"] = {**(data.get("trainer") or {}), "exp_dir": str(self.root / job_id)}
            data["serve"] = {k: v for k, v in (data.get("serve") or {}).items() if k not in ("host", "port", "secret")}
            for split, rows in (tasks or {}).items():
                if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows) or not rows:
                    raise ConfigError(f"job: `tasks.{split}` must be a non-empty list of task rows "
                                      f"({{\"query\", \"answer\"?, ...}})")
                (inputs / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                data["data"] = {**(data.get("data") or {}), SPLIT_KEYS[split]: str(inputs / f"{split}.jsonl")}
            cfg = config_from_mapping(data, "job", mode="serve", overrides_source=None)
            if self.backbone:
                cfg.backbone = self.backbone
            check_supported(cfg)
            (inputs / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        except BaseException:
            shutil.rmtree(inputs, ignore_errors=True)
            raise
        job = {"id": job_id, "state": "queued", "step": 0, "total_steps": cfg.trainer.total_steps,
               "experiment_name": cfg.experiment_name, "exp_dir": str(self.root / job_id),
               "submitted_at": time.time(), "started_at": None, "ended_at": None, "result": None, "error": None,
               "resume": False}
        with self._wake:
            self.state["jobs"].append(job)
            self._write()
            self._wake.notify_all()
        return self.public(job)

    def jobs(self) -> list[dict[str, Any]]:
        """Every job's public record (id, state, step, total_steps, exp_dir, result, error, ...), oldest first."""
        with self._lock:
            return [self.public(j) for j in self.state["jobs"]]

    def get(self, job_id: str) -> dict[str, Any] | None:
        """The job's public record, None when no job has that id."""
        with self._lock:
            job = self._find(job_id)
            return None if job is None else self.public(job)

    def stop(self, job_id: str) -> dict[str, Any] | None:
        """Stop a job: a queued one leaves the queue (state stopped), a running one gets Ctrl-C's clean stop (its
        folder keeps what it trained). A finished job stays as it is. None when no job has that id."""
        with self._wake:
            job = self._find(job_id)
            if job is None:
                return None
            if job["state"] == "queued":
                job.update(state="stopped", ended_at=time.time())
                self._write()
            elif job["state"] == "running":
                self._stop_requested.add(job_id)
                self._release()
            self._wake.notify_all()
            return self.public(job)

    def public(self, job: dict[str, Any]) -> dict[str, Any]:
        """What clients see of a job (its running step read from its metrics.jsonl)."""
        out = {k: v for k, v in job.items() if k != "resume"}
        if job["state"] == "running":
            out["step"] = _steps(Path(job["exp_dir"]))
        return out

    # ---- running ------------------------------------------------------------------------------------------------
    def start(self) -> JobQueue:
        """Start running the queue in a thread."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 60.0) -> str | None:
        """Stop: the running job gets Ctrl-C's clean stop and stays `running` in jobs.json (continued by
        `--resume`); returns its id, None when none was running."""
        with self._wake:
            self._closing = True
            proc, running = self._proc, next((j["id"] for j in self.state["jobs"] if j["state"] == "running"), None)
            self._release()
            self._wake.notify_all()
        if proc is not None:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
        self._thread.join(10)
        return running

    def _run_all(self) -> None:
        while True:
            with self._wake:
                while not self._closing and not any(j["state"] in ("queued", "running") for j in self.state["jobs"]):
                    self._wake.wait()
                if self._closing:
                    return
                job = next(j for j in self.state["jobs"] if j["state"] in ("running", "queued"))
                job.update(state="running", started_at=job["started_at"] or time.time())
                self._write()
            self._run_one(job)

    def _run_one(self, job: dict[str, Any]) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "ajet", "serve", "--conf", str(self.root / ".jobs" / job["id"] / "job.yaml"),
               "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--backbone", self.backbone] if self.backbone else []
        cmd += ["--resume"] if job.get("resume") else []
        log_path = self.root / ".jobs" / job["id"] / "output.log"
        with self._wake:
            if self._closing:
                return
            read_fd, self._owner_fd = os.pipe()     # neither end is inherited by other children (O_CLOEXEC)
            with open(log_path, "ab") as log:   # the job's own stdout and stderr (its step lines, its errors)
                start = log.tell()
                try:
                    self._proc = proc = subprocess.Popen(
                        [sys.executable, "-I", watchdog.__file__, str(read_fd), f"{STOP_GRACE_S:g}", "--", *cmd],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(read_fd,),
                        start_new_session=True, env=self._env())
                except BaseException:
                    self._release()
                    raise
                finally:
                    os.close(read_fd)
            if job["id"] in self._stop_requested:   # stopped between leaving the queue and its process starting
                self._release()
        url = f"http://127.0.0.1:{port}"
        if _wait_up(url, proc, START_TIMEOUT_S):
            self.child_url = url
        proc.wait()
        self.child_url = None
        with open(log_path, "rb") as log:   # this run's output: the job's, then the watchdog's last line
            log.seek(start)
            lines = log.read().decode(errors="replace").splitlines()
        code = watchdog.exit_code("\n".join(lines[-5:]))
        rc = proc.returncode if code is None else code
        with self._wake:
            self._release()
            self._proc = None
            if self._closing and job["id"] not in self._stop_requested:
                return                                  # the server stops: the job stays running (--resume)
            job["resume"] = False
            job["ended_at"] = time.time()
            job["step"] = _steps(Path(job["exp_dir"]))
            if job["id"] in self._stop_requested:
                job["state"] = "stopped"
            elif rc == 0:
                job["state"] = "done"
            else:
                job["state"] = "failed"
                lines = [line for line in lines if watchdog.exit_code(line) is None]
                job["error"] = f"exit status {rc}: " + "\n".join(lines[-OUTPUT_TAIL:])
            job["result"] = _summary(Path(job["exp_dir"]))
            self._write()

    def _env(self) -> dict[str, str]:
        """A job's environment: this server's, with its secret (AJET_SECRET) and keys (`keys.KEYS_ENV`)."""
        env = {k: v for k, v in os.environ.items() if k not in ("AJET_SECRET", KEYS_ENV)}
        return {**env, **({"AJET_SECRET": self.secret} if self.secret else {}), **to_env(self.keys)}

    def _release(self) -> None:
        """Close the running job's end of its watchdog's pipe: the watchdog stops the job (SIGTERM, SIGKILL of its
        group after `STOP_GRACE_S`). Idempotent; the caller holds the lock."""
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    # ---- storage ------------------------------------------------------------------------------------------------
    def _find(self, job_id: str) -> dict[str, Any] | None:
        return next((j for j in self.state["jobs"] if j["id"] == job_id), None)

    def _read(self) -> dict[str, Any]:
        path = self.root / STATE_FILE
        if not path.is_file():
            return {"next": 1, "jobs": []}
        try:
            state = json.loads(path.read_text())
            assert isinstance(state["jobs"], list) and isinstance(state["next"], int)
            return state
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise ConfigError(f"{path} is not a job queue this server wrote ({exc}): move it away") from None

    def _write(self) -> None:
        """jobs.json, atomically (a temporary file renamed over it); the caller holds the lock."""
        path = self.root / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, path)


def _steps(exp_dir: Path) -> int:
    """How many steps the run in `exp_dir` has trained (its metrics.jsonl's rows of step >= 1)."""
    path = exp_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = set()
    for line in path.read_text(errors="replace").splitlines():
        try:
            step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue                       # a line being written
        if isinstance(step, int) and step >= 1:
            steps.add(step)
    return len(steps)


def _summary(exp_dir: Path) -> dict[str, Any]:
    """A finished job's result: its trained steps, the last step's figures, held-out figures, final model."""
    from ajet.job import JobResult

    r = JobResult.read(exp_dir)
    return {"exp_dir": str(exp_dir), "steps": len(r.steps), "last_step": r.steps[-1] if r.steps else None,
            "held_out": r.held_out, "checkpoint": None if r.checkpoint is None else str(r.checkpoint)}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (a job's watchdog, the job and its children) and reap `proc`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the job's server at `url` answers (any HTTP answer) before `timeout_s` seconds or its exit."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(url + "/ajet/v1/status", timeout=2)
            return True
        except httpx.TransportError:
            time.sleep(0.3)
    return False
