"""Repository tasks: a repository snapshot, an instruction, and the test command that judges the result.

A task row (JSONL, read by ajet/tasks/jsonl.py; these keys land in `Task.metadata`):

    {"task_id": "clamp", "query": "<the issue text>", "repo": "repos/clamp", "ref": null,
     "test_command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -rA -p no:cacheprovider",
     "tests": ["tests/test_clamp.py::test_low"]}

`repo` is a folder, or a git repository with `ref` (a commit, tag or branch: its tree is taken with
`git archive`); a relative path resolves against the config file's folder. `tests` names the tests whose
share passing is the reward (pytest node ids; without it, every test the command reports counts).
Each episode gets a fresh copy (`checkout`), and `diff` reports what the agent changed.
"""

from __future__ import annotations

import difflib
import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ajet.errors import ConfigError
from ajet.task import Task

IGNORED = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
# The test command of the shipped tasks and `ajet init --kind harness`: pytest without the plugins installed beside
# the trainer (PYTEST_DISABLE_PLUGIN_AUTOLOAD: a task's tests see plain pytest, whatever the trainer's environment
# holds; a task that needs one loads it by name, `-p pytest_asyncio`), and without its cache folder. A run of a few
# tests then takes about 0.2 s of CPU instead of 2.3 s with the test extra's plugins (2-core CPU, 2026-12-07).
DEFAULT_TEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -rA -p no:cacheprovider"
MAX_DIFF_CHARS = 64 * 1024


@dataclass(frozen=True)
class RepoTask:
    """A task's repository, instruction and tests.

    Attributes:
        repo: the snapshot's folder (absolute). ref: a git ref to take from it, or None for the folder as is.
        instruction: what the agent is asked to do (the task's query).
        test_command: a shell command run in the repository copy; it must report pytest-style result lines
            (`PASSED id`, `FAILED id`, `ERROR id`, as `pytest -rA` prints them).
        tests: the test ids whose share passing is the reward ([]: all reported tests).
    """

    repo: Path
    ref: str | None
    instruction: str
    test_command: str
    tests: tuple[str, ...]

    @classmethod
    def from_task(cls, task: Task, base_dir: str | Path | None) -> RepoTask:
        """Read a task's metadata (see the module docstring).

        Raises:
            ConfigError: no `repo`, a folder that does not exist, or `tests` that is not a list of strings.
        """
        meta = task.metadata
        if not meta.get("repo"):
            raise ConfigError(f"task {task.task_id!r} is not a repository task: it needs `repo` (a folder or a git "
                              "repository with `ref`), plus `test_command` and `tests`")
        repo = Path(str(meta["repo"])).expanduser()
        if not repo.is_absolute():
            repo = Path(base_dir or ".") / repo
        if not repo.is_dir():
            raise ConfigError(f"task {task.task_id!r}: repository folder not found: {repo}")
        tests = meta.get("tests") or []
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise ConfigError(f"task {task.task_id!r}: `tests` must be a list of test ids, got {tests!r}")
        return cls(repo.resolve(), meta.get("ref"), task.query, str(meta.get("test_command") or DEFAULT_TEST_COMMAND),
                   tuple(tests))

    def checkout(self, dest: str | Path) -> Path:
        """Write a fresh copy of the snapshot into `dest` (created; must not exist) and return it.

        Raises:
            ConfigError: `git archive` failed for `ref` (unknown ref, not a git repository).
        """
        dest = Path(dest)
        if self.ref is None:
            shutil.copytree(self.repo, dest, ignore=lambda _d, names: [n for n in names if n in IGNORED],
                            symlinks=True)
            return dest
        try:
            tar = subprocess.run(["git", "-C", str(self.repo), "archive", "--format=tar", self.ref], check=True,
                                 capture_output=True, timeout=120).stdout
        except subprocess.CalledProcessError as exc:
            raise ConfigError(f"git archive {self.ref!r} in {self.repo} failed: "
                              f"{exc.stderr.decode(errors='replace').strip()}") from exc
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            tf.extractall(dest, filter="data")
        return dest


def read_tree(root: str | Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `root` (caches and .git skipped)."""
    root = Path(root)
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED)
        for name in sorted(files):
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                out[str(path.relative_to(root))] = path.read_bytes()
    return out


def diff(before: dict[str, bytes], after_root: str | Path) -> str:
    """A unified diff (git style `a/` `b/` names) from the files `before` to the folder `after_root`: what the
    agent changed. Binary files are named, not shown; the diff is cut at MAX_DIFF_CHARS with a marker."""
    after = read_tree(after_root)
    parts = []
    for rel in sorted(set(before) | set(after)):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue
        try:
            old_lines = [] if old is None else old.decode().splitlines(keepends=True)
            new_lines = [] if new is None else new.decode().splitlines(keepends=True)
        except UnicodeDecodeError:
            parts.append(f"Binary file {rel} changed\n")
            continue
        parts.append("".join(difflib.unified_diff(old_lines, new_lines, "/dev/null" if old is None else f"a/{rel}",
                                                  "/dev/null" if new is None else f"b/{rel}")))
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    if len(text) > MAX_DIFF_CHARS:
        text = text[:MAX_DIFF_CHARS] + f"\n[... diff cut at {MAX_DIFF_CHARS} characters ...]\n"
    return text
