"""`ajet eval`: evaluate a config's workflow and judge on held-out tasks (never trained on) with a model, a
checkpoint or the config's own model; the evaluation itself (pass@k, validity, the trainer's `Validator`) is
ajet/eval.py.

    ajet eval --conf X.yaml [--checkpoint DIR | --model M] [--data PATH] [--n K] [--temperature T] [--out DIR]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ajet import progress
from ajet.errors import ConfigError
from ajet.eval import evaluate, write_result
from ajet.failures import failure_lines


def _checkpoint_folder(path: str) -> tuple[str, str]:
    """The model `--checkpoint` names, as a `model.path` (a Hugging Face weights folder, or the initial model's path),
    and a line saying which it is: a `checkpoints/step_N` folder itself, or for an experiment folder the run's final
    model (ajet/best.py `final_model`: its best validated step, the initial model included, else its newest
    checkpoint).

    Raises:
        ConfigError: neither a checkpoint folder nor an experiment folder with a saved model.
    """
    from ajet.best import describe, final_model

    p = Path(path).expanduser()
    if any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin")):
        return str(p), f"--checkpoint {path}"
    if not p.is_dir() or not ((p / "checkpoints").is_dir() or (p / "best.json").is_file()):
        raise ConfigError(f"--checkpoint {path}: not a checkpoint folder (no *.safetensors weights) nor an experiment "
                          f"folder with checkpoints/step_N")
    model, best = final_model(p)
    if best is None:
        return model, f"--checkpoint {path}: its newest checkpoint, {Path(model).name}"
    return model, f"--checkpoint {path}: the run's final model, {describe(best)}"


def main(conf: str, checkpoint_dir: str | None = None, model: str | None = None, data: str | None = None,
         n: int | None = None, temperature: float | None = None, out: str | None = None,
         backbone: str | None = None, overrides: dict[str, Any] | None = None, split: str = "val") -> Path:
    """`ajet eval`: evaluate the config's workflow on held-out tasks; returns the output folder.

    The policy is the config's `model.path`, or `model` (any model path), or `checkpoint_dir`: a checkpoint
    folder, or an experiment folder (the run's final model: ajet/best.py `final_model`); `overrides` (the command
    line's `KEY=VALUE`s, dotted keys) change the config before the other arguments do. Tasks: `data`, else the `split` set: "val" (`data.val_path`, the validation set) or
    "test" (`data.test_path`). Output (default `<exp_dir>/eval/<model name>`):
    eval.jsonl, eval_trajectories.jsonl, eval_metrics.json; the summary is printed, and for an invalid
    evaluation (more than `eval.max_failed_frac` of the episodes failed) why, without scores (`valid` 0 in
    eval_metrics.json: the CLI then exits with status 1).

    Raises:
        ConfigError: both a checkpoint and a model, no task file, a bad checkpoint folder, bad config, a
            setting the backbone does not honour (`ajet.backbones.capabilities.check_supported`).
    """
    from rich.console import Console
    from rich.table import Table

    from ajet.backbones import load_backbone
    from ajet.backbones.capabilities import check_supported
    from ajet.config import load_config
    from ajet.judges import load_judge
    from ajet.rollout.in_process import load_workflow
    from ajet.tasks import load_tasks, task_source_name
    from ajet.tools.mcp_hub import McpHub

    if checkpoint_dir and model:
        raise ConfigError("give either --checkpoint or --model, not both")
    overrides = {**(overrides or {}), **{k: v for k, v in (("eval.n", n), ("eval.temperature", temperature),
                                                           ("backbone", backbone)) if v is not None}}
    which = None
    if checkpoint_dir:
        overrides["model.path"], which = _checkpoint_folder(checkpoint_dir)
    elif model:
        overrides["model.path"] = model
    cfg = load_config(conf, overrides, mode="eval")
    check_supported(cfg)   # a setting the backbone does not honour: refused before the tasks and model load
    if split == "test" and not (data or cfg.data.test_path):
        raise ConfigError(f"{conf}: no test tasks: pass --data PATH or set data.test_path")
    if split != "test" and not (data or cfg.data.val_path or cfg.data.generator or cfg.data.env_service):
        raise ConfigError(f"{conf}: no held-out tasks: pass --data PATH or set data.val_path")
    tasks = load_tasks(cfg, split, data)
    workflow = load_workflow(cfg)
    judge = load_judge(cfg)
    out_dir = Path(out) if out else cfg.exp_path() / "eval" / Path(cfg.model.path).name
    console = progress.unwrapped_when_piped(Console(highlight=False))
    progress.configure(console, cfg.trainer.progress, cfg.trainer.progress_interval_s)
    if which is not None:
        progress.note(console, which)
    progress.note(console, f"[bold]ajet eval[/] {cfg.experiment_name}: model={cfg.model.path} tasks={len(tasks)} "
                           f"n={cfg.eval.n} temperature={cfg.eval.temperature}{' (greedy)' if cfg.eval.temperature == 0 else ''}")
    bb = load_backbone(cfg.backbone)(cfg)
    tools = McpHub(cfg.tools, cfg.config_dir, out_dir).start() if cfg.tools.mcp_servers else None
    try:
        t0 = time.perf_counter()
        result = evaluate(cfg, bb.engine, bb.tokenizer, workflow, judge, tasks, tools=tools)
    finally:
        if tools is not None:
            tools.stop()
        bb.close()
    result.metrics["time_s"] = time.perf_counter() - t0
    write_result(result, out_dir)
    table = Table("metric", "value", title=f"eval on {data or task_source_name(cfg, split)}")
    for k, v in result.metrics.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) and not v.is_integer() else f"{v:g}")
    console.print(table)
    if not result.valid:
        console.print(f"[bold red]{result.invalid_reason(cfg.eval.max_failed_frac)}[/]")
        for line in failure_lines(result.episodes):
            console.print(f"  {line}", markup=False, highlight=False)
    console.print(f"per-task table: {out_dir / 'eval.jsonl'}")
    return out_dir
