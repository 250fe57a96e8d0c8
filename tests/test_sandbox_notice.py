"""The code sandbox's "WITHOUT isolation" notice (ajet/tools/sandbox.py `isolation_warning`) is printed by a run whose
workflow uses the sandbox, once, and never by a run whose workflow does not: real `ajet` runs (debug backbone, the
tiny model) on a machine without bubblewrap (PATH holds no `bwrap`: the runs start Python by its full path), so the
test means the same with or without bubblewrap installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

WORKFLOW = '''
from ajet.tools.sandbox import run_python_async
from ajet.workflow import Workflow, WorkflowOutput


class Plain(Workflow):
    """One model call, no tool."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": task.query}])
        return WorkflowOutput(reward=float(len(r.choices[0].message.content or "") % 2), final_answer="")


class Sandboxed(Plain):
    """The same, then the sandbox runs a program for every episode (4 episodes a step)."""

    async def execute(self, task, tuner):
        out = await super().execute(task, tuner)
        result = await run_python_async("print(6 * 7)", timeout_s=60)
        assert result.stdout == "42\\n" and result.isolation == "none", result
        return out
'''

NOTICE = "the code sandbox runs WITHOUT isolation: bubblewrap (bwrap) is not installed"


def _run(root: Path, model_dir: str, workflow: str) -> str:
    """`ajet` for 1 step of `workflow` (a class of WORKFLOW) in `root`, without bubblewrap; its stdout + stderr."""
    root.mkdir()
    (root / "wf.py").write_text(WORKFLOW)
    (root / "bin").mkdir()   # PATH: nothing there
    tasks = [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(2)]
    (root / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (root / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: notice
        workflow: wf.py:{workflow}
        model: {{path: "{model_dir}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
        trainer: {{total_steps: 1, tasks_per_step: 2, tensorboard: false}}
    """))
    env = {**os.environ, "PATH": str(root / "bin")}
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp"],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "step 1/1 | episodes 4 (0 failed)" in out, out
    return out


def test_the_no_isolation_notice_only_when_the_workflow_uses_the_sandbox_and_once(tiny_model_dir, tmp_path):
    plain = _run(tmp_path / "plain", tiny_model_dir, "Plain")
    assert "WITHOUT isolation" not in plain, plain
    sandboxed = _run(tmp_path / "sandboxed", tiny_model_dir, "Sandboxed")
    assert sandboxed.count("WITHOUT isolation") == 1, sandboxed   # 4 episodes ran the sandbox: said once
    assert NOTICE in sandboxed, sandboxed


def test_sandboxed_calls_starting_at_once_say_the_notice_once(monkeypatch, caplog):
    """Episodes call the sandbox from several threads at once; while the first is still probing (slow on a loaded
    machine: seen as 3 notices in one run), the others must not say it too. 8 threads, a probe that takes 0.3 s."""
    import threading
    import time

    from ajet.tools import sandbox

    def slow_warning():
        time.sleep(0.3)
        return "the code sandbox runs WITHOUT isolation: (a test)"

    monkeypatch.setattr(sandbox, "isolation_warning", slow_warning)
    monkeypatch.setattr(sandbox, "_warned", False)
    start = threading.Barrier(8)

    def call():
        start.wait(timeout=30)
        sandbox._warn_no_isolation_once()

    threads = [threading.Thread(target=call) for _ in range(8)]
    with caplog.at_level("WARNING", logger=sandbox.log.name):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert [r.getMessage() for r in caplog.records].count("the code sandbox runs WITHOUT isolation: (a test)") == 1
