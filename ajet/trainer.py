"""The training loop, the only one: a rollout source yields finished episodes -> merge into samples ->
GRPO advantages -> backbone update -> ledger -> log -> checkpoint.

    rollout = mode.setup(ctx)                                 # the run mode's (ajet/rollout RunMode): in-process
    source = rollout.source                                   # workflow, `ajet serve`'s clients, the gateway's
                                                              # sessions, recorded samples (sft)
    for step in first_step..total_steps:
        episodes = source.collect(step)                       # complete GRPO groups, each committed to the store
        samples  = merge_calls(episode.calls) for each episode   # context tracker
        advantage per episode = adv_estimator over its task group  # shared by the episode's samples
        rollout.update.update(backbone, samples)                  # the engine serves the new weights
        store.mark_trained(step, attempt, episodes, left_out)     # the ledger: which update used which episode,
                                                                  # and why the others were left out
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ajet import checkpoint
from ajet.agent_adapters import role_metrics
from ajet.algorithm.guards import (NON_FINITE_LOGPROB, OUT_OF_VOCAB, STALE_POLICY, empty_loss_samples, policy_lag,
                                   sampled_token_reason, stale_policy_reason)
from ajet.algorithm.sampling import zero_std_groups
from ajet.config import AjetConfig
from ajet.episode import Episode
from ajet.errors import AjetError
from ajet.failures import failure_counts, failure_lines, failure_message, failure_summary
from ajet.faults import kill_point
from ajet.llm_call import SamplingParams
from ajet.progress import RunEta, fmt_duration
from ajet.run_folder import check_exp_dir
from ajet.tracker.context_tracker import fork_reasons
from ajet.tracker.sample import Sample

if TYPE_CHECKING:
    from ajet.best import BestTracker
    from ajet.metrics_log import MetricsLogger
    from ajet.proxy.server import ProxyServer
    from ajet.rollout import Rollout, RolloutSource, RunMode
    from ajet.tools.mcp_hub import McpHub
    from ajet.trajectory_store import TrajectoryStore


def run(cfg: AjetConfig, mode: RunMode | None = None) -> Path:
    """Train as `cfg` says; returns the experiment folder (metrics.jsonl, trajectories.jsonl,
    trajectories.sqlite, checkpoints/). With `trainer.resume`, continues from the newest checkpoint.

    Args:
        cfg: the experiment.
        mode: what the command trains with (`ajet.rollout.RunMode`: datasets, rollout source, update policy, what
            follows the last step, port); default `ajet.rollout.in_process.in_process_mode()`.

    Raises:
        ConfigError: a setting `cfg.backbone` does not honour (`ajet.backbones.capabilities.check_supported`),
            before anything runs; the experiment folder holds trained steps and `trainer.resume` is off (a run
            there that trained nothing is moved aside instead: `ajet.run_folder.check_exp_dir`).
        AjetError subclasses for config, workflow-loading or backbone problems (before anything is written into
        a new experiment folder); AjetError when `trainer.max_failed_steps` steps in a row produce no usable
        episode, when no step of the run had one (nothing trained, no checkpoint), and when the held-out
        evaluation before step 1 is invalid (unless `trainer.stop_on_invalid_eval` is false).
    """
    import torch

    from ajet.backbones import load_backbone
    from ajet.backbones.capabilities import check_supported
    from ajet.best import BestTracker, keeps_best
    from ajet.eval import Validator
    from ajet.metrics_log import alert_console
    from ajet.progress import note, quiet
    from ajet.rollout import RolloutContext
    from ajet.rollout.in_process import in_process_mode
    from ajet.trajectory_store import TrajectoryStore
    from ajet.viewer.plots import plots_wanted

    mode = mode or in_process_mode()
    check_supported(cfg)   # a setting the backbone does not honour: refused before anything runs or is written
    plots = plots_wanted(cfg.trainer.plots)   # (a bad AJET_PLOTS is refused now, not at the run's end)
    exp_dir = cfg.exp_path()
    # a folder with trained steps needs --resume; one whose run trained nothing is moved aside (ajet/run_folder.py)
    moved_aside = check_exp_dir(exp_dir, cfg.trainer.resume, mode.server)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    datasets = mode.read_datasets(cfg)
    backbone_cls = load_backbone(cfg.backbone)

    resume_from, state, resumed_step = _resume_point(cfg, exp_dir)
    first_step, total = resumed_step + 1, cfg.trainer.total_steps
    # nothing is written into a new experiment folder before the run can start (workflow, judge, held-out tasks
    # and model loaded): a mistake leaves no run behind that the corrected command would need --resume for
    store_path = exp_dir / "trajectories.sqlite"
    store = TrajectoryStore(store_path) if store_path.exists() else None   # (only a resumed run has one)
    attempt = store.begin_attempt(resumed_step) if store is not None else 0   # a new store's first attempt is 0
    console = _console(cfg)
    if moved_aside:
        note(console, moved_aside)
    progress: list[Callable[..., None]] = [lambda status=None: None]
    collecting = [first_step]                     # the step whose progress bar is shown
    rollout: Rollout | None = None

    def record(step: int, ep: Episode) -> None:   # every finished episode: durable before training uses it
        store.add_episode(step, ep.attempt, ep.to_dict())
        kill_point("rollout", step)
        if step == collecting[0]:                 # (asynchronous training also finishes later steps' episodes)
            progress[0](rollout.live_status(ep) if rollout.live_status is not None else "")

    ctx = RolloutContext(cfg, datasets, store, attempt, first_step, record, console)
    try:
        rollout = mode.setup(ctx)   # loads the workflow: fails before the model
        source = rollout.source
        # held-out val/* at step 0 and every trainer.val_freq steps (never trained on): its tasks load now
        validate = Validator(cfg, None, rollout.workflow, rollout.judge, None, console, alerts=alert_console(console))
        if state is not None:
            source.load_state_dict(state["rollout"])
            random.setstate(state["python_rng"])
            torch.set_rng_state(state["torch_rng"])
        note(console, _start_line(cfg, datasets, exp_dir))
        t_load = time.perf_counter()
        backbone = backbone_cls(cfg)
    except BaseException:
        for closing in ((rollout.source.close,) if rollout else ()) + ((store.close,) if store is not None else ()):
            closing()
        raise
    store, log = _open_run(cfg, exp_dir, store, attempt, resume_from, first_step, console, source, backbone)
    ctx.store, validate.backbone = store, backbone
    proxy = _proxy(cfg, backbone, mode.port)
    rollout.update.attach(backbone)   # before the proxy serves (the gateway's gate checkpoints and rolls back)
    source.bind(proxy)
    proxy.start()
    note(console, f"model loaded in {time.perf_counter() - t_load:.1f}s; proxy on {proxy.url}")
    if mode.server and quiet():   # a server's address is not a status line: printed even with --quiet
        console.print(f"proxy on {proxy.url}", markup=False, highlight=False)
    failed_in_a_row, trained_steps = 0, 0
    alerts = alert_console(console)   # failure lines print even without the console logger
    seen_errors: set[tuple[str, str]] = set()   # each distinct error is spelt out once per run
    # the run's final model: the best validated step (trainer.keep_best; ajet/best.py), else the last step's
    best = BestTracker(exp_dir, cfg.trainer.best_metric, cfg.trainer.best_mode, cfg.model.path, keeps_best(cfg))
    last_row: dict[str, Any] | None = None   # the last step's metrics, logged with the final model's test figures
    try:
        ctx.tools = validate.tools = _start_tools(cfg, exp_dir, console)   # stopped by _close_run
        first = (_first_validation(cfg, validate, log, exp_dir, best)
                 if first_step == 1 and cfg.trainer.val_before_train else {})
        eta = _run_eta(cfg, validate, first_step, first)   # the run's time left, on each step line
        for step in range(first_step, total + 1):
            t0, gen0 = time.perf_counter(), _generated(backbone)
            collecting[0] = step
            episodes = _collect(cfg, step, source, backbone, progress)
            kill_point("stored", step)
            rollout_s = time.perf_counter() - t0
            usable = _usable(cfg, step, episodes, alerts, seen_errors, exp_dir)
            backbone.engine.raise_if_failed()   # a vLLM server that died stops the run here, in one line naming its log
            failed_in_a_row = 0 if usable else failed_in_a_row + 1
            trained_steps += bool(usable)
            if failed_in_a_row >= cfg.trainer.max_failed_steps:
                raise AjetError(_no_usable_episode(f"{failed_in_a_row} steps in a row produced no usable episode "
                                                   f"(trainer.max_failed_steps): the run stops", episodes, cfg, exp_dir))
            trained = _train_step(cfg, step, attempt, episodes, usable, backbone, store, rollout)
            metrics = {**_step_metrics(episodes, rollout_s, _generated(backbone) - gen0), **trained,
                       **source.metrics(), "time/step_s": time.perf_counter() - t0,
                       "policy_version": backbone.engine.policy_version, **(val := validate(step))}
            new_best = best.observe(step, val)   # a ConfigError when trainer.best_metric is not among val/*
            if step < total or not trained_steps:
                _log_step(cfg, step, metrics, episodes, log)
            else:   # logged after the run's final model is tested (below)
                last_row = metrics
            extra = rollout.step_line(metrics) if rollout.step_line is not None else ""
            console.print(_console_line(step, total, metrics, eta.step_done(step, _evaluations(eta, val)), extra))
            if step == total and not trained_steps:   # it ends because its episodes fail: an error, no checkpoint
                n = total - first_step + 1
                raise AjetError(_no_usable_episode(f"the run trained nothing: no episode of its {n} step"
                                                   f"{'s' * (n != 1)} was usable", episodes, cfg, exp_dir))
            if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or step == total or new_best:
                _save(exp_dir, step, attempt, backbone, source)
            if new_best:
                best.keep()   # after its checkpoint: best.json never names a folder not written yet
        final_test = _final_model_test(cfg, best, validate, backbone, exp_dir, total)
        if last_row is not None:
            _log_step(cfg, total, {**last_row, **final_test}, episodes, log)
        elif final_test and first_step > total:   # resumed after the last checkpoint: its row died with the run
            log.log(total, final_test)
        rollout.after_training()
    finally:
        _close_run(exp_dir, console, source, ctx.tools, proxy, backbone, store, log, plots)
    if best.enabled or validate.test_tasks:   # the run's last line: the model it ends with, and its step
        first_test = _test_figures(exp_dir, 0) or validate.firsts.get("test")   # (also in a resumed run)
        console.print(_final_line(best, total, final_test, first_test), markup=False, highlight=False)
    return exp_dir


def _console(cfg: AjetConfig) -> Any:
    """The run's rich console (`trainer.loggers`), with the progress display configured on it (ajet/progress.py)."""
    from ajet.metrics_log import run_console
    from ajet.progress import configure

    console = run_console(cfg.trainer.active_loggers())
    configure(console, cfg.trainer.progress, cfg.trainer.progress_interval_s)
    return console


def _start_line(cfg: AjetConfig, datasets: dict[str, list[Any]], exp_dir: Path) -> str:
    """The run's first status line: experiment, backbone, model, the datasets' sizes (when the mode has any), folder."""
    tasks = f" tasks={' + '.join(f'{len(t)} ({n})' for n, t in datasets.items())}" if datasets else ""
    return f"[bold]ajet[/] {cfg.experiment_name}: backbone={cfg.backbone} model={cfg.model.path}{tasks} -> {exp_dir}"


def _start_tools(cfg: AjetConfig, exp_dir: Path, console: Any) -> McpHub | None:
    """The run's MCP servers (`tools.mcp_servers`), started, their tools named on `console`; None without any."""
    from ajet.progress import note
    from ajet.tools.mcp_hub import McpHub

    if not cfg.tools.mcp_servers:
        return None
    hub = McpHub(cfg.tools, cfg.config_dir, exp_dir).start()
    note(console, f"MCP tools: {', '.join(t['function']['name'] for t in hub.schemas)}")
    return hub


def _collect(cfg: AjetConfig, step: int, source: RolloutSource, backbone: Any,
             progress: list[Callable[..., None]]) -> list[Episode]:
    """`source.collect(step)` under the step's progress bar: `progress[0](status)`, called by the trainer's `record`
    for each finished episode of the step, advances it (with the tokens generated since the step began)."""
    from ajet.progress import phase

    total, gen0 = cfg.trainer.total_steps, _generated(backbone)
    with phase(f"step {step}/{total} rollout", cfg.trainer.tasks_per_step * cfg.rollout.num_repeat) as bar:
        progress[0] = lambda status=None: bar.advance(1, status=status, tokens=_generated(backbone) - gen0)
        episodes = source.collect(step)
        progress[0] = lambda status=None: None
    return episodes


def _save(exp_dir: Path, step: int, attempt: int, backbone: Any, source: RolloutSource) -> None:
    """The checkpoint after `step` (ajet/checkpoint.py): the backbone's weights and the trainer state (step, attempt,
    the source's state, the Python and torch random states)."""
    import torch

    checkpoint.save(exp_dir, step, backbone, {
        "step": step, "attempt": attempt, "rollout": source.state_dict(step),
        "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()})


def _resume_point(cfg: AjetConfig, exp_dir: Path) -> tuple[Path | None, dict[str, Any] | None, int]:
    """(the checkpoint to resume from, its trainer state, its step); (None, None, 0) without `trainer.resume` or
    before a first checkpoint. A resumed run continues after that checkpoint (or from scratch when the run died
    before its first); what the interrupted attempt logged after it is dropped, what it stored stays, marked
    abandoned by the new attempt's `resumed_from_step`."""
    resume_from = checkpoint.latest(exp_dir) if cfg.trainer.resume else None
    state = checkpoint.load_trainer_state(resume_from) if resume_from is not None else None
    return resume_from, state, state["step"] if state else 0


def _generated(backbone: Any) -> int:
    """Tokens the backbone's engine generated so far (0 for an engine that does not count them)."""
    return getattr(backbone.engine, "generated_tokens", 0)


def _first_validation(cfg: AjetConfig, validate: Any, log: MetricsLogger, exp_dir: Path,
                      best: BestTracker) -> dict[str, float]:
    """The evaluations before step 1, logged at step 0: the validation set (when validation is on; the initial
    policy is the final model's first candidate, `best`) and the test set (`data.test_path`). Returns their
    `val/*` and `test/*` metrics ({} without either).

    Raises:
        AjetError: the validation is invalid (too many failed episodes) and `trainer.stop_on_invalid_eval` is set.
        ConfigError: `trainer.best_metric` is not among the validation's metrics (ajet/best.py `score`).
    """
    val = validate(0)
    if val and not val.get("val/valid", 1.0) and cfg.trainer.stop_on_invalid_eval:
        log.log(0, val)
        raise AjetError(f"the held-out evaluation before step 1 is invalid (above): its failures, not the "
                        f"policy, would set every later score. Fix what the episodes fail on (each is in "
                        f"{exp_dir / 'val' / 'step_0'}), raise eval.max_failed_frac, or set "
                        f"trainer.stop_on_invalid_eval: false to train on")
    if best.observe(0, val):
        best.keep()   # the initial model: no checkpoint to write
    if first := {**val, **validate.test(0)}:
        log.log(0, first)
    return first


def _run_eta(cfg: AjetConfig, validate: Any, first_step: int, first: dict[str, float]) -> RunEta:
    """The run's time left (`ajet.progress.RunEta`) from `first_step` on: the validations due in the steps to run
    and the test set's evaluation after the last step, estimated from the evaluations before step 1 (`first`,
    `_first_validation`'s metrics) until a later one is measured."""
    n, total = cfg.eval.n, cfg.trainer.total_steps
    evals = {s: len(validate.tasks) * n for s in range(first_step, total + 1) if validate.due(s)}
    eta = RunEta(total, window=max(5, cfg.trainer.val_freq), evals=evals, after=len(validate.test_tasks) * n)
    _evaluations(eta, first)
    return eta


def _evaluations(eta: RunEta, metrics: dict[str, float]) -> float:
    """Give `eta` each evaluation of `metrics` (`val/*`, `test/*`: its `time_s` and `episodes`); returns their
    seconds in all (0.0 without any)."""
    seconds = 0.0
    for split in ("val", "test"):
        if f"{split}/time_s" in metrics and f"{split}/episodes" in metrics:
            eta.evaluated(metrics[f"{split}/time_s"], metrics[f"{split}/episodes"])
            seconds += metrics[f"{split}/time_s"]
    return seconds


def _final_model_test(cfg: AjetConfig, best: BestTracker, validate: Any, backbone: Any, exp_dir: Path,
                      total: int) -> dict[str, float]:
    """The test set (`data.test_path`) on the run's final model, after the last step's checkpoint is written: the
    best validated step's weights (`trainer.keep_best`; loaded from its checkpoint when it is not the last step),
    else the last step's. Returns its `test/*` figures (`test/step`: the model's step; {} without a test set). The
    initial model (best at step 0) is not evaluated again: its figures are the test set's at step 0
    (`exp_dir/test/step_0/eval_metrics.json`; {} when the run has none)."""
    if not validate.test_tasks:
        return {}
    b = best.best
    if b is None or b.step == total:
        return validate.test(total)
    if b.step == 0:
        first = _test_figures(exp_dir, 0)
        return {**{f"test/{k}": v for k, v in first[1].items()}, "test/step": 0.0} if first else {}
    backbone.load_checkpoint(exp_dir / b.checkpoint)   # the best's weights (the last step's stay on disk)
    return validate.test(b.step)


def _test_figures(exp_dir: Path, step: int) -> tuple[int, dict[str, float]] | None:
    """(step, the test set's figures at `step`) from `exp_dir/test/step_<step>/eval_metrics.json`; None without it."""
    import json

    try:
        return step, json.loads((exp_dir / "test" / f"step_{step}" / "eval_metrics.json").read_text())
    except (OSError, ValueError):
        return None


def _final_line(best: BestTracker, total: int, test: dict[str, float],
                first_test: tuple[int, dict[str, float]] | None = None) -> str:
    """The run's last line: the model it ends with (`ajet eval --checkpoint EXP_DIR` evaluates the same), why, and
    its test pass@1 when there is a test set, beside the test set's first figure (`first_test`: (step, metrics) of
    the run's first valid test evaluation), e.g. "final model: step 8 (checkpoints/step_8), the best val/pass@1 51.6%
    (max of the validations) | test pass@1 31.2% -> 45.0% (+13.8 points, 72/160; step 0 -> step 8)"."""
    from ajet.progress import fmt_score

    b = best.best
    if b is None:
        why = ("trainer.keep_best is off" if not best.enabled else
               f"no valid validation gave {best.metric}")
        line = f"final model: step {total} (checkpoints/step_{total}), the last step ({why})"
    else:
        line = (f"final model: {b.name()}, the best val/{fmt_score(b.metric[len('val/'):], b.value)} ({b.mode} of "
                f"the validations"
                f"{'' if b.step else '; no step beat the initial model: no checkpoint is needed'})")
    if "test/pass@1" in test:
        step, episodes = int(test["test/step"]), test.get("test/episodes")
        before = first_test if first_test is not None and first_test[0] != step and "pass@1" in first_test[1] else None
        score = fmt_score("pass@1", test["test/pass@1"], before[1]["pass@1"] if before else None, episodes)
        line += f" | test {score[:-1]}; step {before[0]} -> step {step})" if before and score.endswith(")") else \
            f" | test {score} (step {step})"
    elif test:
        line += " | test evaluation INVALID (no score)"
    return line


def _log_step(cfg: AjetConfig, step: int, metrics: dict[str, Any], episodes: list[Episode],
              log: MetricsLogger) -> None:
    """A finished step's `metrics` into metrics.jsonl (and the loggers), its episodes into trajectories.jsonl
    (`trainer.save_trajectories`)."""
    log.log(step, metrics)
    if cfg.trainer.save_trajectories:
        for e in episodes:
            log.write_episode(step, e.to_dict())
        log.flush()


def _close_run(exp_dir: Path, console: Any, source: RolloutSource, tools: Any, proxy: ProxyServer, backbone: Any,
               store: TrajectoryStore, log: MetricsLogger, plots: bool) -> None:
    """Close what a started run holds, in order (source, MCP servers, proxy, backbone, store, logger, live
    display), then, with `plots`, write EXP_DIR/plots/*.png (also after a failed run; not after Ctrl-C or SIGTERM,
    which ends the process promptly: the next run's end, or `python -m ajet.viewer.plots EXP_DIR`, draws them)."""
    from ajet.interrupt import stopping
    from ajet.progress import quiet, reset
    from ajet.viewer.plots import write_plots_safely

    source.close()
    if tools is not None:
        tools.stop()
    proxy.stop()
    backbone.close()
    store.close()
    log.close()
    reset()   # a phase an error left open stops its live display; code after the run draws on no old console
    if plots and not stopping():
        write_plots_safely(exp_dir, None if quiet() else console)


def _open_run(cfg: AjetConfig, exp_dir: Path, store: TrajectoryStore | None, attempt: int,
              resume_from: Path | None, first_step: int, console: Any, source: RolloutSource,
              backbone: Any) -> tuple[TrajectoryStore, MetricsLogger]:
    """The run can start: its folder, trajectory store (a new one begins its first attempt), metrics logger and
    config.json; on resume, the logs truncated to the checkpoint's step, the backbone loaded from it and a line
    saying so. On any error the source, backbone, store and logger are closed before it propagates.

    Returns:
        (the trajectory store, the metrics logger).
    """
    from ajet.metrics_log import MetricsLogger
    from ajet.progress import note
    from ajet.trajectory_store import TrajectoryStore

    log: MetricsLogger | None = None
    resumed_step = first_step - 1
    try:
        exp_dir.mkdir(parents=True, exist_ok=True)
        if store is None:
            store = TrajectoryStore(exp_dir / "trajectories.sqlite")
            store.begin_attempt(resumed_step)
        if cfg.trainer.resume:   # before the logger opens them: it appends to whatever file is there
            for name in ("metrics.jsonl", "trajectories.jsonl"):
                checkpoint.truncate_jsonl(exp_dir / name, resumed_step or -1)   # from the start: step 0 runs again
        log = MetricsLogger(exp_dir, first_step=first_step, loggers=cfg.trainer.active_loggers(), run_config=cfg,
                            console=console)
        (exp_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        if resume_from is not None:
            backbone.load_checkpoint(resume_from)
    except BaseException:
        for closing in (source.close, backbone.close, *((store.close,) if store is not None else ()),
                        *((log.close,) if log is not None else ())):
            closing()
        raise
    if cfg.trainer.resume:
        note(console, f"resumed from {resume_from or 'the start (no checkpoint yet)'} (attempt {attempt}); "
                      f"next step {first_step}")
    return store, log


def _proxy(cfg: AjetConfig, backbone: Any, port: int) -> ProxyServer:
    """The run's recording proxy over `backbone`'s engine (created, not started), on `port` (0: a free one)."""
    from ajet.proxy.server import ProxyServer

    r = cfg.rollout
    proxy = ProxyServer(backbone.engine, backbone.tokenizer,
                        SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens),
                        sampling_policy=r.sampling_policy, max_model_len=cfg.model.max_model_len,
                        host=cfg.proxy.host, max_body_bytes=cfg.proxy.max_body_bytes,
                        accepted_models=cfg.proxy.accepted_models, retry_after_s=cfg.proxy.retry_after_s,
                        seed=cfg.trainer.seed)
    proxy.port = port
    return proxy


def _usable(cfg: AjetConfig, step: int, episodes: list[Episode], alerts: Any, seen_errors: set[tuple[str, str]],
            exp_dir: Path) -> list[Episode]:
    """The step's episodes the update may use (`_trainable`); says on `alerts` why most of the step was lost,
    and spells out each error not seen before in the run (`seen_errors`, updated)."""
    usable = _trainable(episodes, cfg.rollout.failed_episode_policy)
    if lost := failure_summary(episodes, more_than=0.5):    # most of the step lost: say why
        alerts.print(f"[bold red]step {step}: {lost}[/] (every error is in {exp_dir / 'trajectories.sqlite'})")
    for line in failure_lines(episodes, seen_errors):      # a new error: its message and the user's frame
        alerts.print(f"  {line}", markup=False, highlight=False)
    return usable


def _train_step(cfg: AjetConfig, step: int, attempt: int, episodes: list[Episode], usable: list[Episode],
                backbone: Any, store: TrajectoryStore, rollout: Rollout) -> dict[str, Any]:
    """One step's update from its `usable` episodes: guards, samples merged from the calls (an episode that came
    with samples keeps them), advantages, the update through `rollout.update`, the ledger, `source.step_done`.

    Returns:
        the step's guards/*, async/*, tool, train/* and trained-episode figures.
    """
    from ajet.algorithm.advantage import assign_advantages
    from ajet.tools.episode_tools import tool_metrics
    from ajet.tracker import merge_calls

    a = cfg.algorithm
    # recorded samples (sft) carry another run's policy versions: no staleness bound applies to them
    max_staleness = cfg.trainer.async_.max_staleness if rollout.staleness_bound else None
    guarded, guard_metrics = _guard(usable, len(backbone.tokenizer), backbone.engine.policy_version, max_staleness)
    for e in usable:
        # a guarded episode's ids may not even decode: no samples; recorded samples (sft) train as stored
        if id(e) not in guarded and not e.samples:
            # with an adapter per role (`agents:`) each role's samples form their own GRPO groups
            e.samples = merge_calls(e.calls, e.group_id, a.group_by_agent_tag or bool(cfg.agents),
                                    a.train_greedy_calls)
    trainable = [e for e in usable if e.not_trained is None]   # minus zero-std groups and guarded episodes
    samples = _trained_samples(trainable, a.trainable_targets)
    # asynchronous training: a sample with a token older than max_staleness versions is never trained
    # (stale_policy "flag": they are trained, importance-corrected, and only counted by the guard)
    samples, staleness = _drop_stale(samples, backbone.engine.policy_version,
                                     max_staleness if a.guards.stale_policy == "drop" else None)
    # every usable episode is in its group's baseline, with or without a trained sample
    assign_advantages(samples, {e.episode_id: e.reward for e in usable}, {e.episode_id: e.group_id for e in usable},
                      a.adv_eps, a.norm_adv_by_std, a.adv_estimator)
    used = {id(s) for s in samples}   # for `ajet view`: every sample, its advantage and whether it trained
    store.add_samples(step, attempt, [{**s.to_dict(), "trained": id(s) in used} for e in usable for s in e.samples])
    backbone.sleep_rollout()           # rollout servers may free their memory for the update
    train = rollout.update.update(backbone, samples)   # the gateway's: through its evaluation gate
    backbone.wake_rollout()            # ... and serve the new weights
    kill_point("update", step)
    left_out = _left_out(episodes, trainable)
    store.mark_trained(step, attempt, [(e.episode_id, e.attempt) for e in trainable], left_out)
    kill_point("trained", step)
    rollout.source.step_done(step)
    metrics: dict[str, Any] = {"tracker/trained_samples": len(samples), **guard_metrics,
                               "guards/empty_loss_samples": empty_loss_samples(samples), **staleness,
                               **tool_metrics(episodes)}
    metrics.update({k if "/" in k else f"train/{k}": v for k, v in train.items()})   # e.g. distill/kl as is
    metrics["rollout/trained_episodes"] = len(trainable)
    if cfg.agents:   # an adapter per role: each role's reward and samples (its loss: train/<adapter>/...)
        metrics.update(role_metrics(episodes, samples))
    for _, _, why in left_out:
        metrics[f"rollout/not_trained/{why}"] = metrics.get(f"rollout/not_trained/{why}", 0) + 1
    return metrics


def _no_usable_episode(head: str, episodes: list[Episode], cfg: AjetConfig, exp_dir: Path) -> str:
    """The error of a run stopped because its episodes fail: `head`, then each distinct error of the last
    step's `episodes` (message and the user's frame), never a traceback through ajet."""
    policy = cfg.rollout.failed_episode_policy
    why = failure_lines(episodes) or [f"(no episode failed: failed_episode_policy {policy} dropped every group)"]
    return (f"{head}; the last step's episodes failed with:\n" + "\n".join(f"  {line}" for line in why)
            + f"\n(every episode and its traceback is in {exp_dir / 'trajectories.sqlite'}: ajet show {exp_dir})")


def _trainable(episodes: list[Episode], policy: str) -> list[Episode]:
    """The episodes the update may use: the successful ones, minus whole groups with a failure under
    "drop_group"."""
    failed_groups = {e.group_id for e in episodes if not e.ok}
    return [e for e in episodes if e.ok and (policy == "drop_episode" or e.group_id not in failed_groups)]


def _guard(episodes: list[Episode], vocab_size: int, policy_version: int,
           max_staleness: int | None) -> tuple[set[int], dict[str, Any]]:
    """Apply the sampled-token and staleness guards (ajet/algorithm/guards.py) to `episodes`: each episode
    that fails one gets `not_trained` set to the reason (unless it already has one).

    Args:
        vocab_size: ids the trainer's tokenizer knows; policy_version: the weights the update starts from;
        max_staleness: updates a call may lag behind (None: no bound); a stale episode is only counted here
            (`guards/stale_policy_episodes`): its stale samples are dropped by `_drop_stale` (stale_policy "drop").

    Returns:
        (ids (`id()`) of the episodes dropped for their sampled tokens, the step's guards/* counts).
    """
    dropped: set[int] = set()
    counts = dict.fromkeys((f"guards/{OUT_OF_VOCAB}_episodes", f"guards/{NON_FINITE_LOGPROB}_episodes",
                            f"guards/{STALE_POLICY}_episodes"), 0)
    for e in episodes:
        why = sampled_token_reason(e.calls, vocab_size)
        if why is not None:
            dropped.add(id(e))
        elif stale_policy_reason(e.calls, policy_version, max_staleness) is not None:
            why = STALE_POLICY
        if why is None:
            continue
        counts[f"guards/{why}_episodes"] += 1
        if e.not_trained is None and why != STALE_POLICY:
            e.not_trained = why
    counts["guards/max_policy_lag"] = max((policy_lag(e.calls, policy_version) for e in episodes), default=0)
    return dropped, counts


def _left_out(episodes: list[Episode], trainable: list[Episode]) -> list[tuple[str, int, str]]:
    """(episode_id, attempt, reason) of every successful episode the update leaves out: its `not_trained`
    reason, or "failed_group" (failed_episode_policy drop_group)."""
    used = {id(e) for e in trainable}
    return [(e.episode_id, e.attempt, e.not_trained or "failed_group") for e in episodes if e.ok and id(e) not in used]


def _trained_samples(episodes: list[Episode], targets: list[str] | None) -> list[Sample]:
    """The samples of `episodes` from the agents in `targets` (all of them when None). Warns when the
    episodes called the policy under none of the targeted tags (a misspelt tag trains nothing)."""
    samples = [s for e in episodes for s in e.samples]
    if targets is None:
        return samples
    chosen = [s for s in samples if s.agent_tag in targets]
    if samples and not chosen:
        seen = sorted({s.agent_tag for s in samples})
        logging.getLogger(__name__).warning(
            "algorithm.trainable_targets %s matched no agent this step; the agents that called the policy "
            "were %s", targets, seen)
    return chosen


def _drop_stale(samples: list[Sample], version: int, max_staleness: int | None) -> tuple[list[Sample], dict[str, float]]:
    """The samples within `max_staleness` policy versions of `version` (the one the update starts from), and
    the step's staleness figures. A sample's staleness is `version` minus the OLDEST version that sampled one
    of its tokens; with `max_staleness` None (synchronous), nothing is dropped.

    Returns:
        (kept samples, {"async/stale_samples": dropped, "async/staleness_max", "async/staleness_mean": over the
        kept samples, in versions}).
    """
    def staleness(s: Sample) -> int:
        sampled = [v for v in s.policy_versions if v >= 0]
        return version - min(sampled) if sampled else 0

    kept = [s for s in samples if max_staleness is None or staleness(s) <= max_staleness]
    ages = [staleness(s) for s in kept]
    return kept, {"async/stale_samples": len(samples) - len(kept), "async/staleness_max": max(ages, default=0),
                  "async/staleness_mean": statistics.fmean(ages) if ages else 0.0}


def _step_metrics(episodes: list[Episode], rollout_s: float, generated_tokens: int) -> dict[str, Any]:
    """Rollout and context-tracker figures of one step."""
    ok = [e for e in episodes if e.ok]
    rewards = [e.reward for e in ok]
    samples = [s for e in ok for s in e.samples]
    calls = [c for e in ok for c in e.calls]
    naive_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)   # one sample per call
    merged_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    forks = fork_reasons(samples)
    m: dict[str, Any] = {
        "rollout/episodes": len(episodes),
        "rollout/failed": len(episodes) - len(ok),
        "reward/mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "reward/max": max(rewards) if rewards else float("nan"),
        "rollout/zero_std_groups": len(zero_std_groups(episodes)),   # groups without GRPO signal
        "rollout/calls": len(calls),
        "rollout/calls_per_episode": len(calls) / len(ok) if ok else 0.0,
        "rollout/strict_violations": sum(len(c.strict_violations) for c in calls),
        "rollout/generated_tokens": generated_tokens,
        "rollout/tokens_per_s": generated_tokens / rollout_s if rollout_s > 0 else 0.0,
        "time/rollout_s": rollout_s,
        "tracker/samples": len(samples),
        "tracker/merge_ratio": len(calls) / len(samples) if samples else 0.0,
        "tracker/tokens_naive": naive_tokens,
        "tracker/tokens_merged": merged_tokens,
        "tracker/loss_tokens": sum(s.num_loss_tokens for s in samples),
        "tracker/token_ratio": naive_tokens / merged_tokens if merged_tokens else 0.0,
        "tracker/forks": sum(forks.values()),
        "tracker/masked_unsampled_tokens": sum(s.flags["masked_unsampled_tokens"] for s in samples),
        "tracker/shared_prefix_tokens": sum(s.flags["shared_prefix_tokens"] for s in samples),
        "tracker/greedy_tokens": sum(s.flags.get("greedy_tokens", 0) for s in samples),
        "tracker/prompts_rendered_in_full": sum(1 for c in calls if c.prompt_parent is None and c.index > 0),
        # how each call found its parent (ajet/proxy/prompt.py): by a tool-call id the proxy issued, by text
        "merge/parent_by_id": sum(1 for c in calls if c.prompt_parent_by == "id"),
        "merge/parent_by_text": sum(1 for c in calls if c.prompt_parent_by == "text"),
    }
    m.update({f"merge/fork_reasons/{reason}": n for reason, n in sorted(forks.items())})
    m.update({f"rollout/failed/{kind}": n for kind, n in failure_counts(episodes).items()})
    keys = sorted({k for e in ok if e.output for k in e.output.metrics})
    for k in keys:
        vals = [float(e.output.metrics[k]) for e in ok if e.output and k in e.output.metrics]
        m[f"workflow/{k}"] = statistics.fmean(vals)
    if len(ok) < len(episodes):
        m["rollout/first_error"] = failure_message(next(e.error or "" for e in episodes if not e.ok))
    return m


def _sig3(x: float) -> str:
    """`x` to 3 significant figures: 0.4321 -> "0.432", 12.345 -> "12.3", 0 -> "0"; a number >= 1000 whole
    (1234.5 -> "1234", not "1.23e+03"); below 1e-4 with an exponent (0.0000123 -> "1.23e-05")."""
    text = f"{x:.3g}"
    return f"{x:.0f}" if "e+" in text else text


def _console_line(step: int, total: int, m: dict[str, Any], eta_s: float | None = None, extra: str = "") -> str:
    """The one console line a finished step prints (counts, reward, merge, generation speed, timings, then the run
    mode's `extra`, e.g. `ajet serve`'s clients), ending with the run's time left `eta_s` (`ajet.progress.RunEta`;
    None: not shown). A step whose every episode failed says so instead of a reward."""
    reward = (f"reward {m['reward/mean']:.3f} ± {m['reward/std']:.3f}" if m['rollout/failed'] < m['rollout/episodes']
              else "no episode succeeded: nothing to train on")
    return (f"step {step}/{total} | episodes {m['rollout/episodes']} ({m['rollout/failed']} failed) | "
            f"{reward} | calls {m['rollout/calls']} -> samples "
            f"{m['tracker/samples']} ({m['tracker/merge_ratio']:.2f}x, {m['tracker/forks']} forks, tokens "
            f"{m['tracker/token_ratio']:.2f}x fewer) | gen {_sig3(m['rollout/tokens_per_s'])} tok/s | "
            f"update {m.get('train/update_s', 0):.1f}s | step {m['time/step_s']:.1f}s"
            + extra
            + (f" | ETA {fmt_duration(eta_s)}" if eta_s is not None else ""))

