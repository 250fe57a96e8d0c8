"""The gateway's rollout source for the one training loop (ajet/trainer.py): rated sessions become episodes.

What a GRPO group is without best-of-N: live sessions are one conversation each, so no two share a prompt. The
source groups them by the order their rewards arrived, `rollout.num_repeat` sessions to a group (ids
`live<step>-<k>`), `trainer.tasks_per_step` groups to a step. Such a group is bookkeeping (the ledger, the per-step
figures), not a same-prompt comparison, so the gateway's default advantage is `reinforce_plus_plus`
(`ajet.algorithm.advantage`: each reward whitened over the whole step, no group baseline; Hu 2025, REINFORCE++,
made for prompts sampled once). A config that names `algorithm.adv_estimator` keeps it: `rloo` then uses the
other sessions of the arrival group as a leave-one-out baseline (unbiased: they do not depend on this
session's tokens), `grpo` normalises within it.

Best-of-N (`gateway.n` > 1): a group is one session and every candidate its requests did not answer (each a
one-call episode whose reward is its judge score; the session's reward is its feedback, or the judge at the
deadline), so the candidates of a request share its prompt ids and GRPO compares them. `trainer.tasks_per_step`
such groups make a step (`rollout.num_repeat` is not used); the default advantage is then `grpo`. The judge's
scores and the client's rewards should share a scale (e.g. both in [0, 1]).

Restart: the trainer resumes from the newest served version's checkpoint (ajet/gateway/versions.py), so every
update that served a version is live in the trajectory store's ledger; the sessions of that checkpoint's own step
are written into the ledger here when the stop came before the trainer did. Every rated session in gateway.sqlite
that no live update trained on is ready again, so an acknowledged reward is trained on exactly once in the run's
lineage, and never again by a later attempt once a served version trained on it.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from ajet import progress
from ajet.episode import Episode
from ajet.gateway.gate import VersionGate
from ajet.gateway.sessions import SessionBook, _last_answer
from ajet.gateway.versions import KEY, rollout_state
from ajet.rollout import RolloutContext
from ajet.workflow import WorkflowOutput

TICK_S = 0.5   # how often idle sessions and feedback deadlines are looked at, seconds


def attach(proxy, book: SessionBook, make_app) -> None:
    """Wire `book` to `proxy` (created, not yet started): every recorded response goes to `book.recorded`, and
    `make_app(proxy, book)` (the gateway's ASGI front) replaces `proxy.app`."""
    proxy.on_recorded = lambda ep, turn, choices, others: book.recorded(
        ep.episode_id, turn.response_id, [c.call for c in choices], [c.call for c in others])
    if book.n > 1:
        proxy.best_of, proxy.choose = book.best_of, book.choose
    proxy.app = make_app(proxy, book)


class GatewaySource:
    """A `RolloutSource` (ajet/rollout/__init__.py) over the gateway's rated sessions, and the run's `UpdatePolicy`
    (`attach`, `update`: through the evaluation gate).

    Args:
        ctx: the trainer's rollout context (config, store, attempt, record).
        book_factory: `proxy -> SessionBook`, called in `bind` (the book needs the proxy).
        make_app: `(proxy, book) -> ASGI app` that replaces `proxy.app`.
        gate: the evaluation gate and rollbacks (ajet/gateway/gate.py): the trainer gives it the backbone
            (`attach`) and updates through it (`update`); None: plain updates.
    """

    def __init__(self, ctx: RolloutContext, book_factory, make_app, gate: VersionGate | None = None):
        self.ctx, self.book_factory, self.make_app, self.gate = ctx, book_factory, make_app, gate
        self.num_repeat, self.tasks_per_step = ctx.cfg.rollout.num_repeat, ctx.cfg.trainer.tasks_per_step
        self.book: SessionBook | None = None
        self.proxy = None
        self.episodes: list[Episode] = []         # the step's episodes (their `not_trained` set by the trainer)
        self._resumed: dict[str, Any] = {}        # the gateway's part of the checkpoint resumed from
        if gate is not None:
            gate.attempt = ctx.attempt
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def bind(self, proxy) -> None:
        self.proxy = proxy
        self.book = self.book_factory(proxy)
        if self.ctx.cfg.trainer.resume:
            self._restore()
        attach(proxy, self.book, self.make_app)
        self._reaper = threading.Thread(target=self._reap, name="ajet-gateway-reaper", daemon=True)
        self._reaper.start()

    def _restore(self) -> None:
        r, store = self._resumed, self.ctx.store
        if r.get("trained"):                       # the checkpoint's step: trained, maybe not yet in the ledger
            step, attempt = r["step"], r["attempt"]
            if not any((step, attempt) in e["trained_in"] for e in store.ledger()):
                store.mark_trained(step, attempt, [(eid, att) for eid, att in r["trained"]])
                progress.note(self.ctx.console, f"gateway: the {len(r['trained'])} sessions version {r['version']} "
                              f"trained on at step {step} are marked trained (stopped before the trainer did)")
        trained = {e["episode_id"] for e in store.ledger() if e["trained_in"]}
        stored = self.book.store.sessions()
        self.book.load(stored, trained)
        ready = self.book.metrics()["gateway/ready"]
        progress.note(self.ctx.console,
                      f"gateway: {len(stored)} sessions restored ({ready} rated and not yet trained on)")

    def _reap(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.book.tick()
            except Exception:  # noqa: BLE001 - keep reaping; the log has it
                import logging
                logging.getLogger(__name__).exception("gateway: reaping sessions failed")

    def attach(self, backbone) -> None:
        """The trainer's backbone, before the proxy starts (the gate updates, checkpoints and rolls it back)."""
        if self.gate is not None:
            self.gate.attach(backbone)

    def update(self, backbone, samples) -> dict[str, float]:
        """The trainer's update: through the gate when there is one (evaluated before it serves; a served version's
        checkpoint keeps the episodes the update trains on: the step's, but those the trainer left out)."""
        if self.gate is None:
            return backbone.update(samples)
        trained = [(e.episode_id, e.attempt) for e in self.episodes if e.ok and e.not_trained is None]
        return self.gate.update(samples, self.gate.step, trained)

    def collect(self, step: int) -> list[Episode]:
        """Block until `tasks_per_step * num_repeat` sessions are closed and rated; take those rated first,
        commit each as an episode (`ctx.record`) and return them in groups of `num_repeat`. Meanwhile, every
        TICK_S, do the rollbacks asked for (the gate's)."""
        size = 1 if self.book.n > 1 else self.num_repeat      # sessions per group
        need = self.tasks_per_step * size
        if self.gate is not None:
            self.gate.step = step
        while True:
            if self.gate is not None:
                self.gate.poll_rollbacks()
            with self.book.changed:
                if self.book.ready() >= need:
                    sessions = self.book.take(need)
                    break
                self.book.changed.wait(timeout=TICK_S)
            self._show_waiting(need)
        if self.book.n > 1:
            self.episodes = self._best_of_groups(step, sessions)
            self.book.release(sessions)
            return self.episodes
        episodes = []
        for g in range(self.tasks_per_step):
            group_id = f"live{step}-{g}"
            for r, s in enumerate(sessions[g * self.num_repeat:(g + 1) * self.num_repeat]):
                ep = Episode(s.session_id, self.book.task_of(s), group_id, r, calls=list(s.calls), reward=s.reward,
                             output=WorkflowOutput(reward=s.reward, final_answer=_last_answer(s.calls),
                                                   metadata={"reward_source": s.reward_source, "comment": s.comment}),
                             attempt=self.ctx.attempt)
                self.ctx.record(step, ep)
                episodes.append(ep)
        self.book.release(sessions)
        self.episodes = episodes
        return episodes

    def _show_waiting(self, need: int) -> None:
        """The step's progress display (ajet/progress.py) while it waits: sessions open, closed and awaiting
        feedback, and rated of the `need` the step takes."""
        if (bar := progress.active("step")) is not None:
            m = self.book.metrics()
            bar.set(**{"sessions open": m["gateway/open"], "awaiting feedback": m["gateway/waiting_feedback"],
                       "rated": f"{min(m['gateway/ready'], need)}/{need}"})

    def _best_of_groups(self, step: int, sessions) -> list[Episode]:
        """One group per session: the session's episode (rollout 0), then its scored candidates (see above)."""
        episodes = []
        for g, s in enumerate(sessions):
            group_id, task = f"live{step}-{g}", self.book.task_of(s)
            members = [(s.session_id, list(s.calls), s.reward, {"reward_source": s.reward_source,
                                                               "comment": s.comment})]
            members += [(c.episode_id, [c.call], c.score, {"reward_source": "judge", "best_of_candidate": True,
                                                          "response_id": c.response_id})
                        for c in s.candidates if c.score is not None]
            for r, (eid, calls, reward, meta) in enumerate(members):
                ep = Episode(eid, task, group_id, r, calls=calls, reward=reward,
                             output=WorkflowOutput(reward=reward, final_answer=_last_answer(calls), metadata=meta),
                             attempt=self.ctx.attempt)
                self.ctx.record(step, ep)
                episodes.append(ep)
        return episodes

    def step_done(self, step: int) -> None:
        pass

    def serve_after_training(self) -> None:
        """After the last update (`trainer.total_steps`), with `gateway.after_training: serve` (the default):
        keep serving the last served policy until the process is stopped (Ctrl-C, SIGTERM). Requests are answered
        and recorded, feedback is accepted and durable, sessions close and are judged or dropped as before, and
        rollbacks are done; nothing trains. A rated session's calls leave memory (gateway.sqlite keeps them), so
        a long-serving gateway's memory does not grow with its traffic; `--resume` with a higher
        `trainer.total_steps` trains them. With `stop`, returns at once (the gateway shuts down)."""
        if self.ctx.cfg.gateway.after_training != "serve":
            return
        version = self.gate.served_version(self.proxy.engine) if self.gate is not None else self.proxy.engine.policy_version
        progress.note(self.ctx.console, f"gateway: training done ({self.ctx.cfg.trainer.total_steps} updates); serving "
                      f"version {version} until stopped (Ctrl-C); feedback is still recorded, and `--resume` with a "
                      f"higher trainer.total_steps trains on it")
        try:                                       # SIGTERM (a service manager's stop): a clean shutdown too
            previous = signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        except ValueError:                         # not the main thread: Ctrl-C / close() only
            previous = None
        app = getattr(self.proxy, "app", None)
        if app is not None:                        # /healthz says so (once a SIGTERM is a clean shutdown)
            app.training = "done"
        try:
            while not self._stop.wait(TICK_S):
                if self.gate is not None:
                    self.gate.poll_rollbacks()
                self.book.release_rated()
        except KeyboardInterrupt:
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        progress.note(self.ctx.console, "gateway: stopped")

    def state_dict(self, step: int) -> dict[str, Any]:
        """The served version (ajet/gateway/versions.py); which sessions are trained is the trajectory store's
        ledger, the rest is in gateway.sqlite."""
        engine = self.proxy.engine if self.proxy is not None else None
        return rollout_state(engine.policy_version) if engine is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = dict(state.get(KEY) or {})

    def metrics(self) -> dict[str, Any]:
        return self.book.metrics() if self.book is not None else {}

    def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        if self.book is not None:
            self.book.store.close()
