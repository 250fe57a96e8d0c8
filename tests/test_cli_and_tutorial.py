"""The CLI's fast help and error exits; the tutorial's task generator and calculator tool."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tutorial" / "example_math_agent"))
import make_tasks  # noqa: E402
from math_workflow import calculate_tool, safe_eval  # noqa: E402


def test_help_imports_no_torch():
    code = ("import sys; from ajet.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "--conf" in out and "HEAVY []" in out


def test_python_m_ajet_help_is_light():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ajet", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--backbone" in proc.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert "ajet" in imported and not imported & {"torch", "transformers", "starlette", "openai"}


def test_config_error_exits_2_with_did_you_mean(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("workflow: w.py:W\ndata: {train_path: t.jsonl}\ntrainer: {totl_steps: 2}\n")
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(conf)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "ajet: error:" in proc.stderr and "did you mean `trainer.total_steps`?" in proc.stderr


def test_unavailable_backbone_names_the_extra(tmp_path):
    from ajet.backbones import load_backbone
    from ajet.errors import BackboneUnavailable

    with pytest.raises(BackboneUnavailable, match=r"pip install 'ajet\[verl\]'"):
        load_backbone("verl")


def test_task_generator_is_deterministic_and_correct():
    rows = make_tasks.make_tasks(200, seed=0, prefix="train")
    assert rows == make_tasks.make_tasks(200, seed=0, prefix="train")
    committed = [json.loads(line) for line in (ROOT / "tutorial/example_math_agent/tasks/train.jsonl").read_text().splitlines()]
    assert committed[:200] == rows and len(committed) == 512
    for row in rows:  # recompute every answer from the numbers in the question
        nums = [int(t) for t in row["query"].replace(",", " ").replace(".", " ").split() if t.isdigit()]
        q = row["query"]
        want = (nums[0] + nums[1] - nums[2] if "gives away" in q and "buys" in q else nums[0] - nums[1] if "gives away" in q
                else nums[0] * nums[1] if "bags" in q else nums[0] + nums[1])
        assert int(row["answer"]) == want


def test_calculator_tool():
    def calc(arguments: str) -> str:
        return asyncio.run(calculate_tool(arguments))
    assert calc('{"expression": "3 + 4 * 2"}') == "11"
    assert calc('{"expression": "7 / 2"}') == "3.5"
    assert calc('{"expression": "-(2 ** 3)"}') == "-8"
    assert calc('{"expression": "1/0"}').startswith("error:")
    assert calc("not json").startswith("error:")
    assert calc('{"expression": "8"}').startswith("error: a lone number")     # the guessed answer is no calculation
    for bad in ("__import__('os').system('echo hi')", "open('x')", "2 ** 1000", "a + 1", "-8", "(3.5)"):
        with pytest.raises(ValueError):
            safe_eval(bad)
