"""The tests judge: run a repository task's test command in the agent's working copy, inside the sandbox.

reward = (named tests that passed) / (named tests). A named test the command does not report (deleted, renamed,
a collection error) counts as failed. Results are read from pytest's `-rA` summary lines (`PASSED <id>`,
`FAILED <id> - message`, `ERROR <id>`, `XPASS`/`XFAIL`/`SKIPPED` count as not passed).

A test command that cannot run at all (its Python has no pytest, its program is not found) reports nothing: that
is the judge failing, a `JudgeError` that fails the episode, not a reward of 0 (`cannot_run`). A run checks
before it starts that the Python running ajet has pytest (`require_pytest`).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ajet.errors import AjetError
from ajet.judges.calling import JudgeError
from ajet.tools.workdir_sandbox import WorkdirLimits, run_in_workdir

_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED)\s+(\S+)")
OUTPUT_KEEP = 8 * 1024      # characters of the test output kept on the episode
NAME = "ajet.judges.tests:run_tests"   # how errors name this judge
_NO_PYTEST = re.compile(r"No module named '?pytest'?")   # `python -m pytest` in a Python without it


class TestsJudgeUnavailable(AjetError, ImportError):
    """The tests judge cannot run in this environment (pytest is not installed); said before a run starts."""


def require_pytest() -> None:
    """Check that the Python running ajet can run the tests judge's default test command (`python -m pytest`,
    this interpreter first on the test command's PATH).

    Raises:
        TestsJudgeUnavailable: pytest is not importable here (the message says what to install, in one line).
    """
    if importlib.util.find_spec("pytest") is None:
        raise TestsJudgeUnavailable(f"the tests judge ({NAME}) runs pytest, which is not installed in the Python "
                                    f"running ajet: {sys.executable} -m pip install pytest")


@dataclass
class TestReport:
    """What the test run said.

    Attributes:
        reward: share of the named tests that passed, in [0, 1].
        results: {test id: "passed" | "failed" | "missing"} for the named tests (all reported ones when none
            are named).
        returncode: the test command's exit status (None: killed at the timeout).
        output: the last OUTPUT_KEEP characters of its stdout + stderr.
    """

    reward: float
    results: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    output: str = ""


def parse_pytest_results(text: str) -> dict[str, str]:
    """{test id: "passed" | "failed"} from pytest `-rA` summary lines (the last word for an id wins)."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[m.group(2)] = "passed" if m.group(1) == "PASSED" else "failed"
    return out


def cannot_run(returncode: int | None, output: str, reported: dict[str, str]) -> str | None:
    """Why a test command's run could not test anything, or None: nothing `reported`, and its `output` says its
    Python has no pytest, or the shell could not start its program (exit status 127 or 126: the shell's last
    line)."""
    if reported or returncode in (0, None):
        return None
    if found := _NO_PYTEST.search(output):
        return found.group(0)
    if returncode in (126, 127):
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        return lines[-1][:300] if lines else f"exit status {returncode}"
    return None


def score(reported: dict[str, str], named: tuple[str, ...] | list[str]) -> tuple[float, dict[str, str]]:
    """(reward, per-test results) for the `named` tests given what was `reported` (see the module docstring).
    With no named tests, every reported test counts; nothing reported is reward 0."""
    if not named:
        results = dict(reported)
    else:
        results = {t: reported.get(t, "missing") for t in named}
    passed = sum(v == "passed" for v in results.values())
    return (passed / len(results) if results else 0.0), results


async def run_tests(test_command: str, workdir: str | Path, home: str | Path, tests: tuple[str, ...], *,
                    path: str, limits: WorkdirLimits, isolation: str = "auto") -> TestReport:
    """Run `test_command` (with /bin/sh) in `workdir` inside the sandbox, no network, and score it.

    Args:
        test_command: e.g. "python -m pytest -q -rA -p no:cacheprovider".
        workdir: the agent's working copy. home: a HOME folder for the run.
        tests: the named test ids (see `score`).
        path: the PATH the command gets (the trainer's interpreter first, so `python` has pytest).
        limits, isolation: as for ajet.tools.workdir_sandbox.run_in_workdir.

    Raises:
        JudgeError: the command could not run the tests at all (`cannot_run`): the episode fails, naming this
            judge and what to install.
    """
    result = await run_in_workdir(["/bin/sh", "-c", test_command], workdir, home, env={"PATH": path},
                                  limits=limits, isolation=isolation)
    text = result.stdout + ("\n" + result.stderr if result.stderr else "")
    reported = parse_pytest_results(result.stdout)
    if why := cannot_run(result.returncode, text, reported):
        hint = " (pip install pytest into the Python the command runs)" if "pytest" in why else ""
        raise JudgeError(f"judge {NAME} cannot run the test command `{test_command}`: {why}{hint}")
    reward, results = score(reported, tests)
    return TestReport(reward, results, result.returncode, text[-OUTPUT_KEEP:])
