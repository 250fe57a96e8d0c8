"""Why episodes failed, counted by kind: for the console line of a step that lost most of its episodes, the
`rollout/failed/<kind>` and `val/failed/<kind>` metrics, and an evaluation's validity (ajet/eval.py).

An episode's kind of failure is the exception named on the last line of its error (`TimeoutError`,
`RuntimeError`, `ValueError`, ...; a traceback ends with that line), or the word before the first colon of a
one-line reason (`abandoned` for an episode `ajet serve` gave up on).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from ajet.episode import Episode


def failure_kind(error: str) -> str:
    """The kind of an episode's `error` text: the exception class on its last non-empty line (module path
    dropped), else "error"."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    head = lines[-1].split(":", 1)[0].strip() if lines else ""
    name = head.rsplit(".", 1)[-1]
    return name if name.isidentifier() else "error"


def failure_counts(episodes: Iterable[Episode]) -> dict[str, int]:
    """kind -> failed episodes of that kind, the most frequent first (ties by name)."""
    counts = Counter(failure_kind(e.error or "") for e in episodes if not e.ok)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def failure_summary(episodes: list[Episode], more_than: float = 0.0) -> str:
    """One line: how many of `episodes` failed and why, e.g. "158 of 160 episodes failed: TimeoutError 158 (128
    with no call answered)"; the count in brackets is the failed episodes whose workflow never got a model
    call answered. An empty string when no more than the share `more_than` (0..1) of them failed."""
    failed = [e for e in episodes if not e.ok]
    if not failed or len(failed) <= more_than * len(episodes):
        return ""
    parts = []
    for kind, n in failure_counts(failed).items():
        silent = sum(1 for e in failed if failure_kind(e.error or "") == kind and not e.calls)
        parts.append(f"{kind} {n}" + (f" ({silent} with no call answered)" if silent else ""))
    return f"{len(failed)} of {len(episodes)} episodes failed: " + ", ".join(parts)
