"""The CLI's fast help and error exits; the tutorial's task generator and calculator tool."""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ajet import Task, WorkflowOutput

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tutorial" / "example_math_agent"))
import make_tasks  # noqa: E402
from math_workflow import CALCULATE_TOOL, CalculatorTool, calculate_tool, math_agent_reward, safe_eval  # noqa: E402


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
    with pytest.raises(ValueError, match="not arithmetic"):
        safe_eval("x")                                   # a name is reported as such, not as a lone number


def test_what_the_model_reads_of_the_calculator_gives_no_expression_to_copy():
    """The tool's description and the calculator's errors go into the prompt. An example expression there (the
    description's `e.g. '3 + 4 * 2'` before 2026-12-02) is a valid call the policy copies onto every problem, which
    the valid-call bonus pays (docs/algorithm.md): neither text holds one."""
    expression = re.compile(r"\d\s*[-+*/]\s*\(?\d")
    assert not expression.search(CALCULATE_TOOL["function"]["description"])
    assert expression.search("e.g. '3 + 4 * 2'") and expression.search("4*(2")       # the check sees one
    for refused in ("8", "x", "1/0", "2 ** 1000"):
        error = asyncio.run(calculate_tool(json.dumps({"expression": refused})))
        assert error.startswith("error:") and not expression.search(error.removeprefix("error:")), error


def test_calculator_counts_grounded_calls_and_the_reward_prefers_them():
    """The main job's reward: 1 for the right number + 0.1 for a valid call + 0.1 when a valid call computes
    with the question's own numbers (or an earlier result). A call on other numbers (`3 + 4 * 2`) is valid but not
    grounded: a group whose calls are all valid still has a GRPO signal towards the problem's numbers."""
    tool = CalculatorTool("Omar has 7 cookies, buys 11 more and then gives away 4. How many cookies does Omar have?")
    steps = [("calculate", "3 + 4 * 2", "11", (1, 1, 0)),      # valid, numbers not in the question
             ("calculate", "7 + 11", "18", (2, 2, 1)),         # the question's numbers
             ("calculate", "18 - 4", "14", (3, 3, 2)),         # an earlier result and a question number
             ("calculate", "7 + 7", "14", (4, 4, 2)),          # 7 is given once: "1 + 1" for "gets 1 more" is no grounding
             ("calculate", "14 + 14", "28", (5, 5, 3)),        # 14 was computed twice (18 - 4 and 7 + 7)
             ("calculate", "7 + 5", "12", (6, 6, 3)),          # 5 is in neither
             ("calculate", "11", None, (7, 6, 3)),             # a lone number: refused
             ("search", "7 + 11", None, (8, 6, 3))]            # another tool: counted, not run
    for name, expression, want, counts in steps:
        result = asyncio.run(tool.call(name, json.dumps({"expression": expression})))
        assert (result == want) if want else result.startswith("error:")
        assert tuple(tool.counts.values()) == counts, expression
    assert list(tool.counts) == ["tool_calls", "valid_tool_calls", "grounded_tool_calls"]
    grounded = CalculatorTool("Ali has 8 pencils and gets 8 more.")
    asyncio.run(grounded.call("calculate", json.dumps({"expression": "8 + 8"})))
    assert grounded.counts["grounded_tool_calls"] == 1                 # the question gives 8 twice

    task = Task(task_id="t", query="q", answer="14")
    def reward(answer, valid, grounded):
        return math_agent_reward(task, WorkflowOutput(final_answer=answer, metrics={
            "valid_tool_calls": valid, "grounded_tool_calls": grounded}))
    assert reward("The answer is 14.", 1, 1) == pytest.approx(1.2)
    assert reward("The answer is 14.", 0, 0) == pytest.approx(1.0)
    assert reward("The answer is 11.", 1, 0) == pytest.approx(0.1)
    assert reward("The answer is 18.", 2, 1) == pytest.approx(0.2)
    assert math_agent_reward(task, WorkflowOutput(final_answer="14", metrics={})) == pytest.approx(1.0)


def test_run_flags_override_the_config():
    from ajet.cli import _load, build_parser
    conf = str(ROOT / "tutorial" / "example_math_agent" / "math_agent.yaml")
    cfg = _load(build_parser().parse_args(["--conf", conf, "--seed", "2", "--steps", "3", "--exp-dir", "x"]))
    assert (cfg.trainer.seed, cfg.trainer.total_steps, cfg.trainer.exp_dir) == (2, 3, "x")
    cfg = _load(build_parser().parse_args(["--conf", conf]))
    assert (cfg.trainer.seed, cfg.trainer.total_steps) == (0, 16)     # the YAML's own values


def test_distill_yaml_is_the_main_job_plus_a_teacher():
    """The README's distillation demo compares against the main job: the only differences are the name and the
    teacher (the main job's seed-1 checkpoint, at the path the README's teacher command writes)."""
    import yaml
    folder = ROOT / "tutorial" / "example_math_agent"
    main, distill = (yaml.safe_load((folder / name).read_text()) for name in ("math_agent.yaml", "math_agent_distill.yaml"))
    teacher = distill["algorithm"].pop("distill")
    assert teacher == {"teacher": "experiments/math_agent_seed1/checkpoints/step_16", "coef": 1.0, "mode": "add"}
    assert distill.pop("experiment_name") == "math_agent_distill" and main.pop("experiment_name") == "math_agent"
    assert distill == main
    assert f"--seed 1 --exp-dir {teacher['teacher'].split('/checkpoints')[0]}" in (folder / "math_agent_distill.yaml").read_text()
