"""Tasks from a Python callable: `data.generator: module:function` (or `file.py:function`).

    def my_tasks(split: str, **generator_args) -> Iterable[Task | dict]: ...

Each item is a `Task` or a row dict (`query`, `answer`, `task_id`, anything else -> metadata). The
callable is given the split ("train" or "val") so it can draw disjoint tasks for each; `reasoning_gym_tasks`
below does that for every reasoning-gym dataset, and `reasoning_gym_judge` scores with the dataset's own
`score_answer`.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from ajet.errors import ConfigError
from ajet.task import Task
from ajet.tasks.jsonl import row_to_task

# reasoning-gym seeds: the val split draws from a different seed than train, so the two never share a draw
_SPLIT_SEED_OFFSET = {"train": 0, "val": 1_000_003}


def read_generator_tasks(spec: str, split: str, args: dict[str, Any], base_dir: Path | None = None,
                         max_tasks: int | None = None) -> list[Task]:
    """Call the generator named by `spec` with `split` and `args`; at most `max_tasks` tasks.

    Raises:
        ConfigError: the callable yields something that is not a Task or a dict, or nothing at all.
        WorkflowLoadError: `spec` cannot be imported.
    """
    from ajet.importing import load_object

    fn = load_object(spec, base_dir, role="task generator")
    tasks = []
    for i, item in enumerate(itertools.islice(fn(split=split, **args), max_tasks)):
        if isinstance(item, Task):
            tasks.append(item)
        elif isinstance(item, dict):
            tasks.append(row_to_task(item, f"{split}-{i}", f"{spec} item {i}"))
        else:
            raise ConfigError(f"data.generator {spec} yielded a {type(item).__name__} (item {i}); yield Task or dict")
    if not tasks:
        raise ConfigError(f"data.generator {spec} yielded no tasks for split {split!r}")
    return tasks


def reasoning_gym_tasks(split: str, dataset: str, size: int = 1000, seed: int = 0, **config: Any):
    """Tasks of a reasoning-gym dataset (`pip install reasoning-gym`): query = its question, answer = its
    reference answer, metadata = {"rg_dataset", "rg_config", "entry": the full entry}. `config` goes to
    `reasoning_gym.create_dataset` (e.g. countdown's `min_numbers`). The val split uses another seed.

    Yields:
        `size` tasks with ids `<dataset>-<split>-<i>`.
    """
    import reasoning_gym

    ds = reasoning_gym.create_dataset(dataset, size=size, seed=seed + _SPLIT_SEED_OFFSET.get(split, 7), **config)
    for i in range(size):
        entry = ds[i]
        yield Task(f"{dataset}-{split}-{i}", entry["question"], str(entry["answer"]),
                   {"rg_dataset": dataset, "rg_config": config, "entry": _jsonable(entry)})


def reasoning_gym_judge(task: Task, output) -> float:
    """reasoning-gym's own scorer for the task's dataset (`score_answer(answer, entry)`, in [0, 1]);
    0.0 when the workflow gave no answer."""
    import reasoning_gym

    if not output.final_answer:
        return 0.0
    scorer = reasoning_gym.get_score_answer_fn(task.metadata["rg_dataset"])
    return float(scorer(output.final_answer, task.metadata["entry"]))


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)
