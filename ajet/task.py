"""`Task`: one problem an agent workflow is asked to solve (a row of a task file or an env seed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One task.

    Attributes:
        task_id: stable identifier, unique within a task source (used for GRPO grouping and logs).
        query: the problem statement handed to the workflow (e.g. a GSM8K question).
        answer: the reference answer a judge compares against, or None when the workflow scores itself.
        metadata: any other fields of the source row (kept verbatim, JSON-serialisable).
    """

    task_id: str
    query: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The task as a JSON-serialisable dict with the four fields (what the episode API hands a client)."""
        return {"task_id": self.task_id, "query": self.query, "answer": self.answer, "metadata": self.metadata}
