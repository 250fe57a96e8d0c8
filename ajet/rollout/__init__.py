"""Rollout sources: where the trainer's finished episodes come from.

The trainer (ajet/trainer.py) is the one training loop; it asks a `RolloutSource` for each step's
episodes and does the rest (merge, advantages, update, ledger, checkpoint). Sources:

    in_process.py     ajet runs the `Workflow` (or a command, see command.py) per episode: `ajet --conf`
    episodes.py       how one episode runs and is scored (shared by in_process.py and ray.py)
    ray.py            `--with-ray`: the same episodes on a pool of Ray actors
    episode_queue.py  clients anywhere begin and finish episodes over HTTP: `ajet serve`
    command.py        a `Workflow` that runs the user's unmodified program per episode
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ajet.config import AjetConfig
    from ajet.episode import Episode
    from ajet.proxy.server import ProxyServer
    from ajet.task import Task
    from ajet.task_sampler import MultiTaskSampler
    from ajet.tools.mcp_hub import McpHub
    from ajet.trajectory_store import TrajectoryStore


@dataclass
class RolloutContext:
    """What the trainer hands a source factory.

    Attributes:
        cfg: the experiment config.
        datasets: name -> tasks of each training dataset (one, "train", unless `data.train` lists several).
        store: the trajectory store (read it to adopt earlier attempts' episodes; write through `record`).
        attempt: this trainer attempt's number.
        first_step: the step collected first (1, or the checkpoint's step + 1).
        record: `record(step, episode)` commits a finished episode to the store before training uses it.
        console: a rich console for status lines.
        tools: the run's MCP servers (config `tools.mcp_servers`), set by the trainer once they are started;
            None without servers. In-process workflows reach them as `tuner.tools` / `tuner.call_tool`.
    """

    cfg: AjetConfig
    datasets: dict[str, list[Task]]
    store: TrajectoryStore
    attempt: int
    first_step: int
    record: Callable[[int, Episode], None]
    console: Any
    tools: McpHub | None = None

    def sampler(self) -> MultiTaskSampler:
        """A fresh task sampler over the datasets (weights, shuffle and seed from the config)."""
        from ajet.task_sampler import MultiTaskSampler

        d = self.cfg.data
        return MultiTaskSampler(self.datasets, {x.name: x.weight for x in d.datasets()}, d.shuffle,
                                self.cfg.trainer.seed)


class RolloutSource(Protocol):
    """Yields each step's finished episodes: complete GRPO groups, `[tasks_per_step * num_repeat]`."""

    def bind(self, proxy: ProxyServer) -> None:
        """Use `proxy` (created, not yet started) to open episode endpoints; a source may wrap `proxy.app`."""

    def collect(self, step: int) -> list[Episode]:
        """Block until the episodes of `step` are finished (each already committed through `record`);
        return them grouped by task."""

    def step_done(self, step: int) -> None:
        """The update of `step` is applied (the engine serves the new policy)."""

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint after `step` must hold to hand out the same tasks on resume."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s state (on resume, before `bind`)."""

    def metrics(self) -> dict[str, Any]:
        """Per-step figures of the source itself (merged into metrics.jsonl)."""

    def close(self) -> None:
        """Stop handing out work."""

