"""The in-process rollout source: one workflow execution per (task, repeat), each behind its own proxy
endpoint, all in this process (`ajet --conf`), or on a pool of Ray actors (`--with-ray`, ray.py).
How one episode runs and is scored: episodes.py.

Synchronous (`trainer.async.max_staleness` unset): `collect(step)` draws the step's tasks, runs its episodes and
returns them. Asynchronous (K = max_staleness): a producer thread with its own event loop starts step t's
episodes as soon as step t - 1 - K is trained, so the episodes of the next K steps keep running while the
backbone updates; `collect(t)` waits for step t's groups only, and the episodes of later steps still running
carry over. Each step's tasks are numbered draws of the task sampler (`MultiTaskSampler.draw`), base and extra
(dynamic sampling draws step t's extra tasks after the producer drew step t + 1's); a checkpoint after step t
keeps the draws of the later steps handed out already, so a resumed run hands each step the draws it had, and
every draw is trained by exactly one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Callable

from ajet.config import CommandWorkflowConfig, HarnessWorkflowConfig
from ajet.episode import Episode
from ajet.errors import ConfigError
from ajet.importing import load_object
from ajet.judges import load_judge
from ajet.proxy.server import ProxyServer
from ajet.rollout import Rollout, RolloutContext, RunMode
from ajet.rollout.command import CommandWorkflow
from ajet.rollout.episodes import Judge, group_ids, rollout
from ajet.workflow import FunctionWorkflow, Workflow

def load_workflow(cfg) -> Workflow:
    """The config's workflow: an instance of its `Workflow` class, a `CommandWorkflow`, or a `HarnessWorkflow`.

    Raises:
        ConfigError: no `workflow` in the config, or it cannot be loaded.
    """
    if cfg.workflow is None:
        raise ConfigError("the config names no `workflow` (a `file.py:Class`, a `module:Class`, an async episode "
                          "function `file.py:function`, or `{command: [...]}`); only `ajet serve` runs without one")
    if isinstance(cfg.workflow, CommandWorkflowConfig):
        return CommandWorkflow(cfg.workflow, cfg.config_dir)
    if isinstance(cfg.workflow, HarnessWorkflowConfig):
        from ajet.harnesses.workflow import HarnessWorkflow

        return HarnessWorkflow(cfg.workflow, cfg.harnesses, cfg.config_dir)
    # a built-in workflow may read its config section
    return make_workflow(load_object(cfg.workflow, cfg.config_dir), cfg, cfg.workflow)


def make_workflow(obj: Any, cfg, name: str) -> Workflow:
    """The workflow `obj` is: a `Workflow` subclass instantiated (`from_config(cfg)` when it has one), a `Workflow`
    instance as is, an `async def fn(task, tuner)` as a `FunctionWorkflow`.

    Raises:
        ConfigError: `obj` is none of these (the message names it by `name`: the config's text, or the object).
    """
    import inspect

    if isinstance(obj, type) and issubclass(obj, Workflow):
        return obj.from_config(cfg) if hasattr(obj, "from_config") else obj()
    if isinstance(obj, Workflow):
        return obj
    if inspect.iscoroutinefunction(obj):
        return FunctionWorkflow(obj)
    what = "a plain function" if inspect.isfunction(obj) else f"a {type(obj).__name__}"
    raise ConfigError(f"workflow {name} is {what}: give a Workflow subclass or an `async def fn(task, tuner) -> "
                      f"WorkflowOutput`")


def in_process_mode(workflow: Workflow | None = None, judge: Judge | None = None) -> RunMode:
    """`ajet --conf`'s run mode (`ajet.trainer.run`'s default): the config's training datasets, the workflow run
    in this process (or on Ray actors), with dynamic sampling's refill when `algorithm.dynamic_sampling` is on.
    `workflow` and `judge` (objects, e.g. `ajet.Job`'s) replace the ones the config names."""
    from ajet.tasks import read_datasets

    return RunMode(functools.partial(setup_in_process, workflow=workflow, judge=judge), read_datasets)


def setup_in_process(ctx: RolloutContext, workflow: Workflow | None = None, judge: Judge | None = None) -> Rollout:
    """The `Rollout` of `in_process_mode`: an `InProcessRollout` (wrapped by `DynamicSampling` when enabled); the
    held-out evaluation runs its workflow and judge (`workflow`, `judge`: given objects instead of the config's).

    Raises:
        ConfigError: the config has an `sft:` section (fine-tuning on recorded samples is `ajet.commands.sft.sft_mode`), or
            the workflow or judge cannot be loaded.
    """
    from ajet.rollout.dynamic_sampling import with_dynamic_sampling

    if ctx.cfg.sft is not None:
        raise ConfigError("the config has an `sft:` section (fine-tuning on a finished run's recorded samples): run "
                          "it with `ajet sft` (from Python: ajet.trainer.run(cfg, ajet.commands.sft.sft_mode()))")
    source = InProcessRollout.from_context(ctx, workflow, judge)
    return Rollout(with_dynamic_sampling(source, ctx.cfg), workflow=source.workflow, judge=source.judge)


class InProcessRollout:
    """The rollout source of `ajet --conf`: runs the workflow on `tasks_per_step` tasks x `num_repeat` per step,
    in this process (the tasks in `MultiTaskSampler` order, so a resumed run sees the same data)."""

    def __init__(self, ctx: RolloutContext, workflow: Workflow, judge: Judge | None):
        self.ctx, self.workflow, self.judge = ctx, workflow, judge
        self.sampler = ctx.sampler()
        self.proxy: ProxyServer | None = None
        self.run_episodes: Callable[..., Any] = rollout   # or, with --with-ray, a pool of Ray actors
        self._producer: threading.Thread | None = None     # asynchronous training only (see the module docstring)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._steps: dict[int, concurrent.futures.Future] = {}
        self._trained = 0
        self._stopping = False
        r = ctx.cfg.rollout
        if r.ray_workers:
            from ajet.rollout.ray import RayRollout

            self.run_episodes = RayRollout(r.ray_workers, r.ray_address)

    @classmethod
    def from_context(cls, ctx: RolloutContext, workflow: Workflow | None = None,
                     judge: Judge | None = None) -> InProcessRollout:
        """Load the config's workflow (a class, or a command) and judge, unless given as objects.

        Raises:
            ConfigError: the workflow or judge cannot be loaded.
        """
        cfg = ctx.cfg
        judge = judge if judge is not None else load_judge(cfg)
        return cls(ctx, workflow if workflow is not None else load_workflow(cfg), judge)

    def bind(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    def collect(self, step: int) -> list[Episode]:
        if self.ctx.cfg.trainer.async_.max_staleness is None:
            return self.collect_more(step, self.ctx.cfg.trainer.tasks_per_step)
        if self._producer is None:
            self._start_producer(step)
        return self._steps[step].result()        # raises what the producer raised for this step

    def collect_more(self, step: int, num_tasks: int) -> list[Episode]:
        """`num_tasks` more tasks for `step` (dynamic sampling's refill; synchronously, also under asynchronous
        training), the next ones in sampler order; their episode ids continue the step's task numbering."""
        return asyncio.run(self._run_step(step, *self._draw(step, num_tasks), None))

    @property
    def refills_while_running(self) -> bool:
        """Whether `collect_refilling` may be used: under synchronous training (an asynchronous step's episodes
        are started by the producer before the trainer collects them)."""
        return self.ctx.cfg.trainer.async_.max_staleness is None

    def collect_refilling(self, step: int, refill: Callable[[list[Episode]], int]) -> list[Episode]:
        """`collect(step)` with dynamic sampling's extra tasks started while the step's other groups still run.

        Each time one of the step's groups finishes (all its `num_repeat` episodes), `refill(the episodes of every
        group finished so far)` returns how many extra tasks to draw now; they are the next draws in sampler order,
        numbered and seeded as `collect_more` would number and seed them, and their episodes start at once beside
        those still running (one `rollout.max_concurrency` bound over all). A refill that `refill` decides from
        each finished group alone (`DynamicSampling`) thus draws the same tasks as refilling after the whole
        batch, and their episodes sample the same tokens (up to the engine's batch-dependent float rounding),
        but the engine is not left decoding a batch's last few episodes alone before the next tasks start.

        Returns:
            the step's episodes in draw order (the step's tasks, then the extra ones), `num_repeat` per task.
        """
        return asyncio.run(self._run_refilling(step, refill))

    async def _run_refilling(self, step: int, refill: Callable[[list[Episode]], int]) -> list[Episode]:
        sem = asyncio.Semaphore(self.ctx.cfg.rollout.max_concurrency)
        num_repeat = self.ctx.cfg.rollout.num_repeat
        running: dict[str, list[Episode]] = {}     # group id -> its finished episodes, until all are
        finished: list[Episode] = []               # the episodes of the finished groups
        batches: list[asyncio.Future] = []         # one per draw, in draw order

        def start(num_tasks: int | None) -> None:
            batches.append(asyncio.ensure_future(self._run_step(step, *self._draw(step, num_tasks), sem, done)))

        def done(ep: Episode) -> None:
            self.ctx.record(step, ep)
            group = running.setdefault(ep.group_id, [])
            group.append(ep)
            if len(group) == num_repeat:
                finished.extend(running.pop(ep.group_id))
                if (n := refill(finished)) > 0:
                    start(n)

        start(None)
        episodes: list[Episode] = []
        i = 0
        while i < len(batches):   # grows while awaited; a batch's `done` calls run before it ends, so once the
            episodes += await batches[i]            # last one has ended, no batch is started any more
            i += 1
        return episodes

    def _draw(self, step: int, num_tasks: int | None = None) -> tuple[list, int, list[str]]:
        """`num_tasks` (default `tasks_per_step`) more draws for `step`: (their tasks, the index in the step of
        the first, their group ids: `ajet.rollout.episodes.group_ids` over all the step's draws)."""
        new = self.sampler.draw(step, num_tasks or self.ctx.cfg.trainer.tasks_per_step)
        drawn = self.sampler.drawn(step)          # (only this step's own thread draws for it: no one in between)
        first = len(drawn) - len(new)
        return [d.task for d in new], first, group_ids(step, [d.task.task_id for d in drawn])[first:]

    async def _run_step(self, step: int, tasks: list, first_task_index: int, groups: list[str],
                        sem: asyncio.Semaphore | None, on_episode_done: Callable[[Episode], None] | None = None
                        ) -> list[Episode]:
        """The episodes of `tasks` (`num_repeat` each), each recorded as it finishes (`on_episode_done`, default
        `ctx.record`)."""
        r = self.ctx.cfg.rollout
        done = on_episode_done or (lambda ep: self.ctx.record(step, ep))
        return await self.run_episodes(self.workflow, tasks, r.num_repeat, self.proxy, self.judge, step, r.max_concurrency,
                                       r.episode_timeout_s, on_episode_done=done,
                                       attempt=self.ctx.attempt, tools=self.ctx.tools, first_task_index=first_task_index,
                                       groups=groups, **({"semaphore": sem} if sem is not None else {}))

    # ---- asynchronous: a producer running up to max_staleness steps ahead of the update ---------------
    def _start_producer(self, first_step: int) -> None:
        total = self.ctx.cfg.trainer.total_steps
        self._steps = {t: concurrent.futures.Future() for t in range(first_step, total + 1)}
        self._trained = first_step - 1
        self._loop = asyncio.new_event_loop()
        self._producer = threading.Thread(target=self._run_producer, args=(first_step, total),
                                          name="ajet-rollout-producer", daemon=True)
        self._producer.start()

    def _run_producer(self, first_step: int, total: int) -> None:
        try:
            self._loop.run_until_complete(self._produce(first_step, total))
        except asyncio.CancelledError:      # close(): the episodes still running are dropped
            pass

    async def _produce(self, first_step: int, total: int) -> None:
        """Start each step's episodes once the update `max_staleness + 1` steps earlier is done; one semaphore
        bounds the episodes running at once across steps (`rollout.max_concurrency`), except on Ray (its pool)."""
        k = self.ctx.cfg.trainer.async_.max_staleness
        sem = asyncio.Semaphore(self.ctx.cfg.rollout.max_concurrency) if self.run_episodes is rollout else None
        self._wake = asyncio.Event()
        running = []
        for step in range(first_step, total + 1):
            while self._trained < step - 1 - k and not self._stopping:
                self._wake.clear()
                await self._wake.wait()
            if self._stopping:
                break
            future = self._steps[step]
            try:
                drawn = self._draw(step)
            except Exception as exc:  # noqa: BLE001 - the trainer hears it from collect
                future.set_exception(exc)
                break
            job = asyncio.ensure_future(self._run_step(step, *drawn, sem))
            job.add_done_callback(lambda j, f=future: _settle(f, j))
            running.append(job)
        await asyncio.gather(*running, return_exceptions=True)

    def step_done(self, step: int) -> None:
        """The update of `step` is applied: the producer may start the step `max_staleness + 1` later."""
        self.sampler.retire(step)
        self._trained = step
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The sampler's position with the draws of the steps after `step` handed out already (see the module
        docstring)."""
        return {"sampler": self.sampler.state(after_step=step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.set_state(state["sampler"])

    def metrics(self) -> dict[str, Any]:
        """With --with-ray, the pool's figures (`rollout/ray_nodes`: nodes the last step's episodes ran on)."""
        return self.run_episodes.metrics() if hasattr(self.run_episodes, "metrics") else {}

    def close(self) -> None:
        """Stop handing out work; with a producer, cancel the episodes still running (never stored: a resumed
        run rolls their steps out again) and wait for its thread."""
        self._stopping = True
        if self._producer is not None and self._loop is not None:
            def cancel() -> None:
                for task in asyncio.all_tasks(self._loop):
                    task.cancel()
            self._loop.call_soon_threadsafe(cancel)   # the loop is closed here only: a late call never fails
            self._producer.join(timeout=30)
            if not self._producer.is_alive():
                self._loop.close()
        if hasattr(self.run_episodes, "close"):
            self.run_episodes.close()


def _settle(future: concurrent.futures.Future, job: asyncio.Future) -> None:
    """Hand a finished step's episodes (or its error) to the trainer waiting in `collect`."""
    if future.done():
        return
    if job.cancelled():
        future.set_exception(RuntimeError("the rollout source was closed before this step's episodes finished"))
    elif job.exception() is not None:
        future.set_exception(job.exception())
    else:
        future.set_result(job.result())
