"""Reading tasks from JSONL: GSM8K rows (`question`, `answer` ending in `#### N`) or ajet rows
(`query`, optional `answer`, optional `task_id`; other fields go to metadata)."""

from __future__ import annotations

import json
from pathlib import Path

from ajet.errors import ConfigError
from ajet.task import Task


def read_jsonl_tasks(path: str | Path, max_tasks: int | None = None) -> list[Task]:
    """All tasks in a JSONL file (blank lines skipped), at most `max_tasks`.

    Raises:
        ConfigError: missing or non-UTF-8 file, a line that is not a JSON object (names file:line), a row
            with neither `query` nor `question`, or no tasks at all.
        ValueError: `max_tasks` below 1.
    """
    path = Path(path)
    if max_tasks is not None and max_tasks < 1:
        raise ValueError(f"max_tasks must be at least 1 or None, got {max_tasks}")
    if not path.is_file():
        raise ConfigError(f"task file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit in a JSON string
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    tasks: list[Task] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{lineno}: each line must be a JSON object")
        tasks.append(row_to_task(row, f"{path.stem}-{lineno - 1}", f"{path}:{lineno}"))
        if max_tasks is not None and len(tasks) >= max_tasks:
            break
    if not tasks:
        raise ConfigError(f"{path}: no tasks in the file")
    return tasks


def row_to_task(row: dict, default_id: str, where: str) -> Task:
    """One `Task` from a row in ajet form (`query`, optional `answer`, `task_id`) or GSM8K form (`question`,
    `answer` ending in `#### N`); other fields go to metadata. `where` names the row in errors.

    Raises:
        ConfigError: the row has neither `query` nor `question`.
    """
    row = dict(row)
    task_id = str(row.pop("task_id", default_id))
    if "query" in row:
        query = row.pop("query")
        answer = row.pop("answer", None)
        return Task(task_id, str(query), None if answer is None else str(answer), row)
    if "question" in row:  # GSM8K: the final answer follows '#### '
        question, solution = row.pop("question"), str(row.pop("answer", ""))
        final = solution.rsplit("####", 1)[1].strip().replace(",", "") if "####" in solution else None
        return Task(task_id, str(question), final, {"solution": solution, **row})
    raise ConfigError(f"{where}: a task row needs `query` (ajet format) or `question` (GSM8K format); "
                      f"got keys {sorted(row)}")
