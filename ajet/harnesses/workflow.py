"""`workflow: {harness: NAME}`: a registered coding-agent CLI, unmodified, on a repository task per episode.

One episode:
1. the harness is installed into the cache if it is not yet (ajet/harnesses/registry.py; once per version);
2. the task's repository is copied fresh into a temporary folder (ajet/tasks/repo.py), next to a fresh HOME
   holding the harness's config files (its `files`, rendered with the episode's endpoint);
3. the harness runs once, non-interactively, in the sandbox (ajet/tools/workdir_sandbox.py): the copy is its
   working directory, it sees no file of the trainer's and no secret, and its only network is the episode's
   proxy, reached through the unix-socket bridge; every model call it makes is recorded by the proxy;
4. the task's test command runs in the same sandbox on the same copy (ajet/judges/tests.py), with the files of
   the named tests put back as the snapshot has them (editing a test does not pass it): the reward is the share
   of the named tests passing;
5. the episode keeps, in `output.metadata`: `tests` (pass/fail per named test), `diff` (what the agent changed),
   `test_output`, the harness's `exit_status`, `stdout`/`stderr` tails and the sandbox's `isolation`.

Progress (ajet/progress.py): while the workflow's episodes run, one phase "harness NAME" counts the finished
runs and shows how many are running the harness and how many their tests (open from the first episode to the
last of a burst); an install shows as a phase "harness NAME install" (npm or pip may take minutes).

The harness's own exit status does not fail the episode (its work is judged by the tests, and a model that
trips the harness still made calls worth training on); a repository task that cannot be read, a harness that
cannot be installed, or a test command that cannot run (no pytest: a `JudgeError`, ajet/judges/tests.py), fails it
with the reason (recorded and skipped, as every broken episode).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ajet import progress
from ajet.config import HarnessSpec, HarnessWorkflowConfig
from ajet.harnesses.registry import executable, get_harness, install, install_dir, render
from ajet.judges.tests import require_pytest, run_tests
from ajet.task import Task
from ajet.tasks.repo import RepoTask, diff, read_tree
from ajet.tools.workdir_sandbox import (BRIDGE_PORT, HOME_DIR, SANDBOX_DIR, ProxyBridge, WorkdirLimits, run_in_workdir,
                                        uses_bwrap)
from ajet.workflow import Tuner, Workflow, WorkflowOutput

TAIL_CHARS = 8 * 1024
INSTRUCTION = "{query}\n\nThe repository is your current working directory. Run its tests with: {test_command}"


class HarnessWorkflow(Workflow):
    """Runs the harness `conf.harness` on each episode's repository task (see the module docstring).

    Args:
        conf: the `workflow:` section. extra: the config's own `harnesses:` (added to the built-in ones).
        config_dir: the config file's folder (relative `repo` paths of tasks resolve here).

    Raises:
        ConfigError: an unknown harness name.
        TestsJudgeUnavailable: this Python has no pytest, which the tests judge runs (`require_pytest`).
    """

    def __init__(self, conf: HarnessWorkflowConfig, extra: dict[str, HarnessSpec] | None = None,
                 config_dir: Path | None = None):
        require_pytest()   # before the run starts, not as every episode's failure
        self.conf = conf
        self.name = conf.harness
        self.spec = get_harness(conf.harness, extra)
        self.config_dir = config_dir
        self._install_lock = asyncio.Lock()
        self._lock = threading.Lock()   # the progress counts; episodes may run on several threads' loops
        self._counts = {"episodes": 0, "running": 0, "testing": 0}
        self._phase: progress.Phase | None = None

    def __getstate__(self) -> dict:
        """For Ray (`--with-ray` ships the workflow pickled): without the lock and the open phase."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_phase", "_counts")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._counts = {"episodes": 0, "running": 0, "testing": 0}
        self._phase = None

    def _stage(self, **moves: int) -> None:
        """Move the progress counts by `moves` (episodes/running/testing +-1, done +1) and show them: the phase
        "harness NAME" opens with the first episode in flight and closes when none is."""
        with self._lock:
            done = moves.pop("done", 0)
            for k, v in moves.items():
                self._counts[k] += v
            c = self._counts
            if self._phase is None and c["episodes"] > 0:
                self._phase = progress.phase(f"harness {self.name}")
            p = self._phase
            if p is not None:
                p.advance(done, running=c["running"], testing=c["testing"])
                if c["episodes"] == 0:
                    p.close()
                    self._phase = None

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        """One episode: install (cached), copy, run the harness, run the tests, diff.

        Raises:
            ConfigError: the task is not a repository task. HarnessInstallError: the install failed.
            SandboxUnavailable: `sandbox.isolation: bwrap` and bubblewrap does not work here.
        """
        repo_task = RepoTask.from_task(task, self.config_dir)
        self._stage(episodes=1)
        try:
            return await self._execute(repo_task, tuner)
        finally:
            self._stage(episodes=-1, done=1)

    async def _execute(self, repo_task: RepoTask, tuner: Tuner) -> WorkflowOutput:
        async with self._install_lock:     # episodes of one step wait for one install, not race to it
            exe = executable(self.name, self.spec)
            if exe is None:
                with progress.phase(f"harness {self.name} install"):
                    exe = await asyncio.to_thread(install, self.name, self.spec)
        sb = self.conf.sandbox
        use_bwrap, _ = uses_bwrap(sb.isolation)
        tmp = Path(tempfile.mkdtemp(prefix="ajet-harness-"))
        try:
            work = repo_task.checkout(tmp / "repo")
            home = tmp / "home"
            home.mkdir()
            before = read_tree(work)
            proxy = urlsplit(tuner.base_url)
            base_url = (urlunsplit(proxy._replace(netloc=f"127.0.0.1:{BRIDGE_PORT}")) if use_bwrap
                        else tuner.base_url)
            values = {"instruction": INSTRUCTION.format(query=repo_task.instruction,
                                                        test_command=repo_task.test_command),
                      "model": self.conf.model or self.spec.model or tuner.model, "api_key": tuner.api_key,
                      "base_url": base_url,
                      "root_url": base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url,
                      "home": HOME_DIR if use_bwrap else str(home), "workdir": SANDBOX_DIR if use_bwrap else str(work)}
            for rel, text in self.spec.files.items():
                path = home / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(render(text, values))
            # the trainer's interpreter first: the model's `python -m pytest` must not find a pip harness's own venv
            path_var = ":".join([os.path.join(sys.prefix, "bin"), os.path.dirname(exe), "/usr/local/bin", "/usr/bin",
                                 "/bin"])
            env = {"PATH": path_var, **{k: render(v, values) for k, v in self.spec.env.items()}, **self.conf.env}
            for profile in (".profile", ".bash_profile"):   # a login shell (Codex's) resets PATH from /etc/profile
                (home / profile).write_text(f'export PATH="{env["PATH"]}"\n')
            folder = install_dir(self.name, self.spec)
            limits = WorkdirLimits(timeout_s=self.conf.timeout_s or self.spec.timeout_s, memory_mb=sb.memory_mb,
                                   max_processes=sb.max_processes, max_file_mb=sb.max_file_mb)
            bridge = ProxyBridge(proxy.hostname, proxy.port) if use_bwrap else contextlib.nullcontext(None)
            self._stage(running=1)
            try:
                async with bridge as bridge_folder:
                    run = await run_in_workdir([exe, *(render(a, values) for a in self.spec.argv)], work, home, env=env,
                                           limits=limits, isolation=sb.isolation,
                                               read_only=[str(folder)] if folder else [],
                                               bridge_folder=bridge_folder)
            finally:
                self._stage(running=-1)
            changes = diff(before, work)
            for rel in {t.split("::")[0] for t in repo_task.tests} & set(before):   # the agent's edits to the
                (work / rel).write_bytes(before[rel])                              # named tests do not count
            self._stage(testing=1)
            try:
                report = await run_tests(repo_task.test_command, work, home, repo_task.tests, path=path_var,
                                         limits=WorkdirLimits(timeout_s=self.conf.test_timeout_s,
                                                              memory_mb=sb.memory_mb, max_processes=sb.max_processes,
                                                              max_file_mb=sb.max_file_mb),
                                         isolation=sb.isolation)
            finally:
                self._stage(testing=-1)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        passed = sum(v == "passed" for v in report.results.values())
        return WorkflowOutput(
            reward=report.reward, final_answer=run.stdout[-TAIL_CHARS:].strip() or None,
            metadata={"harness": self.name, "harness_version": self.spec.version, "api": self.spec.api,
                      "tests": report.results, "diff": changes, "test_output": report.output,
                      "exit_status": run.returncode, "timed_out": run.timed_out, "stdout": run.stdout[-TAIL_CHARS:],
                      "stderr": run.stderr[-TAIL_CHARS:], "isolation": run.isolation},
            metrics={"tests_passed": float(passed), "tests_total": float(len(report.results)),
                     "harness_exit_ok": float(run.ok), "diff_lines": float(changes.count("\n"))})
