"""`Episode`: one run of the workflow on one task, with its recorded calls, reward and samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ajet.llm_call import LLMCall
    from ajet.task import Task
    from ajet.tool_types import ToolResult
    from ajet.tracker.sample import Sample
    from ajet.workflow import WorkflowOutput


@dataclass
class Episode:
    """One episode of a GRPO group.

    Attributes:
        episode_id: unique id.
        task: the task it ran.
        group_id: GRPO group key (episodes of the same task in the same step share it).
        repeat_index: which of the group's `num_repeat` rollouts this is.
        calls: the proxy's records, in arrival order.
        output: what the workflow returned (None if it failed).
        reward: final scalar reward (workflow's or judge's); None if the episode failed.
        error: traceback text when the workflow raised or timed out, else None.
        samples: training samples built by the context tracker.
        duration_s: wall-clock seconds the workflow ran.
        attempt: the trainer attempt that ran and stored it (its key in trajectories.sqlite with
            `episode_id`; an episode that a resumed `ajet serve` adopts keeps its first attempt's number).
        tool_calls: every `tuner.call_tool` call of the episode with its result, in call order.
        not_trained: why a successful episode is left out of the update (e.g. "zero_std_group", a guard's
            reason; see ajet/algorithm/), or None; the trainer records it in the store's ledger.
    """

    episode_id: str
    task: Task
    group_id: str
    repeat_index: int
    calls: list[LLMCall] = field(default_factory=list)
    output: WorkflowOutput | None = None
    reward: float | None = None
    error: str | None = None
    samples: list[Sample] = field(default_factory=list)
    duration_s: float = 0.0
    attempt: int = 0
    tool_calls: list[ToolResult] = field(default_factory=list)
    not_trained: str | None = None

    @property
    def ok(self) -> bool:
        """True when the episode finished with a finite reward and can be trained on."""
        return self.error is None and self.reward is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form for trajectories.jsonl."""
        return {
            "episode_id": self.episode_id,
            "task": self.task.to_dict(),
            "group_id": self.group_id,
            "repeat_index": self.repeat_index,
            "reward": self.reward,
            "error": self.error,
            "duration_s": self.duration_s,
            "output": None if self.output is None else {
                "final_answer": self.output.final_answer,
                "metadata": self.output.metadata,
                "metrics": self.output.metrics,
            },
            "calls": [c.to_dict() for c in self.calls],
            "tool_calls": [t.to_dict() for t in self.tool_calls],
            "samples": [s.to_dict() for s in self.samples],
            "not_trained": self.not_trained,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Episode:
        """The episode of a stored `to_dict()` record (samples are left out: the tracker rebuilds them from
        the calls). `record["attempt"]`, when present, sets `attempt`."""
        from ajet.llm_call import LLMCall
        from ajet.task import Task
        from ajet.workflow import WorkflowOutput

        out = record.get("output")
        return cls(episode_id=record["episode_id"], task=Task(**record["task"]), group_id=record["group_id"],
                   repeat_index=record["repeat_index"],
                   calls=[LLMCall.from_dict(c) for c in record["calls"]],
                   output=None if out is None else WorkflowOutput(reward=record.get("reward"), **out),
                   reward=record.get("reward"), error=record.get("error"), duration_s=record.get("duration_s", 0.0),
                   attempt=record.get("attempt", 0))
