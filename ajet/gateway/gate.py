"""The evaluation gate and rollback of `ajet gateway`: a new policy serves only when the held-out evaluation
says it is not worse than the serving one, and any kept version can be served again.

How an update goes (`VersionGate.update`, on the trainer thread, in place of `backbone.update`):

    1. the serving version has its checkpoint (ajet/gateway/versions.py: a trainer checkpoint,
       exp_dir/checkpoints/step_<S>, weights + optimizer + RNG + policy version + the trainer's state), and its
       gate figure is known (else the serving weights are evaluated first, while live traffic goes on: same
       weights)
    2. live model calls are held: new ones wait at the gateway's front (`LiveHold`), and the update starts
       only once the calls in flight have finished, so no live token is ever sampled from an unvetted policy
    3. the backbone updates; the new weights run the config's held-out evaluation (`ajet.eval.evaluate`: the
       workflow and judge on `data.val_path` through a proxy of their own over the same engine, `eval:`'s
       sampling; results in exp_dir/gate/step_<S>/)
    4. served when the update moved the weights with finite numbers (`ajet.algorithm.guards.not_a_new_version`:
       no optimizer step skipped for a non-finite loss or gradient norm, a non-zero gradient), the evaluation is
       valid, the candidate's answers are not degenerate (`degenerate_reason`: a non-finite logprob, or most
       answers empty or only end-of-text), its metric is at least `gate.min_score` (when set) and
       `metric(new) >= reference - max_drop`, the reference being the best figure any served version had (mode
       eval; so drops cannot add up over versions) or the serving policy's on the same replay set (mode replay):
       its checkpoint is written (with the sessions it trained on) and live calls resume under it. Refused
       otherwise (any of these, or an invalid evaluation of the serving policy): the backbone loads the serving
       version's checkpoint back,
       so both the engine and the training go on from the serving weights and optimizer state (a harmful
       update does not compound), and live calls resume under the serving version
    5. the decision is in gateway.sqlite (`gate`: step, both versions, both figures, served, reason) and
       counted in /metrics; the step's metrics get gate/* figures

Serving while training (a backbone with `serve_while_training`, the debug backbone: `attach` turns it on): steps
2-4 hold nothing. The update trains the trainer's copy of the weights while the engine serves its own; both
evaluations run on `backbone.trainer_engine()` (an in-process engine over the trainer's copy: the serving weights
before the update, the candidate after), beside the served engine; a candidate that passes (with mode `off`:
every update with finite numbers) is switched in by `backbone.publish()` (the rows in flight finish on the serving
version first) only after its checkpoint and its `versions` row are durable, the row being the commit point, so
that `kill -9` at any point leaves a restart serving a version no older than any answer given, with the same
weights (ajet/gateway/versions.py; fault points gw_update, checkpoint, gw_checkpoint, gw_record, gw_publish of
ajet/faults.py); a refused one is dropped by loading
the serving checkpoint into the trainer's copy only. Rollbacks load into the trainer's copy, then switch. Backbones
without it (verl, trinity) go as numbered above.

With mode `replay` (ajet/gateway/replay.py) the evaluation of step 1 and 3 is a replay of the first request of
the most recently rated sessions that the update did not train on, scored by the config's judge, instead of
`data.val_path`; the set moves with the traffic, so the serving policy is evaluated on it at every update (step
1), never taken from the record.

Cost (without serving while training): live requests wait for the update plus one held-out evaluation (step 2
to 4), and each served version
costs one checkpoint write (with `model.lora` the adapter only). With mode `off` step 2-4 are skipped: every update
is served at once (requests in flight keep decoding across the swap) and checkpointed right after; an update that
is not a new version
(a skipped non-finite step, a zero gradient) is undone even then (the serving checkpoint loaded back, live calls
held meanwhile).

Policy versions count served updates: a refused candidate's number is given to the next update, and after a
rollback to version V the next served update is V + 1 again (its checkpoint replaces the superseded one).

Restart (`--resume`, ajet/gateway/versions.py): the trainer continues from the newest checkpoint, which is the
newest served version's; `attach` then serves the version gateway.sqlite says was served last (a rollback's
target) from its kept checkpoint, so the version, its weights, the history and its rollbacks are those from
before the stop, and no session a served version trained on is trained again.

Rollback (`ajet gateway rollback --conf X [--to V]`, `POST /v1/admin/rollback`): the wish is a row in
gateway.sqlite; the trainer thread looks for one every half second while it waits for sessions (and before
each update; a gateway started with --resume does it at start), holds live calls as above, loads the kept
checkpoint of V (default: the version served before the current one) and serves it with V's recorded figure;
training continues from it. The row is completed with what happened (refused: no checkpoint of V kept, see
`gateway.gate.keep_versions`).

Thread model: `update`, `poll_rollbacks` and `attach` run on the trainer thread only, so weights never change
from two places; the HTTP front only holds and releases live calls and writes rollback wishes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

from ajet.algorithm.guards import not_a_new_version
from ajet.config import AjetConfig
from ajet.faults import kill_point
from ajet.gateway.store import GatewayStore
from ajet.gateway.versions import VersionStore

log = logging.getLogger(__name__)


class LiveHold:
    """Admission of live model calls: `await enter()` ... `leave()` around each; `held()` (another thread)
    stops admitting and waits until the calls in flight have left, and admits again when it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._held = False
        self._in_flight = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    async def enter(self) -> None:
        """Wait while the hold is on, then count this call as in flight."""
        while True:
            with self._lock:
                if not self._held:
                    self._in_flight += 1
                    return
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._drained.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextmanager
    def held(self) -> Iterator[None]:
        """Stop admitting live calls, wait for those in flight to finish, run the block, admit again."""
        with self._lock:
            self._held = True
            self._drained.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self._lock:
                self._held = False
                waiters, self._waiters = self._waiters, []
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_wake, fut)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def metric_key(metric: str) -> str:
    """`gateway.gate.metric` as a key of the evaluation's metrics (without a `val/` prefix)."""
    return metric.removeprefix("val/")


class VersionGate:
    """The gate between an update and the live traffic, the per-version checkpoints and rollbacks (module
    docstring).

    Args:
        cfg: the gateway's config (`gateway.gate`, `data.val_path`, `workflow`, `judge`, `eval`).
        store: gateway.sqlite.
        hold: the front's `LiveHold`.
        console: a rich console for the decision lines (None: the log).
        evaluate: `(step, out_dir) -> EvalResult` of the weights the engine holds now (default: the config's
            held-out evaluation, `ajet.eval.evaluate`); tests pass their own.

    The config is the one `AjetConfig.for_mode("gateway")` checked: mode `eval` has `data.val_path` and a
    `workflow`, mode `replay` a `judge` (ajet/config/experiment.py).
    """

    def __init__(self, cfg: AjetConfig, store: GatewayStore, hold: LiveHold, console=None,
                 evaluate: Callable[[int, Path], Any] | None = None):
        self.cfg, self.g, self.store, self.hold, self.console = cfg, cfg.gateway.gate, store, hold, console
        self.exp_dir = cfg.exp_path()
        self.versions = VersionStore(self.exp_dir, self.g.keep_versions, adapter_only=cfg.model.lora is not None)
        self.backbone = None
        self.step = 0                              # the step being collected (set by the rollout source)
        self.attempt = 0                           # the trainer's attempt (set by the rollout source)
        self._gating: int | None = None            # the serving version while a candidate is updated and evaluated
        self.counts = {"swaps": 0, "gate_evaluations": 0, "gate_refusals": 0, "gate_invalid": 0, "rollbacks": 0}
        self._evaluate = evaluate
        self.beside = False                        # the backbone serves while it trains (see `attach`)
        self._workflow = self._judge = None
        if self.g.mode == "eval" and evaluate is None:
            from ajet.judges import load_judge
            from ajet.rollout.in_process import load_workflow

            self._workflow, self._judge = load_workflow(cfg), load_judge(cfg)
        if self.g.mode == "replay" and evaluate is None:
            from ajet.gateway.replay import ReplayWorkflow
            from ajet.judges import load_judge

            self._workflow, self._judge = ReplayWorkflow(), load_judge(cfg)

    # ---- the trainer thread ------------------------------------------------------------------------
    def attach(self, backbone) -> None:
        """Take the backbone (before the proxy starts; on a restart it holds the newest checkpoint). On a restart,
        serve the version gateway.sqlite last served when the checkpoint holds another (a rollback after it),
        from its kept checkpoint, then do any rollback asked for while the gateway was down."""
        self.backbone = backbone
        if hasattr(backbone, "serve_while_training"):   # the update trains a copy; the served policy answers on
            backbone.serve_while_training()
        self.beside = bool(getattr(backbone, "serves_while_training", False))
        served = self.store.versions()
        version = backbone.engine.policy_version
        newest = self.versions.newest()
        self.step = newest[0] + 1 if newest is not None else 1
        if not served:
            self.store.add_version(version, 0, "start", None)
        elif served[-1]["version"] != version:
            last = served[-1]
            path = self.versions.folder(last["version"])
            if newest is not None and newest[1] == version and newest[0] >= last["step"]:
                # written after the last row (stopped between the checkpoint and its record): it passed the gate
                self.store.add_version(version, newest[0], "restart", _figure_of(served, version))
                self._say(f"gate: serving version {version} (its checkpoint was written as the gateway stopped)")
            elif path is not None:
                self._load(path)
                self._say(f"gate: serving version {last['version']} again, as served before the restart")
            else:
                self.store.add_version(version, self.step, "restart", _figure_of(served, version))
                self._say(f"gate: version {last['version']} was served before the restart but no checkpoint of it "
                          f"is kept (gateway.gate.keep_versions): serving version {version}, the newest checkpoint")
        self.poll_rollbacks()

    def update(self, samples, step: int, trained: list[tuple[str, int]] = ()) -> dict[str, float]:
        """`backbone.update(samples)` behind the gate (module docstring); returns its metrics plus gate/*.
        `trained`: (episode_id, attempt) of the episodes the update trains on, kept with a served version's
        checkpoint (ajet/gateway/versions.py)."""
        self.poll_rollbacks()
        backbone = self.backbone
        engine = backbone.engine
        serving = engine.policy_version
        self._checkpoint(serving)
        tasks = None
        if self.g.mode == "replay":                # one replay set for both figures (ajet/gateway/replay.py)
            from ajet.gateway.replay import replay_tasks

            sessions = {s.episode_id.split("~", 1)[0] for s in samples}   # a best-of candidate: <session>~<k>
            tasks = replay_tasks(self.store, self.g.replay_sessions, exclude=sessions)
        if self.beside:
            return self._update_beside(samples, step, trained, serving, tasks)
        if self.g.mode == "off":
            train = backbone.update(samples)
            kill_point("gw_update", step)
            candidate = engine.policy_version
            if candidate != serving:
                why = not_a_new_version(train)
                if why is not None:
                    with self.hold.held():
                        self._refuse(step, candidate, serving, "update", None, None, why)
                    return {**train, "gate/served": 0.0}
                self._served(candidate, step, "ungated", None, trained)
            return train
        baseline = self._serving_figure(step, tasks)
        with self.hold.held():
            self._gating = serving
            train = backbone.update(samples)
            kill_point("gw_update", step)
            candidate = engine.policy_version
            if candidate == serving:               # nothing was trained: nothing to gate
                self._gating = None
                return train
            figure, reason = self._judge_candidate(step, train, tasks, baseline)
            served = self._decide(step, candidate, serving, tasks, baseline, figure, reason, trained)
            self._gating = None
        return {**train, "gate/served": float(served), "gate/candidate_figure": _nan(figure),
                "gate/serving_figure": _nan(baseline)}

    def _update_beside(self, samples, step: int, trained, serving: int, tasks) -> dict[str, float]:
        """`update` for a backbone that serves while it trains (`serve_while_training`): live calls are never
        held. The serving figure is measured on the trainer's copy before the update (it holds the serving
        weights then), the update trains that copy, the candidate is evaluated on it too (`trainer_engine`), and
        only a candidate that passes is switched in (`publish`: streams in flight finish on `serving` first),
        once its checkpoint and its `versions` row are durable (`_served`), so a restart after `kill -9` at any
        point serves a version some client may have been answered by, with the same weights. A refused one is
        dropped by loading the serving checkpoint into the trainer's copy (nothing served changes)."""
        backbone = self.backbone
        baseline = None if self.g.mode == "off" else self._serving_figure(step, tasks)
        train = backbone.update(samples)
        kill_point("gw_update", step)
        candidate = backbone.candidate_version
        if candidate is None:                      # nothing was trained: nothing to gate
            return train
        if self.g.mode == "off":
            figure, reason = None, not_a_new_version(train)
            if reason is not None:
                self._refuse(step, candidate, serving, "update", None, None, reason)
                return {**train, "gate/served": 0.0}
            self._served(candidate, step, "ungated", None, trained)   # durable first, then switched in
            train.update(backbone.publish())
            kill_point("gw_publish", step)
            return train
        figure, reason = self._judge_candidate(step, train, tasks, baseline)
        served = self._decide(step, candidate, serving, tasks, baseline, figure, reason, trained)
        return {**train, "gate/served": float(served), "gate/candidate_figure": _nan(figure),
                "gate/serving_figure": _nan(baseline)}

    def _judge_candidate(self, step: int, train: dict[str, float], tasks, baseline: float | None
                         ) -> tuple[float | None, str | None]:
        """(the candidate's figure or None, why it is refused or None): the update's own numbers, its evaluation
        (on the trainer's copy beside serving, else on the engine, which holds it), degenerate answers, the floor
        and the drop below `baseline`."""
        figure, reason = None, not_a_new_version(train)
        if reason is None and tasks == []:
            reason = "no rated session with a recorded call to replay"
        elif reason is None:
            result = self._run_eval(step, self.exp_dir / "gate" / f"step_{step}", tasks)
            figure, reason = self._figure(result)
            reason = degenerate_reason(result.episodes, self.backbone.tokenizer) or reason   # whatever the metric
        if reason is None and self.g.min_score is not None and figure < self.g.min_score:
            reason = f"{self.g.metric} {figure:.4g} is below gateway.gate.min_score {self.g.min_score:g}"
        if reason is None and baseline is None:
            reason = "the serving policy's evaluation was invalid: no figure to compare with"
        if reason is None and figure < baseline - self.g.max_drop:
            reason = (f"{self.g.metric} {figure:.4g} is {baseline - figure:.4g} below "
                      f"{'the best served version' if tasks is None else 'the serving policy'}'s "
                      f"{baseline:.4g} (gateway.gate.max_drop {self.g.max_drop:g})")
        return figure, reason

    def _decide(self, step: int, candidate: int, serving: int, tasks, baseline: float | None, figure: float | None,
                reason: str | None, trained) -> bool:
        """Serve `candidate` (switched in first when it was trained beside serving) when `reason` is None, else
        refuse it; record and say the decision. Returns whether it is served."""
        metric = self.g.metric if tasks is None else f"replay:{self.g.metric}"
        if reason is not None:
            self._refuse(step, candidate, serving, metric, baseline, figure, reason)
            return False
        # (a replay figure is of this update's set only: not kept as the version's figure)
        self._served(candidate, step, "gate", figure if tasks is None else None, trained)
        self.store.add_gate(step, candidate, serving, metric, baseline, figure, self.g.max_drop, True,
                            "served" if tasks is None else f"served (replay of {len(tasks)} sessions)")
        if self.beside:                            # switched in only once its checkpoint and rows are durable
            self.backbone.publish()
            kill_point("gw_publish", step)
        self._say(f"gate: step {step}: version {candidate} served ({self.g.metric} {figure:.4g}, reference "
                  f"{_fmt(baseline)})")
        return True

    def _refuse(self, step: int, candidate: int, serving: int, metric: str, baseline: float | None,
                figure: float | None, reason: str) -> None:
        """Refuse `candidate` (live calls held by the caller, unless it was trained beside serving: then only the
        trainer's copy goes back): engine and training back to the serving version's checkpoint, the decision
        recorded in gateway.sqlite and said."""
        self._load(self.versions.folder(serving), serve=not self.beside)
        self.counts["gate_refusals"] += 1
        self.store.add_gate(step, candidate, serving, metric, baseline, figure, self.g.max_drop, False, reason)
        self._say(f"gate: step {step}: version {candidate} REFUSED: {reason}; version {serving} stays served")

    def served_version(self, engine) -> int:
        """The version live calls get (/healthz, /metrics): while a candidate is updated and evaluated, the
        serving one, not the engine's."""
        gating = self._gating
        return engine.policy_version if gating is None else gating

    def poll_rollbacks(self) -> None:
        """Do every rollback asked for and not yet done (trainer thread)."""
        if self.backbone is None:
            return
        for rollback_id, to in self.store.pending_rollbacks():
            try:
                ok, message = self._rollback(to)
            except Exception as exc:  # noqa: BLE001 - a failed rollback is reported, the gateway goes on
                log.exception("gateway: rollback %s failed", rollback_id)
                ok, message = False, f"failed: {type(exc).__name__}: {exc}"
            self.store.finish_rollback(rollback_id, ok, message)
            self._say(f"gate: rollback {rollback_id}: {message}")

    def _rollback(self, to: int | None) -> tuple[bool, str]:
        engine = self.backbone.engine
        current = engine.policy_version
        served = self.store.versions()
        if to is None:
            to = next((v["version"] for v in reversed(served) if v["version"] != current), None)
            if to is None:
                return False, f"refused: no version was served before the current one ({current})"
        if to == current:
            return True, f"version {to} is already served"
        path = self.versions.folder(to)
        if path is None:
            kept = ", ".join(map(str, self.versions.kept())) or "none"
            return False, f"refused: no checkpoint of version {to} is kept (kept: {kept}; gateway.gate.keep_versions)"
        self._checkpoint(current)                  # so that one can roll forward again
        with nullcontext() if self.beside else self.hold.held():   # beside: the switch lets streams finish
            self._load(path)
        self.store.add_version(engine.policy_version, self.step, "rollback", _figure_of(served, to))
        self.counts["rollbacks"] += 1
        self.counts["swaps"] += 1
        return True, f"version {engine.policy_version} is served (was {current})"

    # ---- pieces ------------------------------------------------------------------------------------
    def _load(self, path: Path, serve: bool = True) -> None:
        """Load a kept version's checkpoint (weights, optimizer, RNG, policy version) and forget the engine's
        cached prefixes: they are keyed by policy version, and a number comes back with other weights.
        `serve=False` (serving while training): into the trainer's copy only."""
        if self.beside:
            self.backbone.load_checkpoint(path, serve=serve)
            return
        self.backbone.load_checkpoint(path)
        engine = self.backbone.engine
        cache = getattr(engine, "prefix_cache", None)
        if cache is not None:
            with engine.weights_lock:
                cache.clear()

    def _checkpoint(self, version: int) -> None:
        """Write the served version's checkpoint unless one is kept (the start's version, before the first update:
        as the end of the step before the one being collected)."""
        if self.versions.folder(version) is None:
            self.versions.write(self.backbone, version, max(self.step - 1, 0), self.attempt)
            self._prune(version)

    def _served(self, version: int, step: int, how: str, figure: float | None,
                trained: list[tuple[str, int]] = ()) -> None:
        """`version` is served from now: its checkpoint (as the end of `step`, with the episodes it trained on; it
        supersedes an earlier version of that number; its files fsynced), then its `versions` row (committed with
        a full sync: the commit point, see `VersionStore.discard_uncommitted`). Serving while training, the
        caller switches it in only after this returns."""
        self.versions.write(self.backbone, version, step, self.attempt, trained)
        kill_point("gw_checkpoint", step)
        self.store.add_version(version, step, how, figure, durable=True)
        kill_point("gw_record", step)
        self.counts["swaps"] += 1
        self._prune(version)

    def _prune(self, version: int) -> None:
        """Remove the checkpoints of all but the keep_versions newest served versions (and `version`)."""
        removed = self.versions.prune([v["version"] for v in self.store.versions()], version)
        if removed:
            log.info("gateway: removed the checkpoints %s (gateway.gate.keep_versions %d)",
                     ", ".join(p.name for p in removed), self.g.keep_versions)

    def _serving_figure(self, step: int, tasks=None) -> float | None:
        """The serving version's gate figure: recorded, else evaluated now (live traffic goes on; same weights).
        With a replay set (`tasks`), always evaluated now on it (None for an empty set). Without one (mode eval), the
        best figure any served version had, if higher: the reference a candidate is compared with."""
        if tasks is None:
            versions = self.store.versions()
            best = max((v["figure"] for v in versions if v["figure"] is not None), default=None)
            if versions[-1]["figure"] is not None:
                return best
        elif not tasks:
            return None
        figure, reason = self._figure(self._run_eval(step, self.exp_dir / "gate" / f"step_{step}" / "serving", tasks))
        if reason is not None:
            self._say(f"gate: the serving policy's evaluation at step {step}: {reason}")
            return None
        if tasks is None:
            self.store.set_serving_figure(figure)
            best = max((v["figure"] for v in self.store.versions() if v["figure"] is not None), default=figure)
            return max(figure, best)
        return figure

    def _run_eval(self, step: int, out_dir: Path, tasks=None):
        """Evaluate the engine's weights on `tasks` (None: `data.val_path`); results written to `out_dir`."""
        self.counts["gate_evaluations"] += 1
        if self._evaluate is not None:
            return self._evaluate(step, out_dir)
        from ajet.eval import evaluate, write_result
        from ajet.tasks import load_tasks

        b = self.backbone
        with b.trainer_engine() if self.beside else nullcontext(b.engine) as engine:   # beside: serving goes on
            result = evaluate(self.cfg, engine, b.tokenizer, self._workflow, self._judge,
                              load_tasks(self.cfg, "val") if tasks is None else tasks, step=step)
        write_result(result, out_dir)
        return result

    def _figure(self, result) -> tuple[float | None, str | None]:
        """(the gate metric, None) of a valid evaluation, else (None, why it cannot be compared)."""
        if not result.valid:
            self.counts["gate_invalid"] += 1
            return None, f"the evaluation is invalid ({result.invalid_reason(self.cfg.eval.max_failed_frac)})"
        key = metric_key(self.g.metric)
        value = result.metrics.get(key)
        if value is None or not math.isfinite(value):
            return None, (f"gateway.gate.metric {self.g.metric!r} is not among the evaluation's figures "
                          f"({', '.join(sorted(result.metrics))})")
        return float(value), None

    def _say(self, line: str) -> None:
        if self.console is not None:
            self.console.print(line)
        else:
            log.warning(line)

    def snapshot(self) -> dict[str, Any]:
        """Versions served and gate decisions (for `GET /v1/admin/versions`)."""
        return {"policy_version": self.backbone.engine.policy_version if self.backbone is not None else None,
                "metric": self.g.metric, "mode": self.g.mode, "max_drop": self.g.max_drop,
                "versions": self.store.versions(), "gate": self.store.gate_results(),
                "kept": self.versions.kept()}


def degenerate_reason(episodes, tokenizer) -> str | None:
    """Why a candidate's evaluation answers are degenerate, or None: a sampled token's logprob is NaN or +-inf
    (a broken policy), or more than half of the answers (each finished episode's calls) are empty or only
    special tokens such as end-of-text. Episodes that failed are not counted (their share makes the evaluation
    invalid instead).

    Args:
        episodes: the evaluation's `Episode`s (`EvalResult.episodes`).
        tokenizer: the policy's tokenizer (`all_special_ids`: end-of-text, padding, ...).
    """
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    calls = [c for e in episodes if e.ok for c in e.calls]
    for c in calls:
        if any(lp is None or not math.isfinite(lp) for lp in c.completion_logprobs):
            return f"degenerate answers: call {c.call_id} sampled a token with a non-finite logprob"
    empty = sum(1 for c in calls if all(t in special for t in c.completion_ids))
    if calls and 2 * empty > len(calls):
        return f"degenerate answers: {empty} of {len(calls)} are empty or only end-of-text"
    return None


def request_rollback(store: GatewayStore, to: int | None, wait_s: float = 0.0, poll_s: float = 0.2) -> dict[str, Any]:
    """Ask the gateway of `store` to serve version `to` (None: the one before the current); wait up to `wait_s`
    seconds for it to be done. Returns the rollback's row (`done_at` None: not done yet; the gateway does it
    when it runs, or when it is started with --resume)."""
    rollback_id = store.request_rollback(to)
    deadline = time.monotonic() + wait_s
    row = store.rollback(rollback_id)
    while row["done_at"] is None and time.monotonic() < deadline:
        time.sleep(poll_s)
        row = store.rollback(rollback_id)
    return row


def _figure_of(served: list[dict[str, Any]], version: int) -> float | None:
    """The latest recorded gate figure of `version` in the `versions` rows, None when none."""
    return next((v["figure"] for v in reversed(served) if v["version"] == version and v["figure"] is not None), None)


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _fmt(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.4g}"
