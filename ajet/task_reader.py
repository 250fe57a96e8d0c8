"""Moved to `ajet.tasks.jsonl`; this name stays importable."""

from ajet.tasks.jsonl import read_jsonl_tasks, row_to_task

__all__ = ["read_jsonl_tasks", "row_to_task"]
