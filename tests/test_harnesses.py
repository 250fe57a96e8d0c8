"""Registered coding-agent harnesses, unmodified, on a shipped repository task, in the sandbox, against the real
proxy, with a scripted engine playing a competent model: it reads the file, runs the failing test, edits with
the harness's own edit tool, reruns the test, answers (aider, which has no tools, gets one reply holding the
whole fixed file in its whole-file format).

Each harness is installed by the registry into its cache on first use (`$AJET_HARNESS_CACHE`, default
`~/.cache/ajet/harnesses`; npm packages take seconds, pip packages seconds with `uv`, up to a minute with pip);
a test skips, saying why, only when node/npm (for an npm package) are absent or the install cannot reach its
registry. The task is `median` of tutorial/example_swe_tasks (its mutation turned `/ 2` into `/ 3`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ajet.config import HarnessSpec, HarnessWorkflowConfig
from ajet.harnesses import registry
from ajet.harnesses.registry import HarnessInstallError, builtin_harnesses, executable, install
from ajet.harnesses.workflow import HarnessWorkflow
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.tasks import read_jsonl_tasks
from ajet.tasks.repo import DEFAULT_TEST_COMMAND
from ajet.tools.sandbox import bwrap_status
from ajet.tools.workdir_sandbox import SANDBOX_DIR
from ajet.workflow import Tuner
from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import ScriptedEngine

TASKS = Path(__file__).resolve().parent.parent / "tutorial" / "example_swe_tasks"
BUG = "return (s[mid - 1] + s[mid]) / 3"
FIX = "return (s[mid - 1] + s[mid]) / 2"
WRONG = "return (s[mid - 1] + s[mid]) / 4"
TEST_CMD = DEFAULT_TEST_COMMAND               # what the instruction tells the agent to run
BWRAP, WHY_NOT = bwrap_status()


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _codex_script(new: str, peek: str | None = None) -> list[str]:
    patch = (f"apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: median.py\n@@\n-    {BUG}\n+    {new}\n"
             "*** End Patch\nEOF")
    head = [_call("exec_command", cmd=f"cat {peek}")] if peek else []
    # a test run waits up to 60 s for its output (Codex's default wait is shorter than pytest on a busy machine)
    test = _call("exec_command", cmd=TEST_CMD, yield_time_ms=60000)
    return head + [_call("exec_command", cmd="cat median.py"), test, _call("exec_command", cmd=patch), test,
                   "Fixed median."]


def _tool_script(shell: str, read: str, edit: str, keys=("file_path", "old_string", "new_string"),
                 described: bool = False, **edit_extra: str):
    """Read, test, edit, retest with a harness's own tools, which harnesses name differently: Claude Code's
    Bash/Read/Edit, opencode's bash/read/edit (camelCase keys), Qwen Code's run_shell_command/read_file/edit (a fork
    of Gemini CLI, whose edit tool `replace` also requires an `instruction`). `described`: the shell tool takes a
    `description`. keys: the edit tool's (path, old text, new text) argument names, the path's also the read's."""
    path_key, old_key, new_key = keys

    def run(command: str, why: str) -> str:
        return _call(shell, command=command, **({"description": why} if described else {}))

    def script(new: str, peek: str | None = None) -> list[str]:
        path = f"{SANDBOX_DIR}/median.py"
        head = [run(f"cat {peek}", "Look")] if peek else []
        return head + [_call(read, **{path_key: path}), run(TEST_CMD, "Run the tests"),
                       _call(edit, **{path_key: path, old_key: BUG, new_key: new}, **edit_extra),
                       run(TEST_CMD, "Rerun the tests"), "Fixed median."]
    return script


def _mini_script(new: str, peek: str | None = None) -> list[str]:
    edit = (f"python - <<'EOF'\nimport pathlib\np = pathlib.Path('median.py')\n"
            f"p.write_text(p.read_text().replace({BUG!r}, {new!r}))\nEOF")
    head = [_call("bash", command=f"cat {peek}")] if peek else []
    return head + [_call("bash", command="cat median.py"), _call("bash", command=TEST_CMD), _call("bash", command=edit),
                   _call("bash", command=TEST_CMD), _call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]


def _aider_script(new: str, peek: str | None = None) -> list[str]:
    """Aider has no tools: for a model it does not know it asks for the "whole" edit format, a reply holding each
    changed file whole under its path, fenced. `peek`: a second listing, aimed at a file of the trainer's outside
    the workdir (aider reads a listed file to show its diff, then overwrites it)."""
    fixed = (TASKS / "repos" / "median" / "median.py").read_text().replace(BUG, new)
    assert new in fixed
    tail = f"\n{peek}\n```\nhello from the model\n```\n" if peek else ""
    return [f"Dividing by 2.\n\nmedian.py\n```python\n{fixed}```\n" + tail]


# the harnesses that edit with tool calls (aider, which has none, has its own test below)
SCRIPTS = {"codex": _codex_script, "mini-swe-agent": _mini_script,
           "claude-code": _tool_script("Bash", "Read", "Edit", described=True),
           "opencode": _tool_script("bash", "read", "edit", ("filePath", "oldString", "newString"), described=True),
           "qwen-code": _tool_script("run_shell_command", "read_file", "edit"),
           "gemini-cli": _tool_script("run_shell_command", "read_file", "replace",
                                      instruction="Divide the middle pair's sum by 2")}


def _installed(name: str) -> str:
    spec = builtin_harnesses()[name]
    if executable(name, spec):
        return executable(name, spec)
    if spec.package.startswith("npm:") and (shutil.which("npm") is None or shutil.which("node") is None):
        pytest.skip(f"{name}: node/npm are not installed (needed for {spec.package})")
    try:
        return install(name, spec)
    except HarnessInstallError as exc:
        pytest.skip(f"{name}: could not install (no registry access?): {str(exc)[-300:]}")


def _episode(tokenizer, name: str, replies: list[str]):
    """Run one harness episode on the `median` task: (output, calls, engine)."""
    engine = ScriptedEngine(tokenizer, replies)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=1024), max_model_len=10**6).start()
    task = next(t for t in read_jsonl_tasks(TASKS / "tasks.jsonl") if t.task_id == "median")
    workflow = HarnessWorkflow(HarnessWorkflowConfig(harness=name, timeout_s=300), None, TASKS)
    try:
        ep = proxy.open_episode(name)
        tuner = Tuner(base_url=ep.base_url, api_key=ep.api_key, model="ajet-policy", episode_id=name)
        output = asyncio.run(workflow.execute(task, tuner))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    return output, calls, engine


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_harness_fixes_a_shipped_task_in_the_sandbox_reward_1_one_sample(tokenizer, name, tmp_path):
    """One episode: first a peek at a file of the trainer's outside the workdir (the sandbox must hide it),
    then read, test, edit with the harness's own tool, retest, answer."""
    _installed(name)
    secret = tmp_path / "trainer_secret.txt"
    secret.write_text("AJET-SECRET-4711")
    replies = SCRIPTS[name](FIX, peek=str(secret))
    output, calls, engine = _episode(tokenizer, name, replies)
    meta = output.metadata
    assert meta["exit_status"] == 0, meta["stderr"][-2000:]
    assert len(calls) == len(replies) == len(engine.sampled)              # every scripted turn went through
    assert output.reward == 1.0 and meta["tests"] == {"tests/test_median.py::test_even": "passed"}
    assert f"-    {BUG}\n+    {FIX}\n" in meta["diff"]                      # the harness's own edit tool did it
    seen = json.dumps([c.messages for c in calls])
    assert "1 failed" in seen                                              # it ran the failing test first
    if BWRAP or os.environ.get("AJET_REQUIRE_BWRAP") == "1":
        assert meta["isolation"] == "bwrap"
        assert "No such file" in seen and "AJET-SECRET-4711" not in seen  # the trainer's file is not there
    assert_one_exact_sample(calls, engine)


@pytest.mark.parametrize("name", ["codex", "opencode", "aider"])
def test_a_wrong_edit_gets_reward_0(tokenizer, name):
    """The judge is the same for every harness: a wrong edit made with the harness's own edit tool (Codex's
    apply_patch, opencode's edit, aider's whole-file listing) scores 0."""
    _installed(name)
    output, _, _ = _episode(tokenizer, name, {**SCRIPTS, "aider": _aider_script}[name](WRONG))
    assert output.metadata["exit_status"] == 0, output.metadata["stderr"][-2000:]
    assert f"+    {WRONG}\n" in output.metadata["diff"]
    assert output.reward == 0.0 and output.metadata["tests"] == {"tests/test_median.py::test_even": "failed"}


def test_registry_lists_every_harness_with_a_pinned_version():
    specs = builtin_harnesses()
    assert set(specs) >= {"codex", "claude-code", "gemini-cli", "opencode", "qwen-code", "aider", "mini-swe-agent"}
    assert all(s.version and s.package for s in specs.values())
    assert specs["gemini-cli"].api == "gemini"


def test_aider_whole_file_edit_reward_1_one_sample_and_the_sandbox_keeps_the_trainers_file(tokenizer):
    """Aider, unmodified: one call, answered with the whole fixed `median.py` in its whole-file format, plus a
    listing aimed at a file of the trainer's outside the workdir. Aider applies both without asking
    (`--yes-always`); the sandbox must keep the trainer's file unread and unchanged."""
    _installed("aider")
    # readable and writable by the sandbox's unprivileged uid: only the sandbox's own /tmp keeps it out
    with tempfile.TemporaryDirectory(prefix="ajet-trainer-") as folder:
        os.chmod(folder, 0o755)
        secret = Path(folder) / "trainer_secret.txt"
        secret.write_text("AJET-SECRET-4711")
        os.chmod(secret, 0o666)
        replies = _aider_script(FIX, peek=str(secret))
        output, calls, engine = _episode(tokenizer, "aider", replies)
        kept = secret.read_text()
    meta = output.metadata
    assert meta["exit_status"] == 0, meta["stderr"][-2000:]
    assert len(calls) == len(replies) == len(engine.sampled) == 1
    assert output.reward == 1.0 and meta["tests"] == {"tests/test_median.py::test_even": "passed"}
    assert f"-    {BUG}\n+    {FIX}\n" in meta["diff"]                      # aider's own whole-file edit did it
    assert "Applied edit to median.py" in meta["stdout"]
    if BWRAP or os.environ.get("AJET_REQUIRE_BWRAP") == "1":
        assert meta["isolation"] == "bwrap"
        assert f"Applied edit to {secret}" in meta["stdout"].replace("\n", "")  # aider wrote it, in the sandbox's /tmp:
        assert kept == "AJET-SECRET-4711"                                  # the trainer's file is unchanged ...
        assert "AJET-SECRET-4711" not in meta["stdout"] + meta["stderr"]   # ... and unread (aider diffs what it reads)
    assert_one_exact_sample(calls, engine)


def test_a_pip_harness_installs_with_uv_and_falls_back_to_pip_when_uv_fails(tmp_path, monkeypatch):
    """A `pip:` harness's venv is made by uv (seconds; aider's pip install took minutes here), and when uv fails
    (here: an executable that always fails in its place) the same install goes through `python -m venv` + pip."""
    monkeypatch.setenv("AJET_HARNESS_CACHE", str(tmp_path))
    spec = HarnessSpec(package="pip:cowsay", version="6.1", executable="cowsay", api="chat")
    assert registry._uv(), "uv is not installed (the `test` extra installs it)"
    try:
        exe = install("with-uv", spec)
    except HarnessInstallError as exc:
        pytest.skip(f"could not install from PyPI (no registry access?): {str(exc)[-300:]}")
    monkeypatch.setattr(registry, "_uv", lambda: shutil.which("false"))
    fallback = install("without-uv", spec)          # the registry was reachable just now: this must not fail
    for path, made_by_uv in ((exe, True), (fallback, False)):
        venv = Path(path).parent.parent
        assert ("\nuv = " in (venv / "pyvenv.cfg").read_text()) is made_by_uv
        assert "hello" in subprocess.run([path, "-t", "hello"], capture_output=True, text=True, check=True).stdout
