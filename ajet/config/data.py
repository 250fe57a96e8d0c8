"""Where tasks come from: `data:` (one task file, several datasets, a generator or an environment service)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ajet.config.base import _Section


class DatasetConfig(_Section):
    """One dataset of a multi-task run: `name` (prefixes its task ids: `name/task_id`), `path` (a task file,
    in any form `train_path` takes), `weight` (relative share of the GRPO groups drawn from it), `max_tasks`."""

    name: str = Field(min_length=1, pattern=r"^[^/:\s]+$", description="the dataset's name, prefixed to its task ids "
                                                                       "(`name/task_id`); no `/`, `:` or whitespace")
    path: str = Field(description="its task file, in any form `data.train_path` takes")
    weight: float = Field(1.0, gt=0, description="relative share of the GRPO groups whose task is drawn from this "
                                                 "dataset")
    max_tasks: int | None = Field(None, gt=0, description="read at most this many of its tasks (None: all)")


class EnvServiceSource(_Section):
    """An environment service over HTTP (AgentJet's env-service shape; see ajet/tasks/env_service.py)."""

    url: str = Field(description="base URL of the environment service, e.g. http://127.0.0.1:8080")
    env_type: str = Field(description="the environment type asked of the service (its `env_type` parameter)")


ONE_TASK_SOURCE = "name exactly one task source: train_path, train (several datasets), generator or env_service"
"""What a config with no task source, or several, is told (the modes that read tasks need exactly one)."""


class DataConfig(_Section):
    """Where tasks come from (ajet/tasks/). Exactly one of (modes gateway and sft read no tasks: none there):

    train_path: a JSONL file (GSM8K rows or {task_id, query, answer}), a json/csv/parquet/arrow file or a
        `save_to_disk` folder (Hugging Face `datasets`; `split`/`val_split` pick a DatasetDict split,
        `columns` maps ajet fields query/answer/task_id to dataset columns);
    train: several datasets `[{name, path, weight}]` in one run (each GRPO group's task comes from one
        dataset, drawn by weight; `ajet serve` clients may ask for the dataset they serve);
    generator: `module:function` called as function(split="train"|"val", **generator_args), yielding tasks;
    env_service: {url, env_type}, the task ids the service lists.

    val_path: the validation set (same forms as train_path), never trained on: evaluated during the run
    (`trainer.val_freq`) to pick the checkpoint the run ends with (`trainer.keep_best`), and by `ajet eval`;
    with a generator or env service, the "val" split is asked for instead.
    test_path: the test set (same forms), never trained on and never used for a decision: evaluated before step 1
    and once at the end, on the run's final model (logged as test/*); `ajet eval --split test`.
    """

    train_path: str | None = Field(None, description="training tasks: a JSONL file (GSM8K rows or {task_id, query, "
                                                     "answer}), a json/csv/parquet/arrow file or a Hugging Face "
                                                     "`save_to_disk` folder; a relative path resolves against the "
                                                     "YAML file's folder, then the cwd")
    train: list[DatasetConfig] | None = Field(
        None, min_length=1, description="several training datasets `[{name, path, weight, max_tasks}]` in one run; "
                                        "each GRPO group's task comes from one of them, drawn by weight")
    val_path: str | None = Field(None, description="the validation set (the forms train_path takes), never trained "
                                                   "on: evaluated every trainer.val_freq steps to pick the run's "
                                                   "final model (trainer.keep_best); read by `ajet eval`")
    test_path: str | None = Field(None, description="the test set (the forms train_path takes), never trained on nor "
                                                    "used for a decision: evaluated before step 1 and once at the end "
                                                    "on the run's final model (test/*); `ajet eval --split test`")
    format: Literal["auto", "jsonl", "hf"] = Field(
        "auto", description="auto reads `.jsonl` files as JSONL and anything else through Hugging Face `datasets`; "
                            "jsonl or hf forces one reader")
    split: str = Field("train", description="the split of a Hugging Face DatasetDict that training reads")
    val_split: str | None = Field(None, description="the split that the validation set reads (None: `split`)")
    test_split: str | None = Field(None, description="the split that the test set reads (None: `split`)")
    columns: dict[str, str] = Field(default_factory=dict, description="ajet field (query, answer, task_id) -> column")
    generator: str | None = Field(None, description="`module:function`, called as function(split=\"train\"|\"val\", "
                                                    "**generator_args) and yielding tasks, e.g. "
                                                    "`ajet.tasks.generator:reasoning_gym_tasks`")
    generator_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments passed to the generator")
    env_service: EnvServiceSource | None = Field(
        None, description="an environment service over HTTP whose listed task ids are the tasks (AgentJet's "
                          "env-service shape)")
    shuffle: bool = Field(True, description="shuffle the training tasks each epoch (seeded by trainer.seed and the "
                                            "epoch); False keeps the file's order")
    max_tasks: int | None = Field(None, gt=0, description="read at most this many training tasks (None: all)")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        """At most one task source (none at all is refused by `AjetConfig` in the modes that read tasks)."""
        given = self.task_sources()
        if len(given) > 1:
            raise ValueError(f"{ONE_TASK_SOURCE} (got {', '.join(given)})")
        names = [d.name for d in self.train or []]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names in `data.train` must differ, got {names}")
        bad = sorted(set(self.columns) - {"query", "answer", "task_id"})
        if bad:
            raise ValueError(f"data.columns keys must be ajet fields query, answer, task_id; got {bad}")
        return self

    def task_sources(self) -> list[str]:
        """The task source keys set: `train_path`, `train`, `generator`, `env_service` (a valid config: at most one)."""
        return [k for k in ("train_path", "train", "generator", "env_service") if getattr(self, k)]

    def datasets(self) -> list[DatasetConfig]:
        """The training datasets: `train`, or one named "train" for the other sources (its `path` is
        `train_path`, or "" for a generator or env service)."""
        return self.train or [DatasetConfig(name="train", path=self.train_path or "", max_tasks=self.max_tasks)]
