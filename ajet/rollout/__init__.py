"""Rollout sources: where the trainer's finished episodes come from.

The trainer (ajet/trainer.py) is the one training loop; it asks a `RolloutSource` for each step's
episodes and does the rest (merge, advantages, update, ledger, checkpoint). Sources:

    in_process.py     ajet runs the `Workflow` (or a command, see command.py) per episode: `ajet --conf`
    episodes.py       how one episode runs and is scored (shared by in_process.py and ray.py)
    ray.py            `--with-ray`: the same episodes on a pool of Ray actors
    episode_queue.py  clients anywhere begin and finish episodes over HTTP: `ajet serve`
    command.py        a `Workflow` that runs the user's unmodified program per episode

What a run mode (a command: train, serve, gateway, sft; ajet/commands/) hands the trainer is declared here too:

    RunMode(setup, read_datasets, port, server)      # ajet.trainer.run(cfg, mode)
    setup(ctx: RolloutContext) -> Rollout(source, update, after_training, workflow, judge, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ajet.config import AjetConfig
    from ajet.episode import Episode
    from ajet.proxy.server import ProxyServer
    from ajet.task import Task
    from ajet.task_sampler import MultiTaskSampler
    from ajet.tools.mcp_hub import McpHub
    from ajet.tracker.sample import Sample
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
        return them grouped by task. An episode that comes with `samples` (recorded ones: `ajet sft`) is trained
        on those as they are; the trainer merges the calls of every other one (ajet/tracker)."""

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



@runtime_checkable
class RefillableSource(RolloutSource, Protocol):
    """A `RolloutSource` that can roll out extra tasks for a step: what dynamic sampling
    (ajet/rollout/dynamic_sampling.py) needs to replace the groups without signal."""

    refills_while_running: bool
    """True: `collect_refilling` (a `RefillingSource`) starts extra tasks while the step's groups still run;
    False: the extra tasks are asked for with `collect_more` once the step's episodes are finished."""

    def collect_more(self, step: int, num_tasks: int) -> list[Episode]:
        """`num_tasks` more tasks for `step` (the next ones in sampler order), `num_repeat` episodes each,
        finished and committed; ids continue the step's task numbering."""


class RefillingSource(RefillableSource, Protocol):
    """A `RefillableSource` whose `refills_while_running` is True."""

    def collect_refilling(self, step: int, refill: Callable[[list[Episode]], int]) -> list[Episode]:
        """`collect(step)`, starting `refill(episodes of the groups finished so far)` extra tasks each time one of
        the step's groups finishes."""


class UpdatePolicy(Protocol):
    """How a step's samples update the policy. The trainer calls `attach` once, before the proxy starts, and
    `update` every step in place of `backbone.update`."""

    def attach(self, backbone: Any) -> None:
        """The run's backbone (ajet/backbones), before the proxy serves."""

    def update(self, backbone: Any, samples: list[Sample]) -> dict[str, float]:
        """Update the policy on `samples` (advantages set); returns the update's figures (`train/*`)."""


class DirectUpdate:
    """The plain `UpdatePolicy`: `backbone.update(samples)`, and the engine serves every update."""

    def attach(self, backbone: Any) -> None:
        """Nothing to keep."""

    def update(self, backbone: Any, samples: list[Sample]) -> dict[str, float]:
        """`backbone.update(samples)`."""
        return backbone.update(samples)


def _nothing() -> None:
    """The default `Rollout.after_training`: the run ends with its last step."""


@dataclass
class Rollout:
    """What a run mode sets up for one run from the trainer's `RolloutContext`.

    Attributes:
        source: where each step's episodes come from.
        update: how the step's samples update the policy (the gateway's goes through its evaluation gate).
        after_training: called after the last step, before anything is closed (the gateway keeps serving its
            last policy until stopped).
        workflow, judge: what the held-out evaluation (`trainer.val_freq`) runs; None: the config's, loaded
            when validation is on.
        staleness_bound: False when the episodes' samples were recorded under another run's policy versions
            (`ajet sft`): `trainer.async.max_staleness` does not apply to them.
        live_status: `live_status(episode)` -> the progress bar's status after each finished episode of the step
            being collected (None: none).
        step_line: `step_line(metrics)` -> text appended to the console line of a finished step (None: nothing).
    """

    source: RolloutSource
    update: UpdatePolicy = field(default_factory=DirectUpdate)
    after_training: Callable[[], None] = _nothing
    workflow: Any = None
    judge: Any = None
    staleness_bound: bool = True
    live_status: Callable[[Episode], str] | None = None
    step_line: Callable[[dict[str, Any]], str] | None = None


def no_datasets(cfg: AjetConfig) -> dict[str, list[Task]]:
    """The datasets of a mode that runs no task (the gateway's sessions, SFT's recorded episodes): none."""
    return {}


@dataclass
class RunMode:
    """A way of training: what a command (ajet/commands/) hands `ajet.trainer.run`.

    Attributes:
        setup: builds the run's `Rollout` from the trainer's context; called once, before the model loads (a
            workflow that cannot load fails before the model). Raises what the mode refuses (ConfigError).
        read_datasets: name -> tasks of each training dataset, read before anything else loads (the modes that
            draw tasks: in-process training, `ajet serve`); default none.
        port: the proxy's port (0: a free one).
        server: True for a server (`ajet serve`, `ajet gateway`): its proxy address is printed even with --quiet.
    """

    setup: Callable[[RolloutContext], Rollout]
    read_datasets: Callable[[AjetConfig], dict[str, list[Task]]] = no_datasets
    port: int = 0
    server: bool = False
