"""Every code block of docs/python.md runs as written, on the tiny model and one step: the main job as the script
the page says to save (`python main_job.py`, its `to_yaml` config checked), the notebook's cells in a running event
loop with top-level `await` (as Jupyter runs them), and the errors the page shows are the ones ajet gives."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from ajet.job import JobResult

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "python.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)


def _shrunk(code: str, substitutions: dict[str, str]) -> str:
    """`code` with each substitution made; one that no longer matches the page fails the test."""
    for old, new in substitutions.items():
        assert old in code, f"docs/python.md changed: {old!r} is not in\n{code}"
        code = code.replace(old, new)
    return code


def _folder(tmp_path: Path) -> Path:
    """A working folder laid out as the repository's for the page's relative paths (`tutorial/` linked), with small
    task files of the tutorial's form."""
    (tmp_path / "tutorial").symlink_to(ROOT / "tutorial")
    (tmp_path / "small_tasks").mkdir()
    for split, (a, b) in {"train": (3, 4), "val": (5, 2), "test": (8, 1)}.items():
        rows = [{"task_id": f"{split}-{i}", "query": f"Omar has {a + i} coins and gets {b} more. How many coins "
                 f"does Omar have now?", "answer": str(a + i + b)} for i in range(2)]
        (tmp_path / "small_tasks" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_the_main_job_runs_as_the_script_the_page_shows(tiny_model_dir, tmp_path):
    code = _shrunk(_blocks("python")[0], {
        '"tutorial/example_math_agent/tasks"': '"small_tasks"', '"smollm2-135m-instruct"': repr(tiny_model_dir),
        '"total_steps": 16': '"total_steps": 1', '"val_freq": 8': '"val_freq": 1', '"num_repeat": 8': '"num_repeat": 2',
        '"max_tokens": 48': '"max_tokens": 8', '"max_oversample": 2': '"max_oversample": 1'})
    folder = _folder(tmp_path)
    (folder / "main_job.py").write_text(code)
    proc = subprocess.run([sys.executable, "main_job.py"], capture_output=True, text=True, cwd=folder, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exp = folder / "experiments" / "math_agent"
    final = JobResult.read(exp).checkpoint   # the best validated model: step 1's checkpoint or the initial model
    assert final in (str(exp / "checkpoints" / "step_1"), tiny_model_dir)
    assert f"final model: {Path(final).relative_to(folder) if final != tiny_model_dir else final}\n" in proc.stdout
    steps = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == [0, 1]
    assert "val/pass@1" in steps[0] and "test/pass@1" in steps[1]
    conf = (folder / "main_job.yaml").read_text()
    assert "workflow: tutorial/example_math_agent/math_workflow.py:MathAgentWorkflow" in conf
    assert "judge: tutorial/example_math_agent/math_workflow.py:math_agent_reward" in conf
    from ajet.config import load_config

    cfg = load_config(folder / "main_job.yaml")
    assert (cfg.trainer.total_steps, cfg.rollout.num_repeat, cfg.data.train_path) == (1, 2, "small_tasks/train.jsonl")


RUNNER = '''
import ast, asyncio, json, sys

from ajet.errors import ConfigError


async def cells(blocks):   # as Jupyter runs a notebook: one loop, one namespace, top-level await
    ns = {"__name__": "__main__"}

    async def run(source):
        result = eval(compile(source, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), ns)
        if result is not None:
            await result

    for source in blocks[:2]:   # the notebook's two cells
        await run(source)
    errors = []
    for make in (lambda: ns["ajet"].Job(ns["solve"], tasks=ns["tasks"], trainer={"total_step": 1}),
                 lambda: ns["job"].to_yaml("notebook.yaml")):
        try:
            make()
        except ConfigError as exc:
            errors.append(f"ConfigError: {exc}")
    print(json.dumps({"result": [ns["result"].steps[-1]["step"], ns["result"].checkpoint], "errors": errors}))
    await run(blocks[2])   # from_yaml


asyncio.run(cells(json.load(open(sys.argv[1]))))
'''


def test_the_notebook_cells_run_in_a_running_event_loop(tiny_model_dir, tmp_path):
    blocks = _blocks("python")
    assert len(blocks) == 4, "docs/python.md: the main job, two notebook cells and from_yaml"
    cells = [_shrunk(blocks[1], {'"smollm2-135m-instruct"': repr(tiny_model_dir), '"total_steps": 2': '"total_steps": 1',
                                 '"num_repeat": 4': '"num_repeat": 2', '"max_tokens": 32': '"max_tokens": 8'}),
             blocks[2], blocks[3]]
    folder = _folder(tmp_path)
    (folder / "cells.json").write_text(json.dumps(cells))
    (folder / "runner.py").write_text(textwrap.dedent(RUNNER))
    proc = subprocess.run([sys.executable, "runner.py", "cells.json"], capture_output=True, text=True, cwd=folder,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"result"')))
    assert out["result"] == [1, str(Path("experiments") / "notebook" / "checkpoints" / "step_1")]
    assert "Job('math_agent'" in proc.stdout and "steps=4" in proc.stdout   # from_yaml's job, printed
    shown = _blocks("text")
    typo, refused = out["errors"]
    assert typo.startswith(shown[0].strip().removesuffix("..."))
    assert refused == shown[1].strip()
