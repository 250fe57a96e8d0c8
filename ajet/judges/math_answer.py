"""Built-in judges: `(task, output) -> reward`. Name one in the config as `judge: ajet.judges:NAME`."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, localcontext

from ajet.task import Task
from ajet.workflow import WorkflowOutput

# "1,234" is one number (comma-grouped thousands); "1,2,3" is three
_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\.\d+")


def extract_final_number(text: str | None) -> str | None:
    """The answer number of a model's text: the first number after the last `####`, `\\boxed{` or
    "answer is", else the last number in the text.

    Commas, `$` and trailing zeros are normalised away ("1,234.50" -> "1234.5", "7.0" -> "7").
    """
    if not text:
        return None
    for pattern in (r"####\s*(.+)", r"\\boxed\{([^}]*)\}", r"answer is\s*:?\s*([^\n]*)"):
        m = re.findall(pattern, text, flags=re.IGNORECASE)
        if m and _NUMBER.search(m[-1]):
            return _normalise(_NUMBER.search(m[-1]).group())
    nums = _NUMBER.findall(text)
    return _normalise(nums[-1]) if nums else None


def _normalise(num: str) -> str | None:
    try:
        d = Decimal(num.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    with localcontext() as ctx:
        ctx.prec = max(28, len(d.as_tuple().digits))  # never round a long number
        d = d.normalize() + 0  # + 0 turns -0 into 0
        return format(d.to_integral_value() if d == d.to_integral_value() else d, "f")


def math_answer_judge(task: Task, output: WorkflowOutput) -> float:
    """1.0 when the final number in `output.final_answer` equals `task.answer` numerically, else 0.0 (also
    when the task has no answer or the text no number). The final number is `extract_final_number`'s: after
    the last `####` (GSM8K's answer format, Cobbe et al. 2021), `\\boxed{}` or "answer is", else the last
    number in the text; "1,234.50" equals "1234.5". Never raises."""
    if task.answer is None:
        return 0.0
    got, want = extract_final_number(output.final_answer), _normalise(task.answer.strip())
    return 1.0 if got is not None and got == want else 0.0


def answer_with_tool_use_judge(task: Task, output: WorkflowOutput) -> float:
    """`math_answer_judge` (1.0 for the right final number) + 0.2 when the agent made at least one tool call
    that did not fail (`output.metrics["valid_tool_calls"]`, as `ajet.tool_agent:ToolAgent` reports it).

    Returns 0.0, 0.2, 1.0 or 1.2. The small format term (as in DeepSeek-R1's format reward, DeepSeek-AI 2025,
    arXiv:2501.12948) gives GRPO a signal while a small model still gets most answers wrong; the correctness
    term dominates. Never raises.
    """
    return math_answer_judge(task, output) + (0.2 if output.metrics.get("valid_tool_calls", 0) > 0 else 0.0)
