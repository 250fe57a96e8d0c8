"""The tests judge: run a repository task's test command in the agent's working copy, inside the sandbox.

reward = (named tests that passed) / (named tests). A named test the command does not report (deleted, renamed,
a collection error) counts as failed. Results are read from pytest's `-rA` summary lines (`PASSED <id>`,
`FAILED <id> - message`, `ERROR <id>`, `XPASS`/`XFAIL`/`SKIPPED` count as not passed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ajet.tools.workdir_sandbox import WorkdirLimits, run_in_workdir

_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED)\s+(\S+)")
OUTPUT_KEEP = 8 * 1024      # characters of the test output kept on the episode


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
    """
    result = await run_in_workdir(["/bin/sh", "-c", test_command], workdir, home, env={"PATH": path},
                                  limits=limits, isolation=isolation)
    text = result.stdout + ("\n" + result.stderr if result.stderr else "")
    reward, results = score(parse_pytest_results(result.stdout), tests)
    return TestReport(reward, results, result.returncode, text[-OUTPUT_KEEP:])
