"""`ajet.Job`: an experiment built from Python objects, trained from a script or a notebook without a YAML file.

    job = ajet.Job(MathAgentWorkflow, judge=math_agent_reward, tasks="tasks/train.jsonl",
                   model="smollm2-135m-instruct", rollout={"num_repeat": 8}, trainer={"total_steps": 16})
    result = job.run()            # in a notebook: result = await job.arun()
    result.exp_dir, result.steps[-1]["reward/mean"], result.held_out, result.checkpoint
    job.to_yaml("math.yaml")      # the same experiment for `ajet --conf math.yaml`

The keyword arguments are the YAML's keys (sections as dicts, or dotted: `**{"trainer.total_steps": 2}`), checked by
the same models with the same messages (`ajet.config.loading.config_from_mapping`). The workflow and judge are
objects (a `Workflow` subclass or an `async def fn(task, tuner)`; any `judge(task, output) -> float`) handed to the
one training loop as they are (`ajet.rollout.in_process.in_process_mode(workflow, judge)`); tasks given as Python
objects are written to `EXP_DIR/tasks/<split>.jsonl` when the run starts and read back by the CLI's own reader, so
the run, its `config.json` and `ajet eval --checkpoint EXP_DIR` see the same tasks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ajet.errors import ConfigError
from ajet.task import Task

if TYPE_CHECKING:
    from ajet.config import AjetConfig
    from ajet.rollout import RunMode
    from ajet.workflow import Workflow

SPLITS = {"train": "train_path", "val": "val_path", "test": "test_path"}
"""The task splits a `Job` takes as Python objects (`tasks`, `val_tasks`, `test_tasks`) and their `data` keys."""

_SOURCES = ("train_path", "train", "generator", "env_service")


@dataclass(frozen=True)
class JobResult:
    """What a finished run left, read from its experiment folder.

    Attributes:
        exp_dir: the experiment folder (metrics.jsonl, trajectories.sqlite, checkpoints/, plots/).
        steps: metrics.jsonl's row of each trained step (1..N), each a dict with "step" and the step's figures
            (`reward/mean`, `train/loss`, `val/*` on the steps that validated, ...).
        initial: the figures before step 1 (step 0: `val/*`, `test/*` of the initial model); {} without.
        held_out: the latest value of every `val/*` and `test/*` figure of the run (`test/*`: on the final model).
        checkpoint: the run's final model, a path `model.path` takes: the best validated checkpoint
            (`trainer.keep_best`), else the newest one (`ajet.best.final_model`); None when the folder has none.
    """

    exp_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    initial: dict[str, Any] = field(default_factory=dict)
    held_out: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None

    @classmethod
    def read(cls, exp_dir: str | Path) -> JobResult:
        """The result of the run in `exp_dir` (finished, or stopped: what it logged so far)."""
        from ajet.best import final_model

        exp_dir = Path(exp_dir)
        rows = []
        if (exp_dir / "metrics.jsonl").is_file():
            rows = [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        initial: dict[str, Any] = {}
        held_out: dict[str, Any] = {}
        for row in rows:
            if row.get("step") == 0:
                initial.update(row)
            held_out.update({k: v for k, v in row.items() if k.startswith(("val/", "test/"))})
        try:
            checkpoint = final_model(exp_dir)[0]
        except ConfigError:
            checkpoint = None
        return cls(exp_dir, [r for r in rows if r.get("step", 0) >= 1], initial, held_out, checkpoint)


class Job:
    """One experiment, built in Python: a workflow, a judge, tasks, the model and any config key.

    Args:
        workflow: a `Workflow` subclass (or instance), an `async def fn(task, tuner) -> WorkflowOutput`, or what
            the YAML's `workflow:` takes (`"file.py:Class"`, `{"command": [...]}`, `{"harness": NAME}`).
        judge: `judge(task, output) -> float` (sync or async; a class is built with the config, as `load_judge`
            does), or a `"module:function"` text; None: the workflow sets the reward.
        tasks: the training tasks: dicts (`{"query", "answer", "task_id"}` or GSM8K rows), `Task`s, a
            `datasets.Dataset`, or a task file's path (any form `data.train_path` takes).
        val_tasks: the validation set (`data.val_path`), in the same forms; with `trainer={"val_freq": N}`.
        test_tasks: the test set (`data.test_path`), in the same forms.
        model: the policy's path (`model.path`), or the `model` section as a dict.
        **settings: any other config key, as the YAML writes it: a section as a dict (`trainer={"total_steps":
            2}`), a top-level key (`experiment_name="x"`), or dotted (`**{"rollout.num_repeat": 4}`); merged
            into the sections, dotted keys last.

    Raises:
        ConfigError: an unknown key (with a "did you mean"), a bad value or a missing one, as `ajet --conf` says
            it for a YAML file (named `Job(...)`); no tasks, or two sources for one split; a task that is no
            task (the row's index named); a workflow that is neither a Workflow nor an async function.
        WorkflowLoadError: a workflow or judge given as text that cannot be imported.
        AjetError: the training dependencies are not installed (`pip install 'ajet[train]'`).
    """

    def __init__(self, workflow: Any = None, *, judge: Any = None, tasks: Any = None, val_tasks: Any = None,
                 test_tasks: Any = None, model: str | os.PathLike | Mapping[str, Any] | None = None,
                 **settings: Any) -> None:
        from ajet.config.loading import config_from_mapping

        _check_train_extra()
        overrides = _dotted(settings)
        self._workflow_obj = None if workflow is None or isinstance(workflow, (str, Mapping)) else workflow
        self._judge_obj = None if judge is None or isinstance(judge, str) else judge
        for key, value in (("workflow", workflow), ("judge", judge)):
            if value is not None:
                overrides[key] = value if isinstance(value, (str, Mapping)) else _spec_or_none(value)
        if isinstance(model, Mapping):
            overrides.update(_dotted({"model": model}))
        elif model is not None:
            overrides["model.path"] = os.fspath(model)
        self._rows: dict[str, list[dict[str, Any]]] = {}
        for split, given in (("train", tasks), ("val", val_tasks), ("test", test_tasks)):
            key = SPLITS[split]
            others = _SOURCES if split == "train" else (key,)
            if given is not None and (clash := [k for k in others if overrides.get(f"data.{k}") is not None]):
                label = "tasks" if split == "train" else f"{split}_tasks"
                raise ConfigError(f"Job(...): the {split} tasks are given twice, as {label}= and data.{clash[0]}; "
                                  f"keep one")
            if isinstance(given, (str, os.PathLike)):
                overrides[f"data.{key}"] = os.fspath(given)
            elif given is not None:
                self._rows[split] = _rows(given, split)
                overrides[f"data.{key}"] = f"tasks/{split}.jsonl"   # the run's own file, set below
        if "data" not in overrides and not any(overrides.get(f"data.{k}") is not None for k in _SOURCES):
            raise ConfigError("Job(...): no training tasks: pass tasks= (a list of dicts or Tasks, a datasets.Dataset, "
                              "or a task file's path), or data={...} naming a task source")
        cfg = config_from_mapping({}, "Job(...)", overrides, overrides_source=None)
        for split in self._rows:   # written into the experiment folder when the run starts (`_mode`)
            setattr(cfg.data, SPLITS[split], str(cfg.exp_path() / "tasks" / f"{split}.jsonl"))
        self.config: AjetConfig = cfg
        """The validated experiment (`ajet.config.AjetConfig`); what `run` trains and `to_yaml` writes."""
        self._workflow = self._make_workflow()
        self._judge = self._make_judge()

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> Job:
        """The experiment of a YAML file, with `overrides` (config keys: sections as dicts, dotted keys, as
        `Job(...)` takes them) applied as the CLI's KEY=VALUE overrides are (`ajet.config.load_config`).

        Raises:
            ConfigError: what `ajet --conf PATH KEY=VALUE ...` says of the file and the overrides.
            WorkflowLoadError: the file's workflow or judge cannot be imported.
            AjetError: the training dependencies are not installed (`pip install 'ajet[train]'`).
        """
        from ajet.config import load_config

        _check_train_extra()
        job = cls.__new__(cls)
        job._workflow_obj = job._judge_obj = None
        job._rows = {}
        job.config = load_config(path, _dotted(overrides), overrides_source="Job.from_yaml keywords")
        job._workflow, job._judge = job._make_workflow(), job._make_judge()
        return job

    def run(self) -> JobResult:
        """Train (`ajet.trainer.run`) and return the result. Called where an event loop runs already (a
        notebook's cell), the run goes to a worker thread and this call waits for it; no signal handler is
        installed either way (the `ajet` command's Ctrl-C handling is its own).

        Raises:
            AjetError: what `ajet --conf` stops with: a setting the backbone does not honour, an experiment folder
                that holds trained steps (set `trainer={"resume": True}` to continue it), a run whose episodes keep
                failing (its errors named).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._run()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ajet-job") as pool:
            return pool.submit(self._run).result()

    async def arun(self) -> JobResult:
        """`run` in a worker thread, awaited (`result = await job.arun()` in a notebook); the notebook's loop
        stays free meanwhile. Cancelling the await does not stop the run.

        Raises:
            AjetError: as `run`.
        """
        return await asyncio.to_thread(self._run)

    def to_yaml(self, path: str | os.PathLike) -> Path:
        """Write the experiment as a YAML config that `ajet --conf PATH` runs to the same result: the workflow and
        judge named by their files (`file.py:Name`, relative to PATH's folder) or modules, the tasks given as
        Python objects written beside it (`<stem>.train.jsonl`, ...). Only the keys that were set are written.

        Returns:
            the YAML file's path.

        Raises:
            ConfigError: the workflow or judge cannot be imported by path (defined in `__main__`, a script or a
                notebook; a lambda; defined inside a function): the message names each, and nothing is written; a
                job read from a YAML file (`from_yaml`) written into another folder (its relative paths would move).
        """
        import yaml

        from ajet.config import load_config

        path = Path(path)
        folder = Path(os.path.abspath(path)).parent
        read_from = self.config.config_dir
        if read_from is not None and folder.resolve() != read_from.resolve():
            raise ConfigError(f"Job.to_yaml: this job's config was read from {read_from}, whose relative paths resolve "
                              f"against that folder: write it there (or copy its files along)")
        data = self.config.model_dump(mode="json", by_alias=True, exclude_unset=True)
        refused = []
        for key, obj in (("workflow", self._workflow_obj), ("judge", self._judge_obj)):
            if obj is not None:
                try:
                    data[key] = import_spec(obj, folder)
                except ConfigError as exc:
                    refused.append(f"{key} {exc}")
        if refused:
            raise ConfigError(f"Job.to_yaml: {'; '.join(refused)}: a config names what it runs by an importable "
                              f"path; move it into a .py file and import it from there")
        folder.mkdir(parents=True, exist_ok=True)
        for split, rows in self._rows.items():
            tasks_file = path.with_name(f"{path.stem}.{split}.jsonl")
            _write_rows(tasks_file, rows)
            data.setdefault("data", {})[SPLITS[split]] = tasks_file.name
        path.write_text(f"# written by ajet.Job.to_yaml: ajet --conf {path.name}\n"
                        + yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        load_config(path)   # what the command will read: checked now
        return path

    def __repr__(self) -> str:
        c = self.config
        return (f"Job({c.experiment_name!r}, workflow={self._workflow or c.workflow!r}, model={c.model.path!r}, "
                f"steps={c.trainer.total_steps}, exp_dir={str(c.exp_path())!r})")

    # ---- internals ---------------------------------------------------------------------------------------------
    def _make_workflow(self) -> Workflow | None:
        """The workflow object handed to the run (None: the config's, loaded by the run as the CLI loads it)."""
        from ajet.rollout.in_process import make_workflow

        if self._workflow_obj is None:
            return None
        return make_workflow(self._workflow_obj, self.config, _name(self._workflow_obj))

    def _make_judge(self) -> Any:
        """The judge object handed to the run (a class built with the config, as `ajet.judges.load_judge` does)."""
        obj = self._judge_obj
        return obj(self.config) if isinstance(obj, type) else obj

    def _mode(self) -> RunMode:
        """`ajet --conf`'s run mode with this job's workflow and judge objects and its tasks' files."""
        from ajet.rollout.in_process import in_process_mode

        mode = in_process_mode(self._workflow, self._judge)
        read = mode.read_datasets

        def read_datasets(cfg: AjetConfig) -> Any:   # after the trainer's experiment-folder check
            for split, rows in self._rows.items():
                _write_rows(Path(getattr(cfg.data, SPLITS[split])), rows)
            return read(cfg)

        mode.read_datasets = read_datasets
        return mode

    def _run(self) -> JobResult:
        from ajet.trainer import run

        return JobResult.read(run(self.config, self._mode()))


def _check_train_extra() -> None:
    """Raise `AjetError` in one line when a package of the `train` extra is missing (`pip install ajet` is the
    client of `ajet serve` only), naming the few missing ones (all of them: none named), as the `ajet` command does."""
    import importlib.util

    from ajet.errors import AjetError
    from ajet.importing import EXTRAS

    missing = [m for m, extra in EXTRAS.items() if extra == "train" and importlib.util.find_spec(m) is None]
    if missing:
        raise AjetError("ajet.Job needs the training dependencies: pip install 'ajet[train]'"
                        + (f" (not installed: {', '.join(missing)})" if len(missing) <= 3 else ""))


def import_spec(obj: Any, base_dir: Path | None = None) -> str:
    """The `file.py:Name` or `module:Name` text that loads `obj` back (`ajet.importing.load_object`): its module's
    name when the module is installed (site-packages, ajet itself), else its file, relative to `base_dir` (None:
    absolute). A module-level instance is named by its global name.

    Raises:
        ConfigError: `obj` cannot be imported by path: defined in `__main__` (a script or a notebook), a lambda,
            defined inside a function, or not its module's attribute; the message names it.
    """
    fn = obj if hasattr(obj, "__qualname__") else type(obj)
    module_name = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", repr(obj))
    module = sys.modules.get(module_name or "")
    if "<lambda>" in name:
        raise ConfigError("<lambda> is a lambda, which cannot be imported by path")
    if "<locals>" in name:
        raise ConfigError(f"{name} is defined inside a function, which cannot be imported by path")
    if module_name == "__main__":
        raise ConfigError(f"{name} is defined in __main__ (a script or a notebook), which cannot be imported by path")
    if fn is not obj:   # an instance: the global its module binds it to
        name = next((k for k, v in vars(module).items() if v is obj), None) if module is not None else None
        if name is None:
            raise ConfigError(f"this {type(obj).__name__} instance is not a global of {module_name}: pass its class, "
                              f"or name it in its module")
    if module is None or "." in name or getattr(module, name, None) is not obj:
        raise ConfigError(f"{name} is not an attribute of its module {module_name}")
    file = getattr(module, "__file__", None)
    if file is None or not module_name.startswith("ajet_user_") and _installed(module_name, Path(file)):
        return f"{module_name}:{name}"
    path = os.path.abspath(file)   # (symbolic links kept: the path the user's files have)
    return f"{Path(os.path.relpath(path, base_dir)).as_posix() if base_dir is not None else path}:{name}"


def _installed(module_name: str, file: Path) -> bool:
    """Whether `module_name` is importable wherever ajet runs: in site-packages, or part of ajet itself."""
    return module_name.split(".")[0] == "ajet" or any(p in ("site-packages", "dist-packages") for p in file.parts)


def _spec_or_none(obj: Any) -> str | None:
    """`import_spec(obj)` (absolute) for the run's config.json, or None when `obj` cannot be imported by path."""
    try:
        return import_spec(obj)
    except ConfigError:
        return None


def _name(obj: Any) -> str:
    """How messages name an object given to `Job`: `module:qualname`."""
    fn = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(obj))}"


def _dotted(settings: Mapping[str, Any], prefix: str = "", model: Any = None) -> dict[str, Any]:
    """`settings` as {dotted key: value}: a dict given for a config section (`trainer={...}`) is spread into its
    keys (so it merges with the section's other keys, as a YAML's section does), any other value kept whole;
    keys with dots kept as they are, after the others."""
    from pydantic import BaseModel

    from ajet.config import AjetConfig

    model = model or AjetConfig
    out: dict[str, Any] = {}
    for key, value in settings.items():
        f = model.model_fields.get(key) or next((f for f in model.model_fields.values() if f.alias == key), None)
        sections = [] if f is None else [a for a in (f.annotation, *getattr(f.annotation, "__args__", ()))
                                         if isinstance(a, type) and issubclass(a, BaseModel)]
        if "." not in key and isinstance(value, Mapping) and len(sections) == 1 and value:
            out.update(_dotted(value, f"{prefix}{key}.", sections[0]))
        elif "." not in key:
            out[f"{prefix}{key}"] = dict(value) if isinstance(value, Mapping) else value
    out.update({f"{prefix}{k}": v for k, v in settings.items() if "." in k})
    return out


def _rows(tasks: Any, split: str) -> list[dict[str, Any]]:
    """The JSONL rows of tasks given as Python objects (dicts, `Task`s, a `datasets.Dataset`), each with its
    `task_id` (`<split>-<index>` when it has none), checked as the task file's reader checks a row.

    Raises:
        ConfigError: not a sequence of tasks (a DatasetDict: pick a split), a row that is no task, or a value
            JSON cannot hold; the row's index named.
    """
    from ajet.tasks.jsonl import row_to_task

    label = "tasks" if split == "train" else f"{split}_tasks"
    if isinstance(tasks, Mapping):
        raise ConfigError(f"Job(...): {label}= is a mapping (a DatasetDict?): give one split's tasks, e.g. "
                          f"{label}=ds[\"{split}\"]")
    if not isinstance(tasks, Iterable):
        raise ConfigError(f"Job(...): {label}= must be a list of dicts or Tasks, a datasets.Dataset or a task "
                          f"file's path, got {type(tasks).__name__}")
    rows = []
    for i, item in enumerate(tasks):
        if isinstance(item, Task):
            row = {**item.metadata, "task_id": item.task_id, "query": item.query}
            if item.answer is not None:
                row["answer"] = item.answer
        elif isinstance(item, Mapping):
            row = {"task_id": f"{split}-{i}", **item}
        else:
            raise ConfigError(f"Job(...): {label}[{i}] is a {type(item).__name__}, not a task (a dict with `query`, "
                              f"or a Task)")
        row_to_task(row, row["task_id"], f"Job(...): {label}[{i}]")
        try:
            json.dumps(row)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"Job(...): {label}[{i}]: {exc} (a task's fields must be JSON values)") from None
        rows.append(row)
    if not rows:
        raise ConfigError(f"Job(...): {label}= holds no task")
    return rows


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """`rows` as a JSONL task file at `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
