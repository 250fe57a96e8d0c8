"""Test-only fault injection: deterministic `kill -9` points for the resume tests.

`AJET_TEST_KILL_AT=<point>@<step>[,<point>@<step>...]` makes the process SIGKILL itself the first time it
reaches the named point of that step (without `@<step>`: of any step). Never set it outside tests. Points:

    rollout      after the step's first finished episode is committed to the store (others still running)
    stored       after every episode of the step is committed, before the update
    update       after `backbone.update` returned, before the ledger says which episodes it trained on
    trained      after the trained-on ledger is committed, before metrics and trajectories are logged
    checkpoint   mid-checkpoint: the new folder is written but not yet renamed into place
    swap         re-saving an existing checkpoint step: after the old folder is moved aside
"""

from __future__ import annotations

import os
import signal

ENV = "AJET_TEST_KILL_AT"


def kill_point(name: str, step: int) -> None:
    """SIGKILL this process if `AJET_TEST_KILL_AT` names `name` at `step` (or at any step)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        point, _, at = item.strip().partition("@")
        if point == name and (not at or int(at) == step):
            os.kill(os.getpid(), signal.SIGKILL)
