"""Countdown (as in TinyZero and reasoning-gym): reach `target` with an arithmetic expression that uses each
of the given `numbers` at most once. Task metadata: {"numbers": [int], "target": int} (reasoning-gym
tasks carry them in metadata["entry"]["metadata"]).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from ajet.task import Task

# reward of a well-formed expression over allowed numbers that misses the target (a format signal, as in
# TinyZero's countdown reward: 0.1 for the format, 1.0 for the right value)
FORMAT_REWARD = 0.1
_EXPR = re.compile(r"[\d\s()+\-*/.]+")


def countdown_score(answer: str | None, numbers: list[int], target: int) -> float:
    """1.0 when `answer` holds an expression using each of `numbers` at most once (and no other number)
    whose exact value (rational arithmetic) is `target`; FORMAT_REWARD when it is such an expression with
    another value; 0.0 otherwise (no expression, a number not given, a number used too often, division by 0).

    The expression is the text after the last `<answer>` tag or "answer:" if any, else the longest
    run of digits, spaces, parentheses and + - * / in the text; `=` and what follows it is dropped.
    """
    expr = extract_expression(answer)
    if expr is None:
        return 0.0
    try:
        tree = ast.parse(expr, mode="eval")
        used = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        value = _eval(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return 0.0
    if not used or Counter(used) - Counter(numbers):   # a number not given, or given fewer times
        return 0.0
    return 1.0 if value == target else FORMAT_REWARD


def extract_expression(answer: str | None) -> str | None:
    """The candidate expression in a model's answer text (see `countdown_score`), or None."""
    if not answer:
        return None
    text = answer
    m = re.findall(r"<answer>(.*?)(?:</answer>|$)", text, flags=re.S | re.I) or \
        re.findall(r"answer\s*(?:is)?\s*:?\s*([^\n]*)", text, flags=re.I)
    if m:
        text = m[-1]
    text = text.replace("×", "*").replace("÷", "/").replace("x", "*").split("=")[0]
    runs = [r.strip() for r in _EXPR.findall(text) if re.search(r"\d", r)]
    return max(runs, key=len) if runs else None


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        return a / b
    raise ValueError("not a countdown expression")


def countdown_judge(task: Task, output) -> float:
    """`countdown_score` of the workflow's final answer against the task's numbers and target (task
    metadata `numbers`/`target`, or reasoning-gym's `entry.metadata`): 1.0 for an expression reaching the
    target, FORMAT_REWARD (0.1) for a well-formed one that misses it, else 0.0 (TinyZero's countdown reward).

    Raises:
        KeyError: the task's metadata has no `numbers` or `target` (the episode fails, naming the key).
    """
    meta = task.metadata.get("entry", {}).get("metadata", task.metadata)
    return countdown_score(output.final_answer, list(meta["numbers"]), int(meta["target"]))
