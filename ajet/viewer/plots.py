"""Pictures of a run, written to `EXP_DIR/plots/*.png` at the end of every run (matplotlib, headless `Agg`).

    reward.png          reward mean per step, its +-std band across the step's episodes, moving average
    workflow_<k>.png    each workflow metric per step (mean over episodes) with its moving average, and the
                        share of episodes where it is > 0 (e.g. `valid_tool_calls`: the valid-tool-call share)
    ratios.png          context-tracker token ratio (one sample per call / merged) and merge ratio (calls/sample)
    time.png            update time vs rollout time per step, seconds
    train.png           KL, clip fraction, entropy, grad norm per step (those the backbone logged)
    val.png             held-out evaluation (`trainer.val_freq`): val/pass@1 and val/reward_mean per evaluation; an
                        invalid one (`val/valid` 0: too many episodes failed) is a dashed line, never a point

Inputs are `metrics.jsonl` (one line per step) and, for the shares, `trajectories.sqlite` (read-only).
`python -m ajet.viewer.plots EXP_DIR` redraws them for any finished or running experiment. `trainer.plots: false`,
or the environment variable AJET_PLOTS=0 (which overrides the config either way: `plots_wanted`), leaves them out of
the run's end, e.g. in a test suite of many short runs.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any


PLOTS_ENV = "AJET_PLOTS"
_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def plots_wanted(configured: bool) -> bool:
    """Whether a run draws its plots at the end: $AJET_PLOTS when set (0/false/no/off or 1/true/yes/on, any case),
    else `configured` (`trainer.plots`).

    Raises:
        ConfigError: AJET_PLOTS holds another value.
    """
    raw = os.environ.get(PLOTS_ENV, "").strip().lower()
    if not raw:
        return configured
    if raw in _OFF + _ON:
        return raw in _ON
    from ajet.errors import ConfigError

    raise ConfigError(f"{PLOTS_ENV}={os.environ[PLOTS_ENV]!r}: use 0 (no plots at the end of a run) or 1 (plots), "
                      f"or unset it (trainer.plots decides)")


def moving_average(values: list[float], window: int = 3) -> list[float]:
    """Trailing mean over the last `window` finite values at each position ([n] -> [n]; NaN stays NaN)."""
    out = []
    for i, v in enumerate(values):
        recent = [x for x in values[max(0, i - window + 1):i + 1] if not math.isnan(x)]
        out.append(sum(recent) / len(recent) if recent and not math.isnan(v) else float("nan"))
    return out


def read_metrics(exp_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows, the newest line per step (a resumed run may repeat a step); torn lines skipped."""
    rows: dict[int, dict[str, Any]] = {}
    path = exp_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]


def _positive_share(exp_dir: Path, metric: str) -> dict[int, float]:
    """Per step, the share of successful episodes whose workflow metric `metric` is > 0 (from the store)."""
    db_path = exp_dir / "trajectories.sqlite"
    if not db_path.is_file():
        return {}
    db = sqlite3.connect(db_path.resolve().as_uri() + "?mode=ro", uri=True)   # as_uri needs an absolute path
    try:
        rows = db.execute("""SELECT step, AVG(json_extract(record, '$.output.metrics."' || ? || '"') > 0)
                             FROM episodes WHERE error IS NULL AND reward IS NOT NULL
                             AND attempt = (SELECT MAX(attempt) FROM episodes e2 WHERE e2.step = episodes.step)
                             GROUP BY step""", (metric,)).fetchall()
    except sqlite3.Error:
        return {}
    finally:
        db.close()
    return {int(s): float(v) for s, v in rows if v is not None}


def write_plots(exp_dir: str | Path, window: int = 3) -> list[Path]:
    """Draw every plot the run's metrics allow into `exp_dir/plots/`; returns the files written ([] when
    metrics.jsonl has no step yet).

    Raises:
        OSError: the plots folder cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")   # headless: no display needed, works on servers and in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    exp_dir = Path(exp_dir)
    rows = read_metrics(exp_dir)
    if not rows:
        return []
    out_dir = exp_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    try:
        name = json.loads((exp_dir / "config.json").read_text()).get("experiment_name") or exp_dir.name
    except (OSError, ValueError):
        name = exp_dir.name
    written: list[Path] = []

    def save(fig: Any, file: str) -> None:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
        fig.tight_layout()
        fig.savefig(out_dir / file, dpi=110)
        plt.close(fig)
        written.append(out_dir / file)

    def with_average(ax: Any, ys: list[float], label: str, color: str) -> None:
        ax.plot(steps, ys, "o-", color=color, alpha=0.45, lw=1, ms=3, label=label)
        ax.plot(steps, moving_average(ys, window), "-", color=color, lw=2.2, label=f"{label}, {window}-step average")

    # reward
    mean, std = _series(rows, "reward/mean"), _series(rows, "reward/std")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color="tab:blue",
                    alpha=0.12, label="± std over the step's episodes")
    with_average(ax, mean, "reward mean", "tab:blue")
    ax.set(xlabel="step", ylabel="reward", title=f"{name}: reward per step")
    ax.legend(fontsize=8)
    save(fig, "reward.png")

    # workflow metrics: the mean per step, and the share of episodes where the metric is > 0
    for key in sorted({k for r in rows for k in r if k.startswith("workflow/")}):
        metric = key.split("/", 1)[1]
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        with_average(ax, _series(rows, key), f"{metric} (mean per episode)", "tab:green")
        ax.set(xlabel="step", ylabel="mean per episode", title=f"{name}: workflow metric {metric}")
        share = _positive_share(exp_dir, metric)
        if share:
            right = ax.twinx()
            right.plot(steps, [share.get(s, float("nan")) for s in steps], "s--", color="tab:purple", ms=3,
                       label=f"share of episodes with {metric} > 0")
            right.set(ylim=(-0.03, 1.03), ylabel="share of episodes")
            right.legend(fontsize=8, loc="lower right")
        ax.legend(fontsize=8, loc="upper left")
        save(fig, f"workflow_{''.join(c if c.isalnum() or c in '-_' else '_' for c in metric)}.png")

    # context tracker ratios
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, _series(rows, "tracker/token_ratio"), "o-", label="token ratio (one sample per call / merged)")
    ax.plot(steps, _series(rows, "tracker/merge_ratio"), "s-", label="merge ratio (calls per sample)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="step", ylabel="x", title=f"{name}: what merging saves")
    ax.legend(fontsize=8)
    save(fig, "ratios.png")

    # time: rollout vs update
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    rollout, update = _series(rows, "time/rollout_s"), _series(rows, "train/update_s")
    ax.bar(steps, [0 if math.isnan(v) else v for v in rollout], label="rollout", color="tab:orange")
    ax.bar(steps, [0 if math.isnan(v) else v for v in update], bottom=[0 if math.isnan(v) else v for v in rollout],
           label="update", color="tab:blue")
    ax.set(xlabel="step", ylabel="seconds", title=f"{name}: update time vs rollout time")
    ax.legend(fontsize=8)
    save(fig, "time.png")

    # training statistics the backbone logged
    keys = [k for k in ("train/kl", "train/clip_frac", "train/entropy", "train/grad_norm") if any(k in r for r in rows)]
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.0), squeeze=False)
        for ax, key in zip(axes[0], keys):
            ax.plot(steps, _series(rows, key), "o-", ms=3)
            ax.set(xlabel="step", title=key)
        save(fig, "train.png")

    # held-out evaluation: one point per evaluation (step 0 = before training)
    val = [r for r in rows if "val/pass@1" in r]
    invalid = [r for r in rows if r.get("val/valid") == 0]     # no score: its failures would have set it
    if val or invalid:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for r in invalid:
            frac = r.get("val/failed_frac")
            ax.axvline(r["step"], color="tab:red", ls="--", lw=1,
                       label=f"step {r['step']}: invalid" + (f", {frac:.0%} of episodes failed" if frac is not None else ""))
        for key, marker in (("val/pass@1", "o-"), ("val/reward_mean", "s--")):
            ax.plot([r["step"] for r in val], _series(val, key), marker, label=key)
        for r in val:
            ax.annotate(f"{r['val/pass@1']:.1%}", (r["step"], r["val/pass@1"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
        ax.set(xlabel="step", ylabel="held-out", title=f"{name}: held-out evaluation")
        ax.legend(fontsize=8)
        save(fig, "val.png")
    return written


def write_plots_safely(exp_dir: str | Path, console: Any = None) -> list[Path]:
    """`write_plots`, for the end of a run: a plotting problem is printed, never raised (the run's results
    are already on disk)."""
    try:
        files = write_plots(exp_dir)
    except Exception as exc:  # noqa: BLE001 - pictures must never fail a finished run
        msg = f"plots not written ({type(exc).__name__}: {exc}); redraw with: python -m ajet.viewer.plots {exp_dir}"
        print(msg, file=sys.stderr) if console is None else console.print(msg)
        return []
    if files and console is not None:
        console.print(f"plots: {Path(exp_dir) / 'plots'} ({', '.join(f.name for f in files)})")
    return files


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ajet.viewer.plots EXP_DIR")
    print("\n".join(str(p) for p in write_plots(sys.argv[1])) or "no metrics.jsonl rows yet")
