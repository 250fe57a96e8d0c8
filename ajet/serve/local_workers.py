"""Episodes that `ajet serve` runs itself: the config's `workflow` (a `Workflow` class or a command) as
`serve.local_workers` clients of its own episode queue, beside the remote ones.

Each worker loops: take the next place from the queue (as a remote client's `begin` would), run the
workflow against the episode's endpoint (`ajet.rollout.episodes.execute_workflow`), finish the episode
with its reward (the queue applies the judge and the finite-reward check) or with its error. They stop
when the run is finished.
"""

from __future__ import annotations

import asyncio
import threading

from ajet.rollout.episode_queue import EpisodeApiError, EpisodeQueue
from ajet.task import Task
from ajet.workflow import Tuner, Workflow


class LocalWorkers:
    """`n` episode loops of `workflow` on their own event loop thread.

    Args:
        queue: the server's episode queue.
        workflow: the workflow to run (one instance serves all workers).
        n: how many episodes run at once.
        timeout_s: per-episode limit, seconds (`rollout.episode_timeout_s`; the time the episode's calls wait in
            the engine's queue does not count).
    """

    def __init__(self, queue: EpisodeQueue, workflow: Workflow, n: int, timeout_s: float):
        self.queue, self.workflow, self.n, self.timeout_s = queue, workflow, n, timeout_s
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="ajet-local-workers",
                                        daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self._thread.ident is not None

    def start(self) -> LocalWorkers:
        self._thread.start()
        return self

    async def _main(self) -> None:
        await asyncio.gather(*(self._worker(i) for i in range(self.n)))

    async def _worker(self, i: int) -> None:
        from ajet.rollout.episodes import execute_workflow

        while True:
            try:
                ep = await asyncio.to_thread(self.queue.begin, f"local-{i}")
            except EpisodeApiError as exc:
                if exc.code in ("run_finished", "server_restarting"):   # the trainer is done, or stopped
                    return
                await asyncio.sleep(exc.retry_after_s or 1.0)
                continue
            tuner = Tuner(base_url=ep["base_url"], api_key=ep["api_key"], model=ep["model"],
                          episode_id=ep["episode_id"], _engine_wait=self.queue.proxy.engine_wait(ep["api_key"]))
            try:
                output, error = await execute_workflow(self.workflow, Task(**ep["task"]), tuner, self.timeout_s)
            finally:
                await tuner.aclose()
            eid = ep["episode_id"]
            try:
                if error is None:   # the queue scores it (the workflow's reward, else the judge)
                    await asyncio.to_thread(self.queue.finish, eid, output.reward, output.final_answer,
                                            output.metadata, output.metrics)
                    continue
            except EpisodeApiError as exc:    # a non-finite reward, no reward and no judge
                error = f"{exc.code}: {exc.message}"
            except Exception:  # noqa: BLE001 - the episode went away (abandoned, run over): nothing to record
                continue
            try:
                await asyncio.to_thread(self.queue.finish, eid, error=error)
            except EpisodeApiError:
                pass
