"""Command workflows: the user's unmodified program per episode. The same agent as a command (OpenAI SDK,
environment variables only) and as a `Workflow` subclass gives the same recorded calls for the same seed;
the program's result line, stderr, exit status and timeout (whole process group) are handled as documented."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ajet.config import CommandWorkflowConfig
from ajet.rollout.command import CommandWorkflow
from ajet.task import Task
from ajet.trajectory_store import TrajectoryStore
from ajet.workflow import Tuner

AGENT_SCRIPT = '''
import json, os, sys
from openai import OpenAI

task = json.loads(sys.stdin.read())
assert task == json.loads(os.environ["AJET_TASK"])
client = OpenAI()                                    # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
messages = [{"role": "user", "content": task["query"]}]
r = client.chat.completions.create(model=os.environ["AJET_MODEL"], messages=messages)
messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
r = client.chat.completions.create(model=os.environ["AJET_MODEL"], messages=messages)
text = r.choices[0].message.content or ""
print("agent log line", file=sys.stderr)
print(json.dumps({"reward": len(text) % 3, "final_answer": text}))
'''

AGENT_CLASS = '''
from ajet.workflow import Workflow, WorkflowOutput


class SameAgent(Workflow):
    async def execute(self, task, tuner):
        messages = [{"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=len(text) % 3, final_answer=text)
'''


def _run(tmp_path, tiny_model_dir, name, workflow_yaml):
    d = tmp_path / name
    d.mkdir()
    (d / "agent.py").write_text(AGENT_SCRIPT)
    (d / "wf.py").write_text(AGENT_CLASS)
    (d / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"q {i}"}) + "\n" for i in range(4)))
    (d / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 5, max_concurrency: 1}}
        trainer: {{total_steps: 1, tasks_per_step: 2, tensorboard: false}}
    """) + workflow_yaml)
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(d / "conf.yaml"), "--exp-dir", str(d / "exp")],
                          capture_output=True, text=True, timeout=240, cwd=d)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    store = TrajectoryStore(d / "exp" / "trajectories.sqlite")
    episodes = store.episodes()
    store.close()
    return episodes


def test_command_workflow_records_the_same_calls_as_the_workflow_subclass(tiny_model_dir, tmp_path):
    as_command = _run(tmp_path, tiny_model_dir, "command",
                      "workflow: {command: [" + json.dumps(sys.executable) + ", agent.py], timeout_s: 120}\n")
    as_class = _run(tmp_path, tiny_model_dir, "class", "workflow: wf.py:SameAgent\n")

    def calls(episodes):
        return [[(c["messages"], c["prompt_ids"], c["completion_ids"], c["prompt_parent"] is not None)
                 for c in e["calls"]] for e in episodes]

    assert all(e["error"] is None and len(e["calls"]) == 2 for e in as_command + as_class)
    assert calls(as_command) == calls(as_class)
    assert [e["reward"] for e in as_command] == [e["reward"] for e in as_class]
    assert all(e["output"]["metadata"]["stderr"] == "agent log line\n" for e in as_command)


def _workflow(tmp_path, script, timeout_s=None):
    (tmp_path / "prog.py").write_text(textwrap.dedent(script))
    return CommandWorkflow(CommandWorkflowConfig(command=[sys.executable, "prog.py"], env={"EXTRA": "yes"},
                                                 timeout_s=timeout_s), tmp_path)


def _execute(wf):
    tuner = Tuner(base_url="http://127.0.0.1:9/ep/x/v1", api_key="k", model="m", episode_id="e1")
    return asyncio.run(wf.execute(Task("t1", "what?", "42"), tuner))


def test_result_line_plain_answer_and_environment(tmp_path):
    out = _execute(_workflow(tmp_path, '''
        import json, os, sys
        print("noise")
        print(json.dumps({"env": [os.environ[k] for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "EXTRA")],
                          "stdin": json.loads(sys.stdin.readline())["task_id"]}))
        print("the answer is 42")
    '''))
    assert out.reward is None and out.final_answer == "the answer is 42"    # plain text: the judge scores it
    out = _execute(_workflow(tmp_path, '''
        import json
        print(json.dumps({"reward": 0.5, "metrics": {"turns": 2}}))
    '''))
    assert out.reward == 0.5 and out.metrics == {"turns": 2}


def test_failing_program_fails_the_episode_with_its_stderr(tmp_path):
    with pytest.raises(RuntimeError, match=r"exited with status 3(.|\n)*bad things happened"):
        _execute(_workflow(tmp_path, '''
            import sys
            print("bad things happened", file=sys.stderr)
            sys.exit(3)
        '''))
    with pytest.raises(RuntimeError, match="printed nothing on stdout"):
        _execute(_workflow(tmp_path, "pass\n"))


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    wf = _workflow(tmp_path, f'''
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(120)
    ''', timeout_s=10)                  # room for two interpreters to start on a loaded machine before the timeout
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout_s=10"):
        _execute(wf)
    assert time.monotonic() - t0 < 60
    assert pidfile.exists(), "the program did not start its child within timeout_s; the machine is too loaded to judge"
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":   # killed, not yet reaped
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the program's child outlived the timeout")


def test_ajet_serve_runs_a_command_workflow_itself(tiny_model_dir, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT_SCRIPT)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"q {i}"}) + "\n" for i in range(4)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: {{command: [{json.dumps(sys.executable)}, agent.py], timeout_s: 120}}
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 5}}
        trainer: {{total_steps: 1, tasks_per_step: 2, tensorboard: false}}
        serve: {{port: 0, local_workers: 2}}
    """))
    proc = subprocess.run([sys.executable, "-m", "ajet", "serve", "--conf", str(tmp_path / "conf.yaml"),
                           "--exp-dir", str(tmp_path / "exp")], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    store = TrajectoryStore(tmp_path / "exp" / "trajectories.sqlite")
    episodes, ledger = store.episodes(), store.ledger()
    store.close()
    assert len(episodes) == 4 and all(e["error"] is None and len(e["calls"]) == 2 for e in episodes)
    assert all(e["output"]["metadata"]["stderr"] == "agent log line\n" for e in episodes)
    assert all(e["trained_in"] == [(1, 0)] for e in ledger)
