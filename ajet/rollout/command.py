"""Command workflows: the user's unmodified program, started once per episode.

    workflow: {command: [python, my_agent.py], env: {MY_FLAG: "1"}, timeout_s: 120}

The program gets the episode's proxy endpoint the way every OpenAI SDK reads it, `OPENAI_BASE_URL` and
`OPENAI_API_KEY` (plus `AJET_MODEL`, `AJET_EPISODE_ID`), and the task as JSON in `AJET_TASK` and on stdin.
Its last non-empty line of stdout is the result: a JSON object with `reward` (and optionally
`final_answer`, `metadata`, `metrics`), or else the final answer as plain text, which the config's judge
scores. Its stderr (the last 16 KiB) is kept in the episode record (`output.metadata.stderr`). A non-zero
exit fails the episode with the stderr tail; at the timeout (or when the episode is cancelled) its whole
process group is killed. The timeout, like `rollout.episode_timeout_s`, does not count the time the program's
calls waited in the engine's queue (`ajet.rollout.deadline`). It runs in the config file's folder unless `cwd` says otherwise, with the
trainer's environment plus `env` (this is the user's own program, not model-written code: see
ajet/tools/sandbox.py for that).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from ajet.config import CommandWorkflowConfig
from ajet.rollout.deadline import EpisodeTimeout, run_within
from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

STDERR_KEEP = 16 * 2**10     # bytes of stderr kept in the episode record
STDOUT_KEEP = 1 * 2**20      # bytes of stdout read back (only the last line matters)


class CommandWorkflow(Workflow):
    """Runs `conf.command` per episode (see the module docstring).

    Args:
        conf: the `workflow:` section (command, env, timeout_s, cwd).
        config_dir: the config file's folder (the default working directory; relative `cwd` resolves here).
    """

    def __init__(self, conf: CommandWorkflowConfig, config_dir: Path | None = None):
        self.conf = conf
        base = Path(config_dir) if config_dir is not None else Path.cwd()
        self.cwd = base / conf.cwd if conf.cwd else base

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        """Run the program once; returns its reward or final answer.

        Raises:
            RuntimeError: the program exited with a non-zero status (message ends with its stderr tail) or
                printed nothing on stdout.
            TimeoutError: it ran past `timeout_s`, not counting the time its calls waited in the engine's
                queue (its process group is killed).
            FileNotFoundError: the program does not exist.
        """
        task_json = json.dumps(task.to_dict())
        env = {k: v for k, v in os.environ.items() if k != "AJET_TEST_KILL_AT"}
        env.update(self.conf.env)
        env.update({"OPENAI_BASE_URL": tuner.base_url, "OPENAI_API_KEY": tuner.api_key, "AJET_MODEL": tuner.model,
                    "AJET_EPISODE_ID": tuner.episode_id, "AJET_TASK": task_json})
        proc = await asyncio.create_subprocess_exec(
            *self.conf.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=str(self.cwd), start_new_session=True)
        out, err = bytearray(), bytearray()
        readers = [asyncio.ensure_future(_read_tail(proc.stdout, out, STDOUT_KEEP)),
                   asyncio.ensure_future(_read_tail(proc.stderr, err, STDERR_KEEP))]
        try:
            proc.stdin.write(task_json.encode() + b"\n")
            try:
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):   # the program does not read stdin: fine
                pass
            try:
                if self.conf.timeout_s is None:
                    await proc.wait()
                else:
                    await run_within(proc.wait(), self.conf.timeout_s, tuner.engine_wait)
            except EpisodeTimeout as exc:
                raise TimeoutError(f"the command ran longer than workflow.timeout_s={self.conf.timeout_s} (not "
                                   f"counting {exc.queued_s:.1f} s its calls waited in the engine's queue); its "
                                   f"process group was killed. stderr tail:\n{_text(err)}") from None
            done, _ = await asyncio.wait(readers, timeout=5.0)
            if len(done) < len(readers):       # a child it left behind still holds the pipes open
                _kill_group(proc.pid)
                await asyncio.gather(*readers)
        finally:
            if proc.returncode is None:        # timeout or cancellation: kill the program and its children
                _kill_group(proc.pid)
                await proc.wait()
            for r in readers:
                r.cancel()
        stderr = _text(err)
        if proc.returncode != 0:
            raise RuntimeError(f"the command {self.conf.command!r} exited with status {proc.returncode}. stderr "
                               f"tail:\n{stderr}")
        lines = [line for line in _text(out).splitlines() if line.strip()]
        if not lines:
            raise RuntimeError(f"the command printed nothing on stdout: its last line must be the final answer or "
                               f'{{"reward": ...}}. stderr tail:\n{stderr}')
        return _result(lines[-1], stderr)


def _result(last: str, stderr: str) -> WorkflowOutput:
    """The output of the program's last stdout line: `{"reward": ...}` JSON, or the final answer text."""
    try:
        data = json.loads(last)
    except ValueError:
        data = None
    if isinstance(data, dict) and ("reward" in data or "final_answer" in data):
        reward = data.get("reward")
        return WorkflowOutput(reward=None if reward is None else float(reward), final_answer=data.get("final_answer"),
                              metadata={**dict(data.get("metadata") or {}), "stderr": stderr},
                              metrics=dict(data.get("metrics") or {}))
    return WorkflowOutput(reward=None, final_answer=last, metadata={"stderr": stderr})


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _read_tail(stream: asyncio.StreamReader, buf: bytearray, keep: int) -> None:
    """Read `stream` to its end, keeping only its last `keep` bytes in `buf`."""
    while chunk := await stream.read(65536):
        buf += chunk
        if len(buf) > keep:
            del buf[: len(buf) - keep]


def _text(buf: bytearray) -> str:
    return bytes(buf).decode("utf-8", errors="replace")
