"""Episodes that `ajet serve` clients begin and finish over HTTP: a rollout source for the one trainer loop.

The server hands tasks out in GRPO-group order: every task drawn from a dataset opens a group of
`rollout.num_repeat` places, and a client's `begin` gets the first free place of the oldest group that
still needs episodes, opening the next group (at most two steps' worth ahead of training) when none does.
A client may ask for tasks of one dataset (a multi-task run: its groups never mix datasets), or bring its
own task and group id. `finish` closes the episode's proxy endpoint, takes
its recorded calls, scores it (the client's reward, else the judge on its final answer), commits it to the
store and puts it into its group. The trainer's `collect(step)` waits for `trainer.tasks_per_step`
complete groups and takes them, oldest first.

An episode that makes no call (and sends no heartbeat) for `serve.episode_idle_timeout_s`, or that its
client aborts, is *abandoned*: stored with the reason, never trained on, and its place handed to the next
client, so the group still completes.

After a restart with `--resume`, the groups that were open at the checkpoint are opened again, and every
finished episode that no live update used is put back into its group (matched by group id; see
`TrajectoryStore.untrained`), so nothing a client finished is lost or trained twice.

Every begun episode gets its own unguessable `episode_token`; `finish` / `abort` / `heartbeat` refuse
(403) a call that does not present it, so one client cannot end another's episode. When the trainer stops
before its last step, `close()` makes every call answer 503 `server_restarting` (not 410 `run_finished`),
so clients wait for the server restarted with `--resume`. Either way the server answers on until every client
heard from lately has been told (`wait_until_clients_told`): a client in the middle of an episode, or between
retries, must not find the server gone and retry into the void.

Thread model: the HTTP handlers call `begin` / `finish` / `abort` / `heartbeat` from worker threads, the
trainer calls `collect` from its own; one lock guards the state, a condition wakes `collect`. A state
change is made whole under the lock (the reaper abandons all idle episodes in one pass); storing and
closing proxy endpoints happen after it is released.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ajet.episode import Episode
from ajet.judges.calling import JudgeError, call_judge
from ajet.progress import active
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler
from ajet.workflow import WorkflowOutput


log = logging.getLogger(__name__)
TOKEN_HEADER = "X-Ajet-Episode-Token"   # the header that carries an episode's `episode_token`
RESTART_RETRY_AFTER_S = 5.0              # Retry-After of 503 `server_restarting`, seconds
SHOWN_CLIENTS = 5                        # the progress display's per-client counts: the busiest this many


class EpisodeApiError(Exception):
    """A refused episode-API call: HTTP `status`, machine-readable `code`, and a message saying what to fix."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s


@dataclass
class _Group:
    """One GRPO group: `num_repeat` places for episodes of one task."""

    order: int                       # hand-out order among all groups (oldest first)
    group_id: str
    task: Task
    own: bool                        # brought by a client, not drawn from a dataset
    dataset: str | None = None       # the dataset it was drawn from
    label: str = ""                  # its part of episode ids: "g3" (one dataset), "math-g3", "own7"
    finished: dict[int, Episode] = field(default_factory=dict)      # repeat index -> finished episode
    running: dict[int, str] = field(default_factory=dict)           # repeat index -> running episode id
    handouts: int = 0


@dataclass
class _Running:
    episode_id: str
    group: _Group
    repeat: int
    endpoint: Any                    # the proxy's EpisodeEndpoint
    token: str                       # the episode's own secret: finish/abort/heartbeat must present it
    client_id: str
    began: float                     # time.monotonic()
    last_seen: float                 # time.monotonic() of begin, the last call or heartbeat
    in_flight: int = 0               # proxy requests being served now


@dataclass
class _Client:
    begun: int = 0
    finished: int = 0
    abandoned: int = 0
    last_seen: float = field(default_factory=time.monotonic)   # any episode-API or proxy call of the client
    told: bool = False               # answered 410 `run_finished` / 503 `server_restarting` after `close()`


class EpisodeQueue:
    """The rollout source of `ajet serve` (see the module docstring).

    Args:
        sampler: the datasets the server hands out (`MultiTaskSampler`; its state is checkpointed).
        num_repeat: episodes per GRPO group.
        tasks_per_step: groups per training step.
        total_steps: the run's last step (no groups are opened beyond it).
        first_step: the step the trainer collects first (1, or the checkpoint's step + 1).
        attempt: this trainer attempt (in episode ids and the store).
        record: `record(step, episode)`: commits a finished or abandoned episode to the store.
        judge: `judge(task, WorkflowOutput) -> float` for episodes finished without a reward, or None.
        idle_timeout_s: abandon an episode after this long without a call or heartbeat, seconds.
        clock: the queue's time source, seconds (`time.monotonic`; a test passes a clock it advances itself,
            so that what "idle" and "heard from lately" mean does not depend on the machine's load).
    """

    def __init__(self, sampler: MultiTaskSampler, num_repeat: int, tasks_per_step: int, total_steps: int,
                 first_step: int, attempt: int, record: Callable[[int, Episode], None], judge: Callable | None = None,
                 idle_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.num_repeat, self.tasks_per_step, self.total_steps = num_repeat, tasks_per_step, total_steps
        self.attempt, self.record, self.judge, self.idle_timeout_s = attempt, record, judge, idle_timeout_s
        self.sampler = sampler
        self._clock = clock
        self.multi = len(sampler.samplers) > 1
        self.proxy = None
        self.collecting_step = first_step                # the step new episodes are stored under
        self.trained_step = first_step - 1
        self.finished_run = False                        # every step trained: `begin` answers 410
        self.stopping = False                            # the trainer stopped early: every call answers 503
        self._gids = {name: 0 for name in sampler.samplers}   # groups opened per dataset (ids "g<k>:<task_id>")
        self._order = itertools.count()
        self._groups: dict[str, _Group] = {}             # open groups by group id, not yet taken by collect
        self._running: dict[str, _Running] = {}          # by episode id
        self._by_token: dict[str, _Running] = {}         # by the episode's proxy api_key
        self._ended: dict[str, str] = {}                 # episode id -> "finished" | "abandoned: ..." | "aborted: ..."
        self._tokens: dict[str, str] = {}                # episode id -> its token (running and ended episodes)
        self._adoptable: dict[str, list[Episode]] = {}   # finished, untrained episodes of an earlier attempt
        self._clients: dict[str, _Client] = {}
        self._serving_since = clock()                    # (reset by `bind`)
        self.counts = {"begun": 0, "finished": 0, "failed": 0, "abandoned": 0, "aborted": 0, "adopted": 0}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # stores episodes that `begin` reaped, off the client's path: a begin that first stored every
        # reaped episode answered so late under load that the episode it handed out idled out in turn
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="ajet-store-abandoned")

    # ---- wiring -----------------------------------------------------------------------------------
    def bind(self, proxy) -> None:
        """Use `proxy` (a `ProxyServer`) to open and close episode endpoints."""
        self.proxy = proxy
        self._serving_since = self._clock()

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint after `step` needs to hand out the same groups again: the sampler position, the
        group counter and the groups open now (their tasks; their finished episodes are in the store)."""
        with self._lock:
            return {"sampler": self.sampler.state(), "gids": dict(self._gids),
                    "open_groups": [{"group_id": g.group_id, "task": g.task.to_dict(), "own": g.own,
                                     "dataset": g.dataset, "label": g.label}
                                    for g in sorted(self._groups.values(), key=lambda g: g.order)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (before any client connects)."""
        with self._lock:
            self.sampler.set_state(state["sampler"])
            self._gids.update(state["gids"])
            for g in state["open_groups"]:
                self._open(g["group_id"], Task(**g["task"]), g["own"], g["dataset"], g["label"])

    def adopt(self, records: list[dict[str, Any]]) -> None:
        """Put finished, never-trained episodes of an earlier attempt (`TrajectoryStore.untrained()`) back
        into their groups: now when the group is open, else when it opens again."""
        with self._lock:
            for rec in records:
                self._adoptable.setdefault(rec["group_id"], []).append(Episode.from_dict(rec))
            for g in self._groups.values():
                self._fill_from_adoptable(g)

    # ---- the episode API (called from the HTTP handlers' worker threads) --------------------------
    def begin(self, client_id: str, task: dict[str, Any] | None = None, group_id: str | None = None,
              dataset: str | None = None) -> dict[str, Any]:
        """Hand out the next place (of `dataset`'s groups when given; or one in the client's own group).
        Returns the episode's wire form.

        Raises:
            EpisodeApiError: 410 `run_finished`; 503 `no_task_available` (every open group's places are
                taken and training must catch up: retry after a second); 409 `group_full` for an own group
                that already has `num_repeat` episodes; 400 `unknown_dataset`.
        """
        if dataset is not None and dataset not in self._gids:
            raise EpisodeApiError(400, "unknown_dataset", f"no dataset {dataset!r} here; the datasets are "
                                                          + ", ".join(sorted(self._gids)))
        reaped: list[tuple[_Running, str]] = []
        try:
            with self._lock:
                reaped = [] if self.finished_run else self._reap_idle()
                client = self._clients.setdefault(client_id, _Client())
                client.last_seen = self._clock()
                self._refuse_if_stopping(client_id)
                if self.finished_run:
                    self._tell(client_id)
                    raise EpisodeApiError(410, "run_finished", f"the run finished its {self.total_steps} steps")
                group, repeat = self._place(task, group_id, dataset)
                group.handouts += 1
                eid = f"a{self.attempt}-{group.label}-r{repeat}"
                if eid in self._ended:                       # this place was handed out before and abandoned
                    eid += f"-h{group.handouts}"
                endpoint = self.proxy.open_episode(eid)
                now = self._clock()
                token = secrets.token_urlsafe(24)
                run = _Running(eid, group, repeat, endpoint, token, client_id, now, now)
                group.running[repeat] = eid
                self._running[eid], self._by_token[endpoint.api_key], self._tokens[eid] = run, run, token
                client.begun += 1
                self.counts["begun"] += 1
                self._show_in_flight()
                return {"episode_id": eid, "episode_token": token, "base_url": endpoint.base_url,
                        "api_key": endpoint.api_key, "model": self.proxy.model_name, "task": group.task.to_dict(), "group_id": group.group_id,
                        "dataset": group.dataset,
                        "idle_timeout_s": self.idle_timeout_s, "policy_version": self.proxy.engine.policy_version}
        finally:
            if reaped:                      # outside the lock, and not before this client has its answer
                self._storer.submit(self._store_dropped, reaped).add_done_callback(_log_failure)

    def finish(self, episode_id: str, reward: float | None = None, final_answer: str | None = None,
               metadata: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
               error: str | None = None, token: str | None = None) -> dict[str, Any]:
        """End a running episode with a reward (or a final answer for the judge), or with an error.
        `token`: the `episode_token` that `begin` returned (None: an in-process caller holding the queue).

        Raises:
            EpisodeApiError: 404 unknown episode, 403 a missing or wrong token, 409 already finished, 410
                abandoned or aborted, 400 a non-finite reward or no reward without a judge (the episode stays
                running: send it again), 503 `server_restarting` (the trainer stopped early).
        """
        if reward is not None and not math.isfinite(reward):
            raise EpisodeApiError(400, "invalid_reward", f"reward must be a finite number, got {reward!r}")
        if error is None and reward is None and self.judge is None:
            raise EpisodeApiError(400, "missing_reward", "send `reward` (this server has no judge to score a "
                                                         "final_answer); the episode is still running")
        with self._lock:
            self._refuse_if_stopping(self._client_of(episode_id))
            self._check_token(episode_id, token)
            run = self._take(episode_id)
            self._clients[run.client_id].last_seen = self._clock()
        calls = self.proxy.close_episode(run.endpoint)
        ep = Episode(episode_id, run.group.task, run.group.group_id, run.repeat, calls=calls, attempt=self.attempt,
                     duration_s=self._clock() - run.began)
        if error is not None:
            ep.error = f"the client reported an error:\n{error}"
        else:
            ep.output = WorkflowOutput(reward=reward, final_answer=final_answer, metadata=metadata or {},
                                       metrics=metrics or {})
            try:
                ep.reward = (float(reward) if reward is not None
                             else asyncio.run(call_judge(self.judge, ep.task, ep.output)))
            except JudgeError as exc:   # naming the judge: raised, or not a finite number
                ep.reward, ep.error = None, exc.error_text()
            except Exception:  # noqa: BLE001 - a broken judge fails the episode, never the server
                ep.reward, ep.error = None, traceback.format_exc()
        self.record(self.collecting_step, ep)            # durable before the client hears "finished"
        with self._changed:
            del run.group.running[run.repeat]
            run.group.finished[run.repeat] = ep
            self._ended[episode_id] = "finished"
            self._clients[run.client_id].finished += 1
            self.counts["finished" if ep.ok else "failed"] += 1
            self._changed.notify_all()
        return {"episode_id": episode_id, "status": "finished", "reward": ep.reward, "calls": len(calls),
                "error": ep.error is not None}

    def abort(self, episode_id: str, reason: str, token: str | None = None) -> dict[str, Any]:
        """Give a running episode up (recorded, never trained on; its place goes to the next client).
        Raises EpisodeApiError as `finish` does."""
        reason = f"aborted: {reason}"
        with self._changed:
            self._refuse_if_stopping(self._client_of(episode_id))
            self._check_token(episode_id, token)
            run = self._take(episode_id)
            self._end_dropped(run, reason)
        self._store_dropped([(run, reason)])
        return {"episode_id": episode_id, "status": "aborted"}

    def heartbeat(self, episode_id: str, token: str | None = None) -> dict[str, Any]:
        """Keep a running episode alive. Raises EpisodeApiError as `finish` does."""
        with self._lock:
            self._refuse_if_stopping(self._client_of(episode_id))
            self._check_token(episode_id, token)
            run = self._running.get(episode_id)
            if run is None:
                self._raise_ended(episode_id)
            run.last_seen = self._clients[run.client_id].last_seen = self._clock()
            return {"episode_id": episode_id, "status": "running"}

    def activity(self, token: str, delta: int) -> None:
        """A proxy request of the episode with api_key `token` started (+1) or ended (-1)."""
        with self._lock:
            run = self._by_token.get(token)
            if run is not None:
                run.in_flight += delta
                run.last_seen = self._clients[run.client_id].last_seen = self._clock()

    def status(self) -> dict[str, Any]:
        """The run's state for dashboards and waiting clients."""
        now = self._clock()
        with self._lock:
            return {"policy_version": self.proxy.engine.policy_version if self.proxy else 0,
                    "step": self.trained_step, "total_steps": self.total_steps, "finished": self.finished_run,
                    "datasets": sorted(self._gids),
                    "episodes": {"running": len(self._running), **self.counts},
                    "groups": {"open": len(self._groups),
                               "complete": sum(1 for g in self._groups.values() if len(g.finished) == self.num_repeat)},
                    "clients": {cid: {"begun": c.begun, "finished": c.finished, "abandoned": c.abandoned,
                                      "idle_s": round(now - c.last_seen, 1)} for cid, c in self._clients.items()}}

    # ---- the trainer's side -----------------------------------------------------------------------
    refills_while_running = False   # (a `RefillableSource`: dynamic sampling asks `collect_more` after `collect`)

    def collect(self, step: int) -> list[Episode]:
        """Block until `tasks_per_step` groups are complete; take them (oldest first) and return their
        episodes `[tasks_per_step * num_repeat]`, grouped. Idle episodes are abandoned while waiting."""
        return self.collect_more(step, self.tasks_per_step)

    def collect_more(self, step: int, num_tasks: int) -> list[Episode]:
        """As `collect`, for `num_tasks` groups (dynamic sampling's refill of `step`)."""
        while True:
            with self._changed:
                self.collecting_step = step
                reaped = self._reap_idle()
                done = sorted((g for g in self._groups.values() if len(g.finished) == self.num_repeat),
                              key=lambda g: g.order)
                if not reaped and len(done) >= num_tasks:
                    taken = done[:num_tasks]
                    for g in taken:
                        del self._groups[g.group_id]
                    self.collecting_step = step + 1
                    return [g.finished[r] for g in taken for r in range(self.num_repeat)]
                if not reaped:
                    self._changed.wait(timeout=0.5)
            self._store_dropped(reaped)           # outside the lock; then look again

    def step_done(self, step: int) -> None:
        """The update of `step` is applied; after the last step, `begin` answers 410 `run_finished`."""
        with self._lock:
            self.trained_step = step
            self.finished_run = step >= self.total_steps

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            return {"serve/policy_version": self.proxy.engine.policy_version if self.proxy else 0,
                    "serve/abandoned": self.counts["abandoned"] + self.counts["aborted"],
                    "serve/running": len(self._running), "serve/clients": len(self._clients),
                    "serve/adopted": self.counts["adopted"]}

    def flush(self) -> None:
        """Wait until every episode `begin` reaped so far is stored."""
        self._storer.submit(lambda: None).result()

    def close(self) -> None:
        """The trainer is done. After its last step `begin` answers 410 `run_finished`; when it stopped
        before (it raised, or was interrupted) every call answers 503 `server_restarting` with Retry-After,
        so that clients wait for the server restarted with `--resume` instead of exiting."""
        with self._lock:
            self.stopping = self.trained_step < self.total_steps
            self.finished_run = True                     # (and no more reaping)
        self._storer.shutdown(wait=True)                 # every reaped episode stored before the store closes

    def wait_until_clients_told(self, timeout_s: float, active_s: float, listen_s: float = 0.0) -> list[str]:
        """After `close()`: wait until every client heard from in the last `active_s` seconds has been answered
        410 `run_finished` or 503 `server_restarting`, at most `timeout_s` seconds. A client finishing its last
        episode, or sleeping between retries (up to 5 s), then learns that the run is over instead of finding
        the server gone (a refused connection, which a client retries for its whole `retry_for_s`). Clients
        silent for longer than `active_s` are taken for gone, except one with a model call in flight, however
        long its generation takes (a loaded engine, a long answer). `listen_s`: answer at least until this many
        seconds after `bind` (a resumed server that had nothing left to train: the killed attempt's clients
        are retrying, unknown to it). Returns the ids of the clients still untold."""
        deadline = self._clock() + timeout_s
        listen_until = min(self._serving_since + listen_s, deadline)
        with self._changed:
            while True:
                now = self._clock()
                calling = {r.client_id for r in self._running.values() if r.in_flight > 0}   # however long it takes
                untold = [cid for cid, c in self._clients.items()
                          if not c.told and (cid in calling or now - c.last_seen <= active_s)]
                if (not untold and now >= listen_until) or now >= deadline:
                    return untold
                self._changed.wait(timeout=min(0.2, deadline - now))

    # ---- internals (called with the lock held) -----------------------------------------------------
    def _place(self, task: dict[str, Any] | None, group_id: str | None, dataset: str | None) -> tuple[_Group, int]:
        if task is not None or group_id is not None:
            return self._own_place(task, group_id)
        for g in sorted(self._groups.values(), key=lambda g: g.order):
            if not g.own and dataset in (None, g.dataset) and (free := self._free(g)) is not None:
                return g, free
        while True:   # open the next group (one that earlier attempts' episodes fill completely: the one after)
            dataset_groups = sum(1 for g in self._groups.values() if not g.own)
            if sum(self._gids.values()) >= self.total_steps * self.tasks_per_step or \
                    dataset_groups >= 2 * self.tasks_per_step:
                raise EpisodeApiError(503, "no_task_available", "every open group's episodes are handed out; "
                                      "training is catching up, retry shortly", retry_after_s=1.0)
            name, task_ = self.sampler.next_task(dataset)
            k = self._gids[name]     # per dataset, so ids after a restart do not depend on the datasets' interleaving
            self._gids[name] += 1
            g = self._open(f"g{k}:{task_.task_id}", task_, False, name, f"{name}-g{k}" if self.multi else f"g{k}")
            if (free := self._free(g)) is not None:
                return g, free

    def _own_place(self, task: dict[str, Any] | None, group_id: str | None) -> tuple[_Group, int]:
        g = self._groups.get(group_id) if group_id is not None else None
        if g is None:
            if task is None:
                raise EpisodeApiError(400, "missing_task", f"group {group_id!r} is not open here: send its `task`")
            g = self._open(group_id or f"own:{task['task_id']}", Task(**task), True)
        free = self._free(g)
        if free is None:
            raise EpisodeApiError(409, "group_full", f"group {g.group_id!r} already has {self.num_repeat} episodes "
                                                     "(rollout.num_repeat) running or finished")
        return g, free

    def _free(self, g: _Group) -> int | None:
        return next((r for r in range(self.num_repeat) if r not in g.finished and r not in g.running), None)

    def _open(self, group_id: str, task: Task, own: bool, dataset: str | None = None, label: str = "") -> _Group:
        order = next(self._order)
        g = self._groups[group_id] = _Group(order, group_id, task, own, dataset, label or f"own{order}")
        self._fill_from_adoptable(g)
        return g

    def _fill_from_adoptable(self, g: _Group) -> None:
        for ep in self._adoptable.pop(g.group_id, []):
            own = ep.repeat_index       # its own place when free: the store's record and the group agree
            taken = own >= self.num_repeat or own in g.finished or own in g.running
            free = self._free(g) if taken else own
            if free is None:
                break
            ep.repeat_index = free
            g.finished[free] = ep
            self.counts["adopted"] += 1
        self._changed.notify_all()

    def _take(self, episode_id: str) -> _Running:
        run = self._running.pop(episode_id, None)
        if run is None:
            self._raise_ended(episode_id)
        del self._by_token[run.endpoint.api_key]
        self._show_in_flight()
        return run                    # its place stays taken until the caller finishes or drops it

    def _show_in_flight(self) -> None:
        """The step's progress display (ajet/progress.py): episodes in flight, in all and per client (the
        `SHOWN_CLIENTS` busiest, then how many more), e.g. "in flight 5 | per client alice 3, bob 2" (lock held)."""
        bar = active("step")
        if bar is None:
            return
        per = Counter(r.client_id for r in self._running.values())
        shown = ", ".join(f"{c} {n}" for c, n in per.most_common(SHOWN_CLIENTS))
        if len(per) > SHOWN_CLIENTS:
            shown += f", +{len(per) - SHOWN_CLIENTS} more"
        bar.set(**{"in flight": len(self._running), "per client": shown or None})

    def _client_of(self, episode_id: str) -> str | None:
        run = self._running.get(episode_id)
        return run.client_id if run is not None else None

    def _tell(self, client_id: str | None) -> None:
        """`client_id` is being answered that the run is over (or restarting): `wait_until_clients_told` may stop."""
        if client_id in self._clients:
            self._clients[client_id].told = True
            self._changed.notify_all()

    def _refuse_if_stopping(self, client_id: str | None) -> None:
        if self.stopping:
            self._tell(client_id)
            raise EpisodeApiError(503, "server_restarting", f"the trainer stopped after step {self.trained_step} of "
                                  f"{self.total_steps} (see the server's log); the server is restarted with --resume: "
                                  "retry after Retry-After (running episodes are forgotten, begin new ones)",
                                  retry_after_s=RESTART_RETRY_AFTER_S)

    def _check_token(self, episode_id: str, token: str | None) -> None:
        """404 for an id never handed out; 403 unless `token` is the episode's own (None: in-process caller)."""
        known = self._tokens.get(episode_id)
        if known is None:
            self._raise_ended(episode_id)            # 404
        if token is not None and not secrets.compare_digest(token.encode(), known.encode()):
            raise EpisodeApiError(403, "wrong_episode_token" if token else "missing_episode_token",
                                  f"episode {episode_id!r}: send the `episode_token` that its begin returned in the "
                                  f"{TOKEN_HEADER} header (only the client that began an episode may end it)")

    def _raise_ended(self, episode_id: str) -> None:
        ended = self._ended.get(episode_id)
        if ended is None:
            raise EpisodeApiError(404, "episode_not_found", f"no running episode {episode_id!r} on this server "
                                  "(ids come from POST /ajet/v1/episodes; a restarted server forgets running ones)")
        if ended == "finished":
            raise EpisodeApiError(409, "episode_already_finished", f"episode {episode_id!r} is already finished")
        raise EpisodeApiError(410, "episode_abandoned", f"episode {episode_id!r} was {ended}; its task went to "
                                                        "another client, begin a new episode")

    def _reap_idle(self) -> list[tuple[_Running, str]]:
        """Abandon every idle episode at once (lock held, never released in between: a second reaper in
        another thread finds them gone, not half gone) and free their places; returns (run, reason) for
        `_store_dropped`, which the caller runs without the lock."""
        now = self._clock()
        reaped = []
        for run in [r for r in self._running.values() if r.in_flight == 0 and now - r.last_seen > self.idle_timeout_s]:
            reason = f"abandoned: no call or heartbeat for {self.idle_timeout_s:g}s (client {run.client_id})"
            self._end_dropped(self._take(run.episode_id), reason)
            reaped.append((run, reason))
        return reaped

    def _end_dropped(self, run: _Running, reason: str) -> None:
        """Mark an abandoned or aborted episode ended and free its place (lock held)."""
        del run.group.running[run.repeat]
        self._ended[run.episode_id] = reason
        self.counts["aborted" if reason.startswith("aborted") else "abandoned"] += 1
        self._clients[run.client_id].abandoned += 1
        self._changed.notify_all()

    def _store_dropped(self, dropped: list[tuple[_Running, str]]) -> None:
        """Close the endpoints of ended-and-dropped episodes and store them, never trained on (lock not held)."""
        for run, reason in dropped:
            calls = self.proxy.close_episode(run.endpoint)
            self.record(self.collecting_step, Episode(run.episode_id, run.group.task, run.group.group_id, run.repeat,
                                                      calls=calls, error=reason, attempt=self.attempt))


def _log_failure(future) -> None:
    if future.exception() is not None:   # an abandoned episode could not be stored (never trained on anyway)
        log.error("storing abandoned episodes failed", exc_info=future.exception())
