"""A clock that moves only when the test moves it, for code that takes a `clock` (e.g. `EpisodeQueue`).

With the real clock, "idle for 3 s" or "heard from in the last 3 s" depends on how fast a loaded machine runs the
test's steps (at load 7 on 2 cores a 0.5 s pause can last several seconds); with this one it depends only on the
test's own `advance` calls. It also counts who reads it, so a test can wait for a polling thread to look again
(`waits_on`) instead of sleeping and hoping it did.
"""

from __future__ import annotations

import threading
import time
from collections import Counter


class ManualClock:
    """A monotonic clock, seconds, that stands still until `advance`.

    Thread-safe; counts the reads of each thread (`reads`) and wakes `wait_reads` on every read.
    """

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._reads: Counter[int] = Counter()
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            self._reads[threading.get_ident()] += 1
            self._cond.notify_all()
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by `seconds` (>= 0)."""
        assert seconds >= 0, seconds
        with self._cond:
            self._now += seconds

    def reads(self, thread: threading.Thread) -> int:
        """How often `thread` has read the clock so far."""
        with self._cond:
            return self._reads[thread.ident]

    def wait_reads(self, thread: threading.Thread, count: int, timeout_s: float = 60.0) -> bool:
        """Wait until `thread` has read the clock `count` times in all (a bound, not a speed target: a thread
        that ended reads no more); True when it has."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._reads[thread.ident] < count:
                if not thread.is_alive() or time.monotonic() >= deadline:
                    return False
                self._cond.wait(0.1)
            return True


def waits_on(clock: ManualClock, thread: threading.Thread) -> bool:
    """True when `thread`, a loop that reads `clock` once per pass under the lock that guards what it checks
    (`EpisodeQueue.wait_until_clients_told`), has looked at the state again since everything the caller changed
    before this call and has gone on waiting: it read the clock three more times (one of them may be the read
    before its loop; a pass that sees the change and returns reads no more) and is still alive."""
    seen = clock.reads(thread)
    return clock.wait_reads(thread, seen + 3) and thread.is_alive()
