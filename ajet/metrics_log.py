"""Per-step outputs: `metrics.jsonl`, TensorBoard scalars, `trajectories.jsonl` and the console line."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class MetricsLogger:
    """Appends one JSON line per step to `exp_dir/metrics.jsonl` and mirrors scalars to TensorBoard.

    Args:
        exp_dir: the experiment folder (created if missing).
        tensorboard: also write TensorBoard event files under `exp_dir/tensorboard`.
        first_step: the step this attempt starts at; TensorBoard events of later steps, left by an
            interrupted attempt, are purged (the jsonl files are truncated by `checkpoint.truncate_jsonl`).
    """

    def __init__(self, exp_dir: Path, tensorboard: bool = True, first_step: int = 1):
        self.exp_dir = exp_dir
        exp_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(exp_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._trajectories = open(exp_dir / "trajectories.jsonl", "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(exp_dir / "tensorboard"), purge_step=first_step)
        self.console = Console(stderr=False, highlight=False)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    @contextlib.contextmanager
    def progress(self, label: str, total: int) -> Iterator[Callable[..., None]]:
        """A transient rich progress bar of `total` episodes; yields `advance(status=None)` to call per
        episode (`status`: a line shown after the bar, e.g. `ajet serve`'s clients and policy version)."""
        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("episodes"),
                       TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=self.console, transient=True)
        task = bar.add_task(label, total=total, status="")
        with bar:
            yield lambda status=None: bar.update(task, advance=1, **({} if status is None else {"status": status}))

    def write_episode(self, step: int, record: dict[str, Any]) -> None:
        self._trajectories.write(json.dumps({"step": step, **record}) + "\n")

    def flush(self) -> None:
        self._trajectories.flush()

    def close(self) -> None:
        self._metrics.close()
        self._trajectories.close()
        if self._tb is not None:
            self._tb.close()
