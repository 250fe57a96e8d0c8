"""Tasks from Hugging Face `datasets`: local json/jsonl/csv/parquet/arrow files and `save_to_disk` folders.

    data:
      train_path: data/train.parquet     # or a folder written by Dataset(Dict).save_to_disk
      split: train                       # the split of a DatasetDict folder (files have one split: train)
      columns: {query: problem, answer: solution, task_id: id}   # ajet field -> dataset column

Each row becomes a `Task` through the column mapping; unmapped columns go to metadata. Nothing is
downloaded: only local files and folders are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ajet.errors import ConfigError
from ajet.task import Task
from ajet.tasks.jsonl import row_to_task

# file suffix -> the `datasets` builder that reads it
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def read_hf_tasks(path: str | Path, split: str = "train", columns: dict[str, str] | None = None,
                  max_tasks: int | None = None) -> list[Task]:
    """Tasks from a local dataset file (by suffix, see `BUILDERS`) or a `load_from_disk` folder.

    Args:
        path: the file or folder.
        split: which split of a `DatasetDict` folder; a single file is read as one split.
        columns: ajet field (`query`, `answer`, `task_id`) -> column name; fields not named keep their
            own names (a row needs `query` or GSM8K's `question`).
        max_tasks: read at most this many rows.

    Raises:
        ConfigError: missing path, unknown suffix, unknown split, a mapped column not in the dataset.
    """
    import datasets

    path = Path(path)
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as exc:
            raise ConfigError(f"{path}: not a folder written by save_to_disk ({exc})") from exc
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(f"{path}: no split {split!r}; it has {', '.join(ds)} (set data.split)")
            ds = ds[split]
    elif path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(f"{path}: unknown dataset file type {path.suffix!r}; use one of "
                              f"{', '.join(sorted(BUILDERS))} or a save_to_disk folder")
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    else:
        raise ConfigError(f"task dataset not found: {path}")
    columns = dict(columns or {})
    missing = [c for c in columns.values() if c not in ds.column_names]
    if missing:
        raise ConfigError(f"{path}: data.columns names {missing} but the dataset's columns are {ds.column_names}")
    if max_tasks is not None:
        ds = ds.select(range(min(max_tasks, len(ds))))
    rename = {col: field for field, col in columns.items()}
    tasks = [row_to_task(_renamed(row, rename), f"{path.stem}-{i}", f"{path} row {i}") for i, row in enumerate(ds)]
    if not tasks:
        raise ConfigError(f"{path}: no tasks in the dataset")
    return tasks


def _renamed(row: dict[str, Any], rename: dict[str, str]) -> dict[str, Any]:
    return {rename.get(k, k): v for k, v in row.items()}
