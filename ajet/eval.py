"""Held-out evaluation: the config's workflow and judge on tasks that are never trained on.

    ajet eval --conf X.yaml [--checkpoint DIR | --model PATH] [--data PATH] [--n K] [--temperature T]

Each task runs `n` episodes through the same recording proxy as training (a second proxy over the same
engine, with the evaluation's sampling parameters), so what is measured is exactly what the agent does
during training. Nothing here is trained on. Reported (prefix `eval/`, or `val/` during training):

    reward_mean   mean episode reward
    pass@1        mean over tasks of c/n (c = episodes with reward >= eval.pass_threshold)
    pass@k        mean over tasks of the unbiased estimator 1 - C(n-c, k) / C(n, k), k = n
                  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1)
    <metric>      every workflow metric (WorkflowOutput.metrics), averaged over episodes
    failed        episodes that raised or timed out (they count as not passed, reward 0)
    failed_frac   failed / episodes
    failed/<kind> failed episodes by kind (`TimeoutError`, `RuntimeError`, ...: ajet/failures.py)
    valid         1, or 0 when failed_frac exceeds `eval.max_failed_frac`

and a per-task table `eval.jsonl` (one row per task) beside `eval_trajectories.jsonl` (every episode
with its recorded calls).

An evaluation that lost more than `eval.max_failed_frac` of its episodes (default 5%) is not a score: its
failures, not the policy, would set the figures. It is reported as invalid: `valid` 0, and the scores
(reward_mean, pass@1, pass@k, the workflow metrics) are left out of its metrics (`metrics.jsonl`'s `val/*`,
`eval_metrics.json`), so no plot or table shows them as a point; the console says why (counts by kind of
failure); `ajet eval` exits with status 1. The per-task table is written all the same.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ajet import progress
from ajet.config import AjetConfig
from ajet.episode import Episode
from ajet.failures import failure_counts, failure_lines, failure_summary
from ajet.heap import trim_free_memory
from ajet.llm_call import SamplingParams
from ajet.task import Task

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: the chance that at least one of k episodes drawn without replacement
    from n (c of them correct) is correct, `1 - C(n-c, k) / C(n, k)` (Chen et al. 2021, eq. 1), computed
    as the stable product `1 - prod_{i=n-c+1}^{n} (1 - k/i)`.

    Raises:
        ValueError: not 0 <= c <= n, or not 1 <= k <= n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_sampling(temperature: float, top_p: float, max_tokens: int) -> SamplingParams:
    """The sampling parameters of an evaluation: temperature 0 means greedy (argmax, as the engines
    decode it), else sampled from the nucleus `top_p`."""
    return SamplingParams(temperature=temperature, top_p=1.0 if temperature == 0 else top_p, max_tokens=max_tokens)


# the figures an invalid evaluation leaves out (besides every `workflow/*` metric)
SCORE_KEYS = ("reward_mean", "pass@1")


@dataclass
class EvalResult:
    """metrics: summary figures without prefix (reward_mean, pass@1, pass@<n>, failed, workflow metrics, valid;
    an invalid evaluation has no scores, see the module docstring); rows: one dict per task (the eval.jsonl
    table); episodes: every episode, grouped by task; valid: whether the failed share is within the bound;
    failures: the one-line summary of why episodes failed ("" when none did)."""

    metrics: dict[str, float]
    rows: list[dict[str, Any]]
    episodes: list[Episode]
    valid: bool = True
    failures: str = ""

    def invalid_reason(self, max_failed_frac: float) -> str:
        """What the console says of an invalid evaluation ("" for a valid one)."""
        if self.valid:
            return ""
        return (f"INVALID: {self.failures} ({self.metrics['failed_frac']:.0%} > eval.max_failed_frac "
                f"{max_failed_frac:.0%}); no score is reported for it")


def apply_validity(metrics: dict[str, float], episodes: list[Episode], max_failed_frac: float) -> bool:
    """Mark `metrics` (`summarize`'s) valid or not, in place: `valid` (1.0 / 0.0) and `failed/<kind>` counts;
    when more than `max_failed_frac` of `episodes` failed, the scores (`SCORE_KEYS`, `pass@<n>`, `workflow/*`)
    are removed. Returns whether it is valid."""
    valid = metrics["failed_frac"] <= max_failed_frac
    metrics.update({f"failed/{kind}": float(n) for kind, n in failure_counts(episodes).items()})
    metrics["valid"] = 1.0 if valid else 0.0
    if not valid:
        for k in [k for k in metrics if k in SCORE_KEYS or k.startswith(("pass@", "workflow/"))]:
            del metrics[k]
    return valid


def summarize(episodes: list[Episode], n: int, pass_threshold: float) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Summary metrics and the per-task table of `episodes` (`[tasks * n]`, grouped by task as `rollout`
    returns them). A failed episode counts as reward 0, not passed."""
    rows, by_task = [], [episodes[i:i + n] for i in range(0, len(episodes), n)]
    for eps in by_task:
        rewards = [e.reward if e.ok else 0.0 for e in eps]
        c = sum(1 for e, r in zip(eps, rewards) if e.ok and r >= pass_threshold)
        task = eps[0].task
        rows.append({"task_id": task.task_id, "query": task.query, "answer": task.answer, "n": n, "correct": c,
                     "pass@1": c / n, f"pass@{n}": pass_at_k(n, c, n), "reward_mean": statistics.fmean(rewards),
                     "rewards": rewards, "failed": sum(not e.ok for e in eps),
                     "final_answers": [e.output.final_answer if e.output else None for e in eps],
                     "metrics": _mean_metrics(eps)})
    metrics: dict[str, float] = {
        "tasks": float(len(rows)),
        "episodes": float(len(episodes)),
        "failed": float(sum(r["failed"] for r in rows)),
        "failed_frac": sum(r["failed"] for r in rows) / len(episodes) if episodes else 0.0,
        "reward_mean": statistics.fmean(r["reward_mean"] for r in rows),
        "pass@1": statistics.fmean(r["pass@1"] for r in rows),
    }
    if n > 1:
        metrics[f"pass@{n}"] = statistics.fmean(r[f"pass@{n}"] for r in rows)
    metrics.update({f"workflow/{k}": v for k, v in _mean_metrics(episodes).items()})
    return metrics, rows


def _mean_metrics(episodes: list[Episode]) -> dict[str, float]:
    ok = [e for e in episodes if e.ok and e.output]
    keys = sorted({k for e in ok for k in e.output.metrics})
    return {k: statistics.fmean(float(e.output.metrics[k]) for e in ok if k in e.output.metrics) for k in keys}


def evaluate(cfg: AjetConfig, engine, tokenizer, workflow, judge, tasks: list[Task], *, step: int = 0,
             on_episode_done: Callable[[Episode], None] | None = None, tools=None) -> EvalResult:
    """Run `cfg.eval.n` episodes of every task through a fresh recording proxy over `engine` and score them.

    The proxy gets the evaluation's sampling parameters (`cfg.eval`, sampling_policy "config": the
    workflow's own temperature is overridden, so before/after figures use the same sampling). `tools`: the
    run's MCP servers (`McpHub`), for workflows that call them.
    Returns an `EvalResult`, invalid (no scores) when more than `cfg.eval.max_failed_frac` of its episodes
    failed; never raises for a failing workflow (its episodes count as failed).
    """
    from ajet.proxy.server import ProxyServer
    from ajet.rollout.episodes import rollout

    e, r = cfg.eval, cfg.rollout
    proxy = ProxyServer(engine, tokenizer, eval_sampling(e.temperature, e.top_p, r.max_tokens), sampling_policy="config",
                        max_model_len=cfg.model.max_model_len, host=cfg.proxy.host,
                        max_body_bytes=cfg.proxy.max_body_bytes, accepted_models=cfg.proxy.accepted_models).start()
    try:
        with progress.phase(f"eval (step {step})" if step else "eval", len(tasks) * e.n) as bar:   # ajet/progress.py
            on_episode_done = progress.episode_counter(bar, e.pass_threshold, on_episode_done)
            episodes = asyncio.run(rollout(workflow, tasks, e.n, proxy, judge, step, r.max_concurrency,
                                           r.episode_timeout_s, on_episode_done=on_episode_done, tools=tools))
    finally:
        proxy.stop()
    metrics, rows = summarize(episodes, e.n, e.pass_threshold)
    valid = apply_validity(metrics, episodes, e.max_failed_frac)
    return EvalResult(metrics, rows, episodes, valid, failure_summary(episodes))


def write_result(result: EvalResult, out_dir: Path) -> None:
    """`out_dir/eval.jsonl` (per task), `eval_trajectories.jsonl` (per episode), `eval_metrics.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "eval.jsonl", "w", encoding="utf-8") as f:
        for row in result.rows:
            f.write(json.dumps(row) + "\n")
    with open(out_dir / "eval_trajectories.jsonl", "w", encoding="utf-8") as f:
        for ep in result.episodes:
            f.write(json.dumps(ep.to_dict()) + "\n")
    (out_dir / "eval_metrics.json").write_text(json.dumps(result.metrics, indent=2) + "\n")


class Validator:
    """Validation and the test set during training (ajet/best.py picks the final model by the validation).

    Validation (`trainer.val_freq` with `data.val_path`): at step 0, every `val_freq` steps and at the last step,
    `validator(step)` evaluates the current policy and returns `val/*` metrics (an empty dict when no validation is
    due). Episodes go to `exp_dir/val/step_<N>/`. The test set (`data.test_path`): `validator.test(step)` evaluates
    the current policy on it and returns `test/*` metrics (episodes in `exp_dir/test/step_<N>/`); the trainer calls
    it before step 1 and once at the end, on the run's final model. Each result is printed on `console` beside the
    first one of its set ("held-out at step 16 (vs step 0): pass@1 31.2% -> 45.0% (+13.8 points, 72/160) | ...",
    "test at step 8 (vs step 0): ..."); an invalid evaluation (see the module docstring) is said so on `alerts`, with each distinct error of
    its episodes, and its metrics carry `valid` 0 and no score.

    Raises:
        ConfigError: a task file cannot be read (a `trainer.val_freq` without a held-out task source is refused by
            the config's own check, ajet/config/experiment.py).
    """

    def __init__(self, cfg: AjetConfig, backbone, workflow=None, judge=None, tools=None, console=None, alerts=None):
        """`backbone`: the run's (it may be set later, before the first call: the tasks load first);
        `workflow`/`judge`: the training rollout's (None: loaded from the config when validation is on);
        `tools`: the run's MCP servers, if any; `console`: a rich console for the results; `alerts`: one for the
        invalid-evaluation line (default `console`)."""
        self.cfg, self.backbone, self.workflow, self.judge, self.tools = cfg, backbone, workflow, judge, tools
        self.console, self.alerts = console, alerts if alerts is not None else console
        # the first valid result of each set ("val", "test"): (step, metrics)
        self.firsts: dict[str, tuple[int, dict[str, float]]] = {}
        self.freq = cfg.trainer.val_freq
        self.tasks: list[Task] = []
        self.test_tasks: list[Task] = []
        if self.freq or cfg.data.test_path:
            from ajet.judges import load_judge
            from ajet.rollout.in_process import load_workflow
            from ajet.tasks import load_tasks

            self.tasks = load_tasks(cfg, "val") if self.freq else []
            self.test_tasks = load_tasks(cfg, "test") if cfg.data.test_path else []
            if self.workflow is None:
                self.workflow, self.judge = load_workflow(cfg), load_judge(cfg)

    @property
    def first(self) -> tuple[int, dict[str, float]] | None:
        """The first valid validation: (step, metrics), or None."""
        return self.firsts.get("val")

    def due(self, step: int) -> bool:
        """Whether a validation is due at `step` (step 0, every `trainer.val_freq` steps, the last step)."""
        return bool(self.freq) and (step % self.freq == 0 or step == self.cfg.trainer.total_steps)

    def __call__(self, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        return self._evaluate("val", self.tasks, step)

    def test(self, step: int) -> dict[str, float]:
        """The test set (`data.test_path`) on the current policy, the model of `step`: its `test/*` metrics (with
        `test/step`), written to `exp_dir/test/step_<step>/`; {} without a test set."""
        if not self.test_tasks:
            return {}
        return {**self._evaluate("test", self.test_tasks, step), "test/step": float(step)}

    def _evaluate(self, split: str, tasks: list[Task], step: int) -> dict[str, float]:
        """Evaluate `tasks` of `split` ("val" or "test") at `step`: written, printed, returned as `<split>/*`."""
        t0 = time.perf_counter()
        result = evaluate(self.cfg, self.backbone.engine, self.backbone.tokenizer, self.workflow, self.judge,
                          tasks, step=step, tools=self.tools)
        where = self.cfg.exp_path() / split / f"step_{step}"
        write_result(result, where)
        what = "held-out" if split == "val" else "test"
        if not result.valid and self.alerts is not None:
            self.alerts.print(f"[bold red]{what} evaluation at step {step} "
                              f"{result.invalid_reason(self.cfg.eval.max_failed_frac)}[/] (episodes: {where})")
            for line in failure_lines(result.episodes):
                self.alerts.print(f"  {line}", markup=False, highlight=False)
        elif result.valid and self.console is not None:
            first = self.firsts.setdefault(split, (step, result.metrics))
            progress.note(self.console, result_line(step, result.metrics, *first, what=what))
        metrics = {f"{split}/{k}": v for k, v in result.metrics.items()}
        metrics[f"{split}/time_s"] = time.perf_counter() - t0
        # the evaluation's freed KV and activations, kept by the engine thread's C heap otherwise (ajet/heap.py),
        # go back before the next rollout, update or checkpoint comes on top of them
        trim_free_memory()
        return metrics


# the tool calls per episode a workflow may report (WorkflowOutput.metrics: the tutorial's math agent both,
# ajet.tool_agent the valid ones), shown on an evaluation's console line as the docs write them
CALL_METRICS = {"valid": "workflow/valid_tool_calls", "grounded": "workflow/grounded_tool_calls"}


def calls_text(metrics: dict[str, float], before: dict[str, float] | None = None) -> str:
    """The workflow's valid / grounded tool calls per episode in `metrics` (`CALL_METRICS`, means over the episodes)
    as "valid / grounded calls 0.35 / 0.21", after those of `before` when it has them ("valid / grounded calls
    0.35 / 0.21 -> 0.97 / 0.94"); only the ones reported ("valid calls 0.35"); "" when the workflow reports none."""
    keys = {name: k for name, k in CALL_METRICS.items() if k in metrics}
    if not keys:
        return ""
    figures = " / ".join(f"{metrics[k]:.2f}" for k in keys.values())
    if before is not None and all(k in before for k in keys.values()):
        figures = " / ".join(f"{before[k]:.2f}" for k in keys.values()) + " -> " + figures
    return f"{' / '.join(keys)} calls {figures}"


def result_line(step: int, metrics: dict[str, float], first_step: int, first: dict[str, float],
                what: str = "held-out") -> str:
    """The console line of a valid evaluation of set `what` ("held-out": the validation set, "test") at `step`: its
    scores (pass@k in percent, reward_mean; `ajet.progress.fmt_score`), the workflow's valid / grounded tool calls
    per episode where it reports them (`calls_text`) and failed episodes, each figure beside the first evaluation's
    (`first`, at `first_step`) as "before -> after" once there is an earlier one, e.g. "held-out at step 16 (vs step
    0): pass@1 31.2% -> 45.0% (+13.8 points, 72/160) | reward_mean 0.400 -> 0.520 | valid / grounded calls
    0.35 / 0.21 -> 0.97 / 0.94 | failed 0/160"."""
    later = step != first_step or first is not metrics
    parts = []
    for k in sorted((k for k in metrics if k in SCORE_KEYS or k.startswith("pass@")), key=lambda k: k == "reward_mean"):
        parts.append(progress.fmt_score(k, metrics[k], first[k] if later and k in first else None, metrics["episodes"]))
    if calls := calls_text(metrics, first if later else None):
        parts.append(calls)
    parts.append(f"failed {metrics['failed']:.0f}/{metrics['episodes']:.0f}")
    return f"{what} at step {step}{f' (vs step {first_step})' if later else ''}: " + " | ".join(parts)
