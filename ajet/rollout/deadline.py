"""An episode's time limit that counts the episode's own time, not the time its calls waited in the engine's queue.

With more episodes running than the engine has rows (`rollout.max_concurrency` 64 against `max_batch_size` 32,
an evaluation of 160 tasks), a call can wait for minutes before generation starts for it; a wall-clock limit
then fails episodes whose agent never got a turn. `run_within` extends the limit by the time the episode's
calls spent queued (`ajet.engines.base.EngineWait`, reported by the engine through the proxy): the limit is on the
episode's wall-clock time minus that wait. Generating, tool calls and the agent's own work all count. It is
the one timer of `rollout.episode_timeout_s` (in-process workflows, `ajet serve`'s local workers) and of a
command workflow's `workflow.timeout_s`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, TypeVar

from ajet.engines.base import EngineWait

T = TypeVar("T")

POLL_WHILE_QUEUED_S = 0.1   # at the limit with a call still queued: look again after this long (seconds)


class EpisodeTimeout(TimeoutError):
    """The awaited work ran longer than its limit, its queue time not counted.

    Attributes:
        timeout_s: the limit, seconds. queued_s: the queue time that did not count, seconds.
    """

    def __init__(self, timeout_s: float, queued_s: float):
        self.timeout_s, self.queued_s = timeout_s, queued_s
        super().__init__(f"ran longer than {timeout_s:g} s, not counting {queued_s:.1f} s its calls waited in the "
                         f"engine's queue")


async def run_within(aw: Awaitable[T], timeout_s: float, wait: EngineWait | None) -> T:
    """Await `aw`, cancelling it once it has run `timeout_s` seconds not counting the time `wait` grew
    meanwhile (its calls queued in the engine); with `wait` None, a plain wall-clock limit.

    While a call is queued, the limit is never reached (it moves with the clock); once every call is admitted
    the remaining time runs again.

    Returns:
        what `aw` returns.

    Raises:
        EpisodeTimeout: the limit was reached (`aw` is cancelled and awaited first).
        whatever `aw` raises.
    """
    task = asyncio.ensure_future(aw)
    start = time.monotonic()
    waited0 = wait.seconds() if wait is not None else 0.0
    try:
        while True:
            queued = wait.seconds() - waited0 if wait is not None else 0.0
            left = timeout_s + queued - (time.monotonic() - start)
            if left <= 0 and not (wait is not None and wait.queued_calls > 0):
                raise EpisodeTimeout(timeout_s, queued)
            done, _ = await asyncio.wait({task}, timeout=max(left, POLL_WHILE_QUEUED_S))
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
