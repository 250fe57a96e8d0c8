"""Calling a judge: an episode's reward from `judge(task, output)`, or a `JudgeError` naming the judge.

A judge that cannot score an episode (it raised, a package it needs is missing, it returned something that is
not a finite number) fails that episode; it never gives it a reward of 0. The error names the judge by the
name the config gave it (`ajet.judges:math_answer_judge`, `judge.py:my_judge`), so that the run's failure
lines (ajet/failures.py) say which judge and why, once per distinct error.
"""

from __future__ import annotations

import inspect
import math
import sys
import traceback
from pathlib import Path
from typing import Any

NAME_ATTR = "ajet_judge_name"   # set by `load_judge` on the judge it loads: the config's `judge:` text


class JudgeError(RuntimeError):
    """A judge could not score an episode: it raised (the cause), or returned a non-number or a non-finite
    value. The message names the judge (`judge_name`)."""

    def error_text(self) -> str:
        """The episode's error text: the traceback of what the judge raised (its own frames, so the failure lines
        show where), then one line `JudgeError: <message>`."""
        cause = self.__cause__
        head = "".join(traceback.format_exception(cause)) if cause is not None else ""
        return f"{head}JudgeError: {self}"


def judge_name(judge: Any) -> str:
    """How messages name `judge`: the config's `judge:` text when `load_judge` loaded it, else
    `module:qualname` of the function (or of the class of a judge object); a function from a file loaded by
    ajet.importing is named by its file."""
    name = getattr(judge, NAME_ATTR, None)
    if isinstance(name, str) and name:
        return name
    fn = judge if hasattr(judge, "__qualname__") else type(judge)
    module = getattr(fn, "__module__", None) or "?"
    file = getattr(sys.modules.get(module), "__file__", None)
    if module.startswith("ajet_user_") and file:
        module = Path(file).name
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


def set_judge_name(judge: Any, name: str) -> None:
    """Record the config's `name` for `judge` (see `judge_name`); a judge that takes no attribute keeps its
    `module:qualname` name."""
    try:
        setattr(judge, NAME_ATTR, name)
    except (AttributeError, TypeError):
        pass


async def call_judge(judge: Any, task: Any, output: Any) -> float:
    """The reward `judge(task, output)` gives (awaited when the judge is async), as a finite float.

    Raises:
        JudgeError: the judge raised (chained as the cause; a missing module's message says what to install),
            or returned a value that is not a number, or NaN or an infinity.
    """
    name = judge_name(judge)
    try:
        value = judge(task, output)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            from ajet.importing import missing_package_hint

            said = f"{said} ({missing_package_hint(exc.name)})"
        raise JudgeError(f"judge {name} failed: {said}") from exc
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise JudgeError(f"judge {name} returned {type(value).__name__} {str(value)[:80]!r}, not a number") from None
    if not math.isfinite(reward):
        raise JudgeError(f"judge {name} returned {reward}, not a finite reward")
    return reward
