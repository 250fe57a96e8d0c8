"""Why episodes failed, counted by kind: for the console line of a step that lost most of its episodes, the
`rollout/failed/<kind>` and `val/failed/<kind>` metrics, and an evaluation's validity (ajet/eval.py).

An episode's kind of failure is the exception named on the last line of its error (`TimeoutError`,
`RuntimeError`, `ValueError`, ...; a traceback ends with that line), or the word before the first colon of a
one-line reason (`abandoned` for an episode `ajet serve` gave up on).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sysconfig
from collections import Counter
from pathlib import Path
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


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def failure_message(error: str) -> str:
    """The exception line of an episode's `error` text: its last non-empty line ("RuntimeError: no tool named
    x"), at most 300 characters; "" for an empty error."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def user_frame(error: str) -> str | None:
    """Where the user's own code raised: "wf.py:12 in execute" (path as the traceback names it, shortened to
    the current folder when inside it) for the innermost frame of the last traceback in `error` that is
    neither ajet's nor the standard library's nor an installed package's. None when there is no such frame
    (a timeout, a command workflow's exit status, an error raised inside ajet)."""
    blocks = error.split("Traceback (most recent call last):")
    if len(blocks) < 2:
        return None
    found = None
    for line in blocks[-1].splitlines():
        m = _FRAME.match(line)
        if m and is_user_file(m["path"]):
            found = m
    if found is None:
        return None
    path = found["path"]
    with contextlib.suppress(ValueError):
        path = os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else path
    return f"{path}:{found['line']} in {found['func'].strip()}"


def is_user_file(path: str) -> bool:
    """Whether `path` (a traceback frame's file) is the user's code: not ajet's, not the standard library's nor
    an installed package's, not a frozen or generated module (`<frozen ...>`, `<string>`)."""
    if path.startswith("<"):   # <frozen ...>, <string>
        return False
    p = Path(path).resolve()
    parts = set(p.parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not any(p.is_relative_to(root) for root in _library_roots())


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[Path, ...]:
    """ajet's package folder and the interpreter's library folders."""
    roots = {Path(__file__).resolve().parent}   # this module's folder is ajet's (no `import ajet`: its layers)
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(Path(sysconfig.get_paths()[name]).resolve())
    return tuple(roots)


def failure_key(error: str) -> tuple[str, str]:
    """What makes two failures the same error: the user's frame and the exception's kind when there is a frame
    (one raise site, whatever its message says), else the message with its numbers blanked (a timeout's
    measured seconds differ every time)."""
    frame = user_frame(error)
    return (failure_kind(error), frame) if frame else (failure_kind(error), re.sub(r"\d+(\.\d+)?", "#",
                                                                                 failure_message(error)))


def failure_lines(episodes: Iterable[Episode], seen: set[tuple[str, str]] | None = None) -> list[str]:
    """One line per distinct error among the failed `episodes` (`failure_key`), the most frequent first:
    "RuntimeError: no tool named x (at wf.py:12 in execute; 8 episodes)". With `seen` (a run's set of keys
    already shown), errors shown before are left out and the new ones are added to it."""
    groups: dict[tuple[str, str], list[str]] = {}
    for e in episodes:
        if not e.ok:
            groups.setdefault(failure_key(e.error or ""), []).append(e.error or "")
    lines = []
    for key, errors in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        if seen is not None:
            if key in seen:
                continue
            seen.add(key)
        frame = user_frame(errors[0])
        where = f"at {frame}; " if frame else ""
        n = len(errors)
        lines.append(f"{failure_message(errors[0]) or 'failed (no error text)'} ({where}{n} episode{'s' * (n != 1)})")
    return lines
