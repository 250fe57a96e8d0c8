"""The calculator the math agent's tool runs, in the sandbox: arithmetic only, via `ast`.

Standalone on purpose (standard library only): `math_workflow.calculate_tool` runs this file's source as the sandbox's
program (expression on stdin, value or "error: ..." on stdout), where neither ajet nor this folder is visible.
"""

from __future__ import annotations

import ast
import operator
import sys


def format_value(value: float) -> str:
    """12.0 -> "12", 3.14159265 -> "3.14159" (6 significant digits)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def safe_eval(expression: str) -> float:
    """Evaluate arithmetic only (numbers, + - * / // % **, unary minus, parentheses) via `ast`.

    Raises:
        ValueError: anything else (names, calls, attributes), a lone number (no operator: nothing to
            calculate), or an exponent above 100.
        ZeroDivisionError: division by zero.
    """
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    tree = ast.parse(expression.strip(), mode="eval")
    value = ev(tree)
    if not any(isinstance(node, ast.BinOp) for node in ast.walk(tree)):
        # a lone number computes nothing: without this rule GRPO learns to "call" the tool with the guessed answer
        # (a valid call: the format bonus) instead of the arithmetic (seen in the main job's seed 1)
        raise ValueError("a lone number is not a calculation; "
                         "write the arithmetic on the question's numbers that gives the answer")
    return value


if __name__ == "__main__":
    try:
        print(format_value(safe_eval(sys.stdin.read())))
    except Exception as exc:  # noqa: BLE001 - the model reads the error and may try again
        print(f"error: {exc}")
