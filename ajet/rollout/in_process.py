"""The in-process rollout source: one workflow execution per (task, repeat), each behind its own proxy
endpoint, all in this process (`ajet --conf`), or on a pool of Ray actors (`--with-ray`, ray.py).
How one episode runs and is scored: episodes.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ajet.config import CommandWorkflowConfig, HarnessWorkflowConfig
from ajet.episode import Episode
from ajet.errors import ConfigError
from ajet.importing import load_object
from ajet.judges import load_judge
from ajet.proxy.server import ProxyServer
from ajet.rollout import RolloutContext
from ajet.rollout.command import CommandWorkflow
from ajet.rollout.episodes import Judge, rollout
from ajet.workflow import Workflow

def load_workflow(cfg) -> Workflow:
    """The config's workflow: an instance of its `Workflow` class, a `CommandWorkflow`, or a `HarnessWorkflow`.

    Raises:
        ConfigError: no `workflow` in the config, or it cannot be loaded.
    """
    if cfg.workflow is None:
        raise ConfigError("the config names no `workflow` (a `file.py:Class`, a `module:Class`, or "
                          "`{command: [...]}`); only `ajet serve` runs without one")
    if isinstance(cfg.workflow, CommandWorkflowConfig):
        return CommandWorkflow(cfg.workflow, cfg.config_dir)
    if isinstance(cfg.workflow, HarnessWorkflowConfig):
        from ajet.harnesses.workflow import HarnessWorkflow

        return HarnessWorkflow(cfg.workflow, cfg.harnesses, cfg.config_dir)
    workflow_cls = load_object(cfg.workflow, cfg.config_dir)   # a built-in workflow may read its config section
    return workflow_cls.from_config(cfg) if hasattr(workflow_cls, "from_config") else workflow_cls()


class InProcessRollout:
    """The rollout source of `ajet --conf`: runs the workflow on `tasks_per_step` tasks x `num_repeat` per step,
    in this process (the tasks in `MultiTaskSampler` order, so a resumed run sees the same data)."""

    def __init__(self, ctx: RolloutContext, workflow: Workflow, judge: Judge | None):
        self.ctx, self.workflow, self.judge = ctx, workflow, judge
        self.sampler = ctx.sampler()
        self.proxy: ProxyServer | None = None
        self.run_episodes: Callable[..., Any] = rollout   # or, with --with-ray, a pool of Ray actors
        r = ctx.cfg.rollout
        if r.ray_workers:
            from ajet.rollout.ray import RayRollout

            self.run_episodes = RayRollout(r.ray_workers, r.ray_address)

    @classmethod
    def from_context(cls, ctx: RolloutContext) -> InProcessRollout:
        """Load the config's workflow (a class, or a command) and judge.

        Raises:
            ConfigError: the workflow or judge cannot be loaded.
        """
        cfg = ctx.cfg
        judge = load_judge(cfg)
        return cls(ctx, load_workflow(cfg), judge)

    def bind(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    def collect(self, step: int) -> list[Episode]:
        r = self.ctx.cfg.rollout
        tasks = self.sampler.next_batch(self.ctx.cfg.trainer.tasks_per_step)
        return asyncio.run(self.run_episodes(self.workflow, tasks, r.num_repeat, self.proxy, self.judge, step, r.max_concurrency,
                                   r.episode_timeout_s, on_episode_done=lambda ep: self.ctx.record(step, ep),
                                   attempt=self.ctx.attempt, tools=self.ctx.tools))

    def step_done(self, step: int) -> None:
        pass

    def state_dict(self, step: int) -> dict[str, Any]:
        return {"sampler": self.sampler.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.set_state(state["sampler"])

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if hasattr(self.run_episodes, "close"):
            self.run_episodes.close()
