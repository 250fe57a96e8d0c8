"""Task sources. `load_tasks(cfg, "train" | "val")` reads the config's `data` section:

    train_path / val_path   a JSONL file (ajet or GSM8K rows), a json/csv/parquet/arrow file or a
                            `save_to_disk` folder (Hugging Face `datasets`, with `split` and `columns`)
    generator               `module:function(split, **generator_args)` yielding tasks (e.g. reasoning-gym)
    env_service             {url, env_type}: the task ids an HTTP environment service lists

Exactly one of train_path / generator / env_service names the training tasks (the config checks it).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ajet.errors import ConfigError
from ajet.task import Task
from ajet.tasks.jsonl import read_jsonl_tasks, row_to_task

if TYPE_CHECKING:
    from ajet.config import AjetConfig

__all__ = ["load_tasks", "read_datasets", "read_jsonl_tasks", "row_to_task"]


def load_tasks(cfg: AjetConfig, split: str, path: str | None = None) -> list[Task]:
    """The tasks of `split` ("train", "val" or "test") as `cfg.data` describes them; `path` overrides the split's
    file. The test set is read only from `data.test_path` (a generator or env service is never asked for it).

    Raises:
        ConfigError: no source for the split (e.g. no `data.val_path` for "val"), or the source's own
            errors (missing file, bad rows, unknown column or split).
    """
    from ajet.config import resolve_path

    d = cfg.data
    path = path or {"train": d.train_path, "test": d.test_path}.get(split, d.val_path)
    limit = d.max_tasks if split == "train" else None
    if path:
        p = resolve_path(cfg, path)
        fmt = d.format if d.format != "auto" else ("jsonl" if p.suffix.lower() == ".jsonl" and not d.columns else "hf")
        if fmt == "jsonl":
            return read_jsonl_tasks(p, limit)
        from ajet.tasks.hf import read_hf_tasks

        hf_split = d.split if split == "train" else ((d.test_split if split == "test" else d.val_split) or d.split)
        return read_hf_tasks(p, hf_split, d.columns, limit)
    if split == "test":
        raise ConfigError("no test tasks: set data.test_path")
    if d.generator:
        from ajet.tasks.generator import read_generator_tasks

        return read_generator_tasks(d.generator, split, d.generator_args, cfg.config_dir, limit)
    if d.env_service:
        from ajet.tasks.env_service import read_env_service_tasks

        return read_env_service_tasks(d.env_service.url, d.env_service.env_type, split, limit)
    raise ConfigError(f"no {split} tasks: set data.{split}_path" + (", data.generator or data.env_service"
                                                                   if split == "val" else ""))


def read_datasets(cfg: AjetConfig) -> dict[str, list[Task]]:
    """name -> tasks of every training dataset. In a multi-task run (`data.train`), each task id becomes
    `name/task_id` (ids stay unique across datasets) and its metadata gets `dataset: name`.

    Raises:
        ConfigError: a task source is missing or malformed (see `load_tasks`).
    """
    if cfg.data.train is None:
        return {"train": load_tasks(cfg, "train")}
    out = {}
    for d in cfg.data.train:
        tasks = load_tasks(cfg, "train", path=d.path)[: d.max_tasks]
        out[d.name] = [replace(t, task_id=f"{d.name}/{t.task_id}", metadata={**t.metadata, "dataset": d.name})
                       for t in tasks]
    return out


def task_source_name(cfg: AjetConfig, split: str) -> str:
    """A short description of where `split`'s tasks come from (for log lines)."""
    d = cfg.data
    path = {"train": d.train_path, "test": d.test_path}.get(split, d.val_path)
    return str(Path(path)) if path else (d.generator or (d.env_service.url if d.env_service else "?"))
