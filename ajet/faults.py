"""Test-only fault injection: deterministic `kill -9` points for the resume tests.

`AJET_TEST_KILL_AT=<point>@<step>[,<point>@<step>...]` makes the process SIGKILL itself the first time it
reaches the named point of that step (without `@<step>`: of any step). Never set it outside tests. Points:

    rollout      after the step's first finished episode is committed to the store (others still running)
    stored       after every episode of the step is committed, before the update
    update       after `backbone.update` returned, before the ledger says which episodes it trained on
    trained      after the trained-on ledger is committed, before metrics and trajectories are logged
    checkpoint   mid-checkpoint: the new folder is written but not yet renamed into place
    swap         re-saving an existing checkpoint step: after the old folder is moved aside

`ajet gateway`'s update (ajet/gateway/gate.py; the step is the update's):

    gw_update      the backbone's update returned (the candidate trained), nothing written
    gw_checkpoint  the new version's checkpoint folder is in place, its `versions` row not yet written
    gw_record      the `versions` row is committed, the version not yet switched in
    gw_publish     the version is switched in (before the trainer's ledger)

`AJET_TEST_PAUSE_AT` (same form) pauses instead: the thread that reaches the point prints
`ajet-test: paused at <point>@<step>` on stderr and sleeps (at most 10 minutes, then SIGKILLs the process), so
that a test can look at the running process before it sends the SIGKILL itself.
"""

from __future__ import annotations

import os
import signal
import sys
import time

ENV = "AJET_TEST_KILL_AT"
PAUSE_ENV = "AJET_TEST_PAUSE_AT"
PAUSE_MAX_S = 600.0


def kill_point(name: str, step: int) -> None:
    """SIGKILL this process if `AJET_TEST_KILL_AT` names `name` at `step` (or at any step); pause it there
    first if `AJET_TEST_PAUSE_AT` names it (see the module docstring)."""
    if _named(os.environ.get(PAUSE_ENV), name, step):
        print(f"ajet-test: paused at {name}@{step}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_MAX_S)
        os.kill(os.getpid(), signal.SIGKILL)
    if _named(os.environ.get(ENV), name, step):
        os.kill(os.getpid(), signal.SIGKILL)


def _named(spec: str | None, name: str, step: int) -> bool:
    """Whether `spec` (`<point>@<step>,...`) names `name` at `step` (or at any step)."""
    for item in (spec or "").split(","):
        point, _, at = item.strip().partition("@")
        if point == name and (not at or int(at) == step):
            return True
    return False
