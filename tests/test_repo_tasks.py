"""Repository tasks, the tests judge and a harness a user defines in YAML, without node or any install: the harness
is a small Python program (the trainer's interpreter) that asks the model through the episode's endpoint (inside
the sandbox: the unix-socket bridge) and writes the line it answers into the repository copy."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ajet.config import HarnessSpec, HarnessWorkflowConfig, load_config
from ajet.errors import ConfigError
from ajet.harnesses.workflow import HarnessWorkflow
from ajet.judges.tests import parse_pytest_results, run_tests, score
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.tasks.repo import DEFAULT_TEST_COMMAND, RepoTask, diff, read_tree
from ajet.tools.sandbox import bwrap_status
from ajet.tools.workdir_sandbox import WorkdirLimits
from ajet.workflow import Tuner
from tests.scripted_engine import ScriptedEngine

TASKS = Path(__file__).resolve().parent.parent / "tutorial" / "example_swe_tasks"

# the user's harness: one chat call, then the reply replaces line 7 of median.py (the bug)
AGENT = textwrap.dedent("""
    import os, sys
    from openai import OpenAI
    reply = OpenAI().chat.completions.create(model=os.environ["MODEL"], messages=[
        {"role": "user", "content": sys.argv[1]}]).choices[0].message.content
    lines = open("median.py").read().splitlines()
    lines[6] = "    " + reply.strip()
    open("median.py", "w").write("\\n".join(lines) + "\\n")
    print("edited", os.getcwd())
""")


def _median_task() -> Task:
    return Task("median", "Fix median.", None, {"repo": "repos/median", "tests": ["tests/test_median.py::test_even"],
                                                 "test_command": DEFAULT_TEST_COMMAND})


def test_pytest_results_and_score_count_a_missing_named_test_as_failed():
    out = ("PASSED tests/t.py::test_a\nFAILED tests/t.py::test_b - assert 1 == 2\nERROR tests/t.py::test_c\n"
           "1 passed, 1 failed, 1 error in 0.1s\n")
    reported = parse_pytest_results(out)
    assert reported == {"tests/t.py::test_a": "passed", "tests/t.py::test_b": "failed", "tests/t.py::test_c": "failed"}
    assert score(reported, ["tests/t.py::test_a", "tests/t.py::test_gone"]) == (
        0.5, {"tests/t.py::test_a": "passed", "tests/t.py::test_gone": "missing"})
    assert score(reported, []) == (1 / 3, reported)
    assert score({}, []) == (0.0, {})


def test_the_default_test_command_runs_plain_pytest_without_the_trainers_plugins(tmp_path):
    """The shipped test command leaves out the pytest plugins installed beside the trainer (pytest-xdist is one in
    the test extra): a task's tests see plain pytest. The same tests under `python -m pytest` alone see xdist
    loaded, so a judge that dropped the variable scores them 0."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_plain.py").write_text(
        "import sys\n\n\ndef test_no_plugin_loaded():\n    assert 'xdist.plugin' not in sys.modules\n")
    (tmp_path / "home").mkdir()
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"      # `python` is this interpreter, which has xdist

    def judge(command: str):
        return asyncio.run(run_tests(command, repo, tmp_path / "home", ("tests/test_plain.py::test_no_plugin_loaded",),
                                     path=path, limits=WorkdirLimits(timeout_s=120), isolation="none"))

    assert DEFAULT_TEST_COMMAND.startswith("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest ")
    plain = judge(DEFAULT_TEST_COMMAND)
    assert (plain.reward, plain.returncode) == (1.0, 0), plain.output
    with_plugins = judge("python -m pytest -q -rA -p no:cacheprovider")
    assert with_plugins.reward == 0.0 and "xdist.plugin" in with_plugins.output


def test_repo_task_checks_out_a_git_ref_and_diffs_what_changed(tmp_path):
    repo = tmp_path / "src"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    (repo / "a.py").write_text("x = 2\n")           # uncommitted: the ref's tree must not have it
    task = RepoTask.from_task(Task("t", "do", None, {"repo": "src", "ref": "HEAD", "tests": []}), tmp_path)
    work = task.checkout(tmp_path / "work")
    assert (work / "a.py").read_text() == "x = 1\n" and not (work / ".git").exists()
    before = read_tree(work)
    (work / "a.py").write_text("x = 3\n")
    (work / "b.py").write_text("new\n")
    assert diff(before, work) == ("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 3\n"
                                  "--- /dev/null\n+++ b/b.py\n@@ -0,0 +1 @@\n+new\n")
    with pytest.raises(ConfigError, match="not a repository task"):
        RepoTask.from_task(Task("t", "do"), tmp_path)


def _run_user_harness(tokenizer, reply: str):
    # the interpreter running these tests, not whatever `python` PATH names (a pyenv shim cannot start in the sandbox)
    spec = HarnessSpec(executable=sys.executable, api="chat", argv=["-c", AGENT, "{instruction}"],
                       env={"OPENAI_BASE_URL": "{base_url}", "OPENAI_API_KEY": "{api_key}", "MODEL": "{model}"})
    engine = ScriptedEngine(tokenizer, [reply])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("user")
        workflow = HarnessWorkflow(HarnessWorkflowConfig(harness="mine", timeout_s=60), {"mine": spec}, TASKS)
        out = asyncio.run(workflow.execute(_median_task(), Tuner(ep.base_url, ep.api_key, "ajet-policy", "user")))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    return out, calls


def test_a_harness_defined_in_yaml_is_judged_by_the_tests(tokenizer):
    out, calls = _run_user_harness(tokenizer, "return (s[mid - 1] + s[mid]) / 2")
    assert out.metadata["exit_status"] == 0, out.metadata["stderr"]
    assert len(calls) == 1 and "Fix median." in calls[0].messages[0]["content"]
    assert out.reward == 1.0 and out.metadata["tests"] == {"tests/test_median.py::test_even": "passed"}
    assert out.metadata["diff"].endswith("-    return (s[mid - 1] + s[mid]) / 3\n"
                                         "+    return (s[mid - 1] + s[mid]) / 2\n")
    if bwrap_status()[0]:     # under bubblewrap its cwd is the sandbox's, reached through the bridge
        assert out.metadata["isolation"] == "bwrap" and "edited /sandbox" in out.metadata["stdout"]
    wrong, _ = _run_user_harness(tokenizer, "return s[mid]")
    assert wrong.reward == 0.0 and wrong.metadata["tests"] == {"tests/test_median.py::test_even": "failed"}


def test_config_names_a_harness_and_defines_one(tmp_path):
    conf = tmp_path / "x.yaml"
    conf.write_text("workflow: {harness: mine, model: m}\ndata: {train_path: t.jsonl}\n"
                    "harnesses:\n  mine: {executable: my-agent, api: chat, argv: [--task, '{instruction}']}\n")
    cfg = load_config(conf)
    assert cfg.workflow.harness == "mine" and cfg.harnesses["mine"].argv == ["--task", "{instruction}"]
    conf.write_text("workflow: {harness: nope}\ndata: {train_path: t.jsonl}\n")
    with pytest.raises(ConfigError, match="unknown harness 'nope'.*codex"):
        HarnessWorkflow(load_config(conf).workflow, load_config(conf).harnesses, tmp_path)


def test_shipped_tasks_each_have_a_repo_an_issue_and_named_tests_that_exist():
    rows = [json.loads(line) for line in (TASKS / "tasks.jsonl").read_text().splitlines()]
    assert len(rows) >= 20 and len({r["task_id"] for r in rows}) == len(rows)
    for r in rows:
        repo = TASKS / r["repo"]
        assert (repo / "ISSUE.md").read_text().strip() == r["query"]
        for test_id in r["tests"]:
            path, name = test_id.split("::")
            assert f"def {name}(" in (repo / path).read_text()
        assert (TASKS / "seeds" / f"{r['task_id']}.py").read_text() != (repo / f"{r['task_id']}.py").read_text()


def test_ajet_harnesses_lists_the_registry(capsys):
    from ajet.cli import main

    assert main(["harnesses"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["name", "package", "version", "api", "installed"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) >= {"codex", "claude-code", "gemini-cli", "opencode", "qwen-code", "aider", "mini-swe-agent"}
    assert rows["codex"][1:4] == ["npm:@openai/codex", "0.169.0", "responses"]


def test_an_agent_that_edits_the_named_test_does_not_pass_it(tokenizer):
    cheat = "open('tests/test_median.py', 'w').write('def test_even():\\n    assert True\\n')"
    spec = HarnessSpec(executable=sys.executable, api="chat", argv=["-c", cheat])
    workflow = HarnessWorkflow(HarnessWorkflowConfig(harness="cheat", timeout_s=60), {"cheat": spec}, TASKS)
    out = asyncio.run(workflow.execute(_median_task(), Tuner("http://127.0.0.1:9/v1", "k", "m", "cheat")))
    assert out.metadata["exit_status"] == 0, out.metadata["stderr"]
    assert "+    assert True\n" in out.metadata["diff"]                 # the edit is on the episode, not in the reward
    assert out.reward == 0.0 and out.metadata["tests"] == {"tests/test_median.py::test_even": "failed"}
