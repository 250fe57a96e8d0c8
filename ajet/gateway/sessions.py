"""The gateway's sessions: one conversation each, its proxy episode, its feedback, and its way to training.

A session's life:

    open      the first request of a conversation: a proxy episode is opened for it (its calls are recorded
              there, token for token, exactly as `ajet --conf` records an episode's calls)
    closed    no request for `gateway.session_idle_s` (or `POST /v1/sessions/{id}/close`): the episode is closed
              and its calls are taken from the proxy; the session counts as closed (and, rated, as ready for
              training) only once it holds them, so a step never takes a session whose calls are still on
              their way (it would train on a call-less episode: no sample, and its reward in the baseline)
    rated     a reward arrived (`POST /v1/feedback`, before or after the close), or, when none came within
              `gateway.feedback_deadline_s` of the close and `gateway.on_no_feedback` is `judge`, the config's
              judge scored its last answer; with `drop` it is dropped instead (never trained on)
    taken     closed and rated: the trainer took it into a step (`take`); later feedback is refused (409)

Which session a request belongs to (`resolve`): the `X-Ajet-Session` header when given; else, for a Responses
request, the session of its `previous_response_id`; else the open session holding the call that the request's
messages continue (`ajet.proxy.prompt.find_parent`, the rule the proxy itself uses to build a prompt token-in-
token-out). The proxy then builds the request's prompt ids as that call's prompt ids + its sampled ids + the new
turns, so a request joins a session exactly when its prompt token ids extend an earlier response's prompt +
completion; anything else opens a new session.

Best-of-N (`gateway.n` > 1): every request of a session is sampled N times in one engine batch (the proxy's
`best_of` / `choose` hooks); the config's judge scores each candidate (`choose`: the request's last user message
as the task's query, the candidate's text as the final answer) and the highest score is answered (ties: the
first). The chosen candidate continues the conversation (it is the session's call; the next turn extends it);
each other candidate is a one-call episode of its own (`Candidate`, id `<session>~<k>`) whose reward is its judge
score. A session's GRPO group is the session plus every candidate of its requests (source.py).

Rows: a session is written to gateway.sqlite with its first recorded answer (in the same transaction), or with
its first feedback; a session that ends (closed, idle) before either, e.g. every request refused by the proxy or
abandoned by its client before the engine answered, leaves no row and is forgotten at its close, so the store
grows with the calls it records, not with the requests it receives.

Keys (`gateway.keys`): each session records the name of the api key that opened it (`key`). A client key's
request joins only sessions that key opened (by header, by `previous_response_id` or by prefix; another key's
session named in the header is a 403), and feedback, reading and closing take only its own sessions; an admin
key (`owner` None in these calls) may take any.

Thread model: the proxy's event loop calls `resolve`, `activity` and `recorded`; HTTP worker threads call
`feedback` and `close`; the reaper thread calls `tick`, the trainer `take`. One lock guards the state; SQLite
writes happen under it (each is one short transaction), so what a caller is answered is already durable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import logging
import math
import secrets
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ajet.gateway.store import GatewayStore, StoredSession
from ajet.llm_call import LLMCall
from ajet.proxy.prompt import find_parent
from ajet.task import Task
from ajet.workflow import WorkflowOutput

log = logging.getLogger(__name__)
MAX_QUERY_CHARS = 2000   # of the first user message kept as the session's task query
REWARD_RANGE = (-10.0, 10.0)   # gateway.reward_range's default


class GatewayError(Exception):
    """A refused gateway call: HTTP `status`, machine-readable `code`, a message saying what to fix, and the
    request field it is about (`param`)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


@dataclass
class Candidate:
    """A best-of-N candidate that was not answered: a one-call episode of its session's GRPO group.

    Attributes:
        episode_id: `<session id>~<k>` (k = 1, 2, ... over the session's candidates).
        response_id: the answered response it competed with.
        index: its sample index among the request's N (the seed offset).
        score: the judge's score (its reward), None when the judge failed (then it is not trained on).
        call: its recorded call (`episode_id` is the candidate's, `index` 0).
    """

    episode_id: str
    response_id: str
    index: int
    score: float | None
    call: LLMCall


@dataclass
class Session:
    """One conversation.

    Attributes:
        session_id: its id (the header's value, or generated: "s-" + 16 hex digits).
        query: its first user message (at most MAX_QUERY_CHARS characters): the task of its episode.
        endpoint: its open proxy episode (`EpisodeEndpoint`), None once its close began.
        calls: its recorded calls, in order (filled from the proxy when it closes).
        responses: response id -> the policy version that produced it.
        opened_at: clock time of its first request. stored: its `sessions` row is written (module docstring).
        last_seen: clock time of its last request start or end; closed_at: clock time of its close, set once
            its calls are taken from the proxy (None before: a closing session is still "open").
        reward, reward_source ("client" | "judge"), comment: its latest feedback.
        rated_at: clock time the reward arrived (sessions are trained in this order).
        taken: the trainer took it; dropped: why it was given up (never trained on).
        key: the name of the api key that opened it (None: no keys checked, or stored before keys existed).
    """

    session_id: str
    query: str
    found_by: str
    key: str | None = None
    endpoint: Any = None
    calls: list[LLMCall] = field(default_factory=list)
    responses: dict[str, int] = field(default_factory=dict)
    last_seen: float = 0.0
    in_flight: int = 0
    closed_at: float | None = None
    reward: float | None = None
    reward_source: str | None = None
    comment: str | None = None
    rated_at: float | None = None
    taken: bool = False
    dropped: str | None = None
    live_calls: list[tuple[int, LLMCall]] = field(default_factory=list)   # (recording order, call) while open
    candidates: list[Candidate] = field(default_factory=list)   # best-of-N: the unchosen candidates, in order
    picks: dict[str, dict[str, Any]] = field(default_factory=dict)   # response id -> {"chosen", "scores"}
    opened_at: float = 0.0
    stored: bool = False

    @property
    def state(self) -> str:
        """"open", "closed" (waiting for feedback), "rated" (closed with a reward: waiting for training),
        "open_rated" (a reward, still open), "trained" (taken by the trainer) or "dropped"."""
        if self.dropped:
            return "dropped"
        if self.taken:
            return "trained"
        if self.closed_at is None:
            return "open_rated" if self.reward is not None else "open"
        return "rated" if self.reward is not None else "closed"

    def to_dict(self) -> dict[str, Any]:
        """The session's state for `GET /v1/sessions/{id}`."""
        return {"session_id": self.session_id, "state": self.state, "found_by": self.found_by, "key": self.key,
                "calls": len(self.calls) if self.closed_at is not None else None, "responses": dict(self.responses),
                "reward": self.reward, "reward_source": self.reward_source, "comment": self.comment,
                "dropped": self.dropped,
                "candidates": [{"episode_id": c.episode_id, "response_id": c.response_id, "index": c.index,
                                "score": c.score, "text": message_text(c.call.response_message.get("content"))}
                               for c in self.candidates],
                "picks": dict(self.picks)}


class SessionBook:
    """Every session of the gateway and their durable record (see the module docstring).

    Args:
        proxy: the `ProxyServer` whose episodes hold the sessions' calls (`open_episode` / `close_episode`).
        store: the durable record (`GatewayStore`).
        idle_s: a session without a request for this long closes, seconds.
        deadline_s: a closed session without feedback this long after its close is judged or dropped, seconds.
        on_no_feedback: "judge" or "drop".
        judge: `judge(task, WorkflowOutput) -> float` (sync or async) for "judge", else None.
        clock: wall-clock seconds (`time.time`; durable times survive a restart).
        n: best-of-N samples per request (1: none; > 1 needs `judge`).
        retention_s: a trained or dropped session closed longer ago than this is deleted from gateway.sqlite
            and forgotten (its responses' feedback then gets 404), seconds; None keeps every session.
        reward_range: (low, high), the rewards accepted (`gateway.reward_range`): a client's reward outside it
            (NaN and +-inf included) is a 400, a judge's score outside it drops the session or the candidate.
    """

    def __init__(self, proxy, store: GatewayStore, idle_s: float, deadline_s: float, on_no_feedback: str,
                 judge: Callable | None = None, clock: Callable[[], float] = time.time, n: int = 1,
                 retention_s: float | None = None, reward_range: tuple[float, float] = REWARD_RANGE):
        if n > 1 and judge is None:
            raise ValueError("best-of-N (n > 1) needs a judge to choose the answer")
        self.proxy, self.store, self.idle_s, self.deadline_s = proxy, store, idle_s, deadline_s
        self.on_no_feedback, self.judge, self._clock, self.n = on_no_feedback, judge, clock, n
        self.retention_s, self.reward_range = retention_s, tuple(reward_range)
        self._judged: dict[str, tuple[int, list[float | None]]] = {}   # response id -> (pick, scores), until recorded
        self._sessions: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}       # open sessions by their proxy api_key
        self._by_response: dict[str, Session] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)   # notified when a session becomes ready for training
        self.counts = {"opened": 0, "closed": 0, "feedback": 0, "judged": 0, "dropped": 0, "judge_failed": 0,
                       "best_of_requests": 0, "best_of_judge_failed": 0, "deleted": 0, "forgotten": 0}

    # ---- restart -----------------------------------------------------------------------------------
    def load(self, stored: dict[str, StoredSession], trained: set[str]) -> None:
        """Rebuild the sessions of an earlier attempt (`GatewayStore.sessions()`): a session still open when it
        stopped is closed now ("restart"), with every call it had recorded; `trained` are the session ids a
        live update already trained on (from the trajectory store's ledger)."""
        now = self._clock()
        with self._lock:
            for sid, st in stored.items():
                s = Session(sid, st.query, st.found_by, key=st.key_name, last_seen=st.opened_at,
                            calls=[LLMCall.from_dict(c) for c in st.calls],
                            responses=dict(st.responses), opened_at=st.opened_at, stored=True)
                if st.closed_at is None:
                    self.store.close_session(sid, "restart", now)
                s.closed_at = st.closed_at if st.closed_at is not None else now
                if st.feedback:
                    last = st.feedback[-1]
                    s.reward, s.reward_source, s.comment = last["reward"], last["source"], last["comment"]
                    s.rated_at = last["received_at"]
                s.dropped, s.taken = st.dropped, sid in trained
                s.picks = dict(st.picks)
                s.candidates = [Candidate(c["episode_id"], c["response_id"], c["index"], c["score"],
                                          LLMCall.from_dict(c["call"]))
                                for c in st.candidates]
                self._sessions[sid] = s
                for rid in s.responses:
                    self._by_response[rid] = s
            self.changed.notify_all()

    # ---- requests (the proxy's event loop) ----------------------------------------------------------
    def resolve(self, header: str | None, messages: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None,
                previous_response_id: str | None = None, key: str | None = None, admin: bool = True) -> Session:
        """The open session a request belongs to, opened when it is new (see the module docstring), counted as
        in flight (never idle) until the caller's `activity(session, -1)`.

        Args:
            header: the `X-Ajet-Session` value, or None.
            messages, tools: the request in the proxy's wire form (None when it could not be parsed: the proxy
                answers its 400 in a session of its own).
            key: the name of the caller's api key: a new session records it. admin: False for a client key,
                whose request joins only sessions opened with `key`.

        Raises:
            GatewayError: 400 `invalid_session` for a header that is not 1-200 printable ASCII characters,
                403 `session_forbidden` for a client key's header naming another key's session,
                409 `session_closed` for a header naming a closed session.
        """
        with self._lock:
            s = self._resolve(header, messages, tools, previous_response_id, None if admin else key, key)
            s.in_flight += 1
            s.last_seen = self._clock()
            return s

    def _resolve(self, header: str | None, messages: list[dict[str, Any]] | None,
                 tools: list[dict[str, Any]] | None, previous_response_id: str | None, owner: str | None = None,
                 key: str | None = None) -> Session:
        """`resolve` with the lock held; `owner`: only sessions of this key are joined (None: any)."""
        if header is not None:
            if not (0 < len(header) <= 200 and header.isascii() and header.isprintable()):
                raise GatewayError(400, "invalid_session", "the X-Ajet-Session header must be 1-200 printable "
                                   "ASCII characters", "X-Ajet-Session")
            s = self._sessions.get(header)
            if s is None:
                return self._open(header, messages, "header", key)
            _check_owner(s, owner)
            if s.endpoint is None:
                state = s.state if s.closed_at is not None else "closing"
                raise GatewayError(409, "session_closed", f"session {header!r} is closed ({state}); send a new "
                                   "X-Ajet-Session for the next conversation", "X-Ajet-Session")
            return s
        if previous_response_id is not None:
            s = self._by_response.get(previous_response_id)
            if s is not None and s.endpoint is not None and owner in (None, s.key):
                return s
        if messages:
            parent = self._parent(messages, tools, owner)
            if parent is not None:
                return parent
        return self._open(None, messages, "new", key)

    def _parent(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                owner: str | None = None) -> Session | None:
        """The open session (of key `owner`; None: of any key) holding the latest call that `messages` continue
        (lock held)."""
        history = sorted((x for s in self._sessions.values() if s.endpoint is not None and owner in (None, s.key)
                          for x in s.live_calls), key=lambda x: x[0])   # in recording order: find_parent prefers the latest
        call, _reason, _by = find_parent(messages, tools, [c for _, c in history])
        return None if call is None else self._sessions.get(call.episode_id)

    def _open(self, session_id: str | None, messages: list[dict[str, Any]] | None, found_by: str,
              key: str | None = None) -> Session:
        sid = session_id or "s-" + secrets.token_hex(8)
        query = next((message_text(m.get("content")) for m in messages or [] if m.get("role") == "user"),
                     "")[:MAX_QUERY_CHARS]
        now = self._clock()
        s = Session(sid, query, found_by, key=key, endpoint=self.proxy.open_episode(sid), last_seen=now,
                    opened_at=now)
        self._sessions[sid] = self._by_token[s.endpoint.api_key] = s
        self.counts["opened"] += 1
        return s

    def activity(self, session: Session, delta: int) -> None:
        """A request of `session` started (+1) or ended (-1): it is not idle meanwhile."""
        with self._lock:
            session.in_flight += delta
            session.last_seen = self._clock()

    def recorded(self, episode_id: str, response_id: str, calls: list[LLMCall],
                 others: list[LLMCall] | None = None) -> int | None:
        """A response of the session `episode_id` was generated (the proxy's `on_recorded`): remember its id and
        policy version (the newest that sampled one of its tokens) and commit its calls, with best-of-N's
        unchosen candidates (`others`, each becoming a `Candidate` with its judge score). Returns the version
        (None for an episode that is no session: the gateway's own utility episode)."""
        with self._lock:
            s = self._sessions.get(episode_id)
            pick, scores = self._judged.pop(response_id, (None, []))
            if s is None:
                return None
            version = max((max(c.token_versions or [c.policy_version]) for c in calls), default=0)
            cands = []
            for c in others or []:
                k = int(c.call_id.rsplit(".", 1)[1])            # the proxy's "<call id>.<sample index>"
                eid = f"{s.session_id}~{len(s.candidates) + len(cands) + 1}"
                call = dataclasses.replace(c, call_id=f"call-{eid}-0", episode_id=eid, index=0)
                cands.append(Candidate(eid, response_id, k, scores[k] if k < len(scores) else None, call))
            picked = {"chosen": pick, "scores": scores} if pick is not None else None
            self.store.add_response(s.session_id, response_id, version, [c.to_dict() for c in calls],
                                    [(c.episode_id, c.index, c.score, c.call.to_dict()) for c in cands], picked,
                                    opened=None if s.stored else (s.opened_at, s.query, s.found_by, s.key))
            s.stored = True
            s.candidates += cands
            if picked is not None:
                s.picks[response_id] = picked
            s.responses[response_id] = version
            self._by_response[response_id] = s
            if s.endpoint is not None:
                s.live_calls += [(next(self._seq), c) for c in calls]
            return version

    def best_of(self, ep) -> int:
        """How many candidates the proxy samples for a request of proxy episode `ep`: `n` for a session's."""
        return self.n if ep.episode_id in self._sessions else 1

    async def choose(self, ep, turn, prep, choices) -> int:
        """Best-of-N: score every candidate with the judge (concurrently; a sync judge in a worker thread)
        and return the index of the highest score (ties: the lowest index; a candidate whose judge call
        failed or returned a number outside `reward_range` scores None and is never chosen unless all failed,
        then 0). The scores are kept for `recorded` under the turn's response id."""
        messages = prep.messages or []
        query = next((message_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        task = Task(task_id=ep.episode_id, query=query[:MAX_QUERY_CHARS],
                    metadata={"session": ep.episode_id, "messages": messages})

        async def score(c) -> float | None:
            output = WorkflowOutput(final_answer=message_text(c.message.get("content")),
                                    metadata={"message": c.message})
            try:
                if inspect.iscoroutinefunction(self.judge) or inspect.iscoroutinefunction(
                        getattr(self.judge, "__call__", None)):
                    value = await self.judge(task, output)
                else:
                    value = await asyncio.to_thread(self.judge, task, output)
                    if inspect.isawaitable(value):
                        value = await value
                value = float(value)
                return value if self.in_range(value) else None
            except Exception:  # noqa: BLE001 - a broken judge call: this candidate is not chosen, not trained
                log.warning("gateway: the judge failed on a best-of-N candidate of %s:\n%s", ep.episode_id,
                            traceback.format_exc())
                return None

        scores = list(await asyncio.gather(*(score(c) for c in choices)))
        valid = [(v, -i) for i, v in enumerate(scores) if v is not None]
        pick = -max(valid)[1] if valid else 0
        with self._lock:
            self.counts["best_of_requests"] += 1
            self.counts["best_of_judge_failed"] += sum(v is None for v in scores)
            self._judged[turn.response_id] = (pick, scores)
        return pick

    def in_range(self, reward: float) -> bool:
        """Whether `reward` is a finite number within `reward_range` (every reward that may train passes here)."""
        lo, hi = self.reward_range
        return math.isfinite(reward) and lo <= reward <= hi

    def session_of_response(self, response_id: str) -> Session | None:
        with self._lock:
            return self._by_response.get(response_id)

    def version_of(self, response_id: str) -> int | None:
        with self._lock:
            s = self._by_response.get(response_id)
            return None if s is None else s.responses.get(response_id)

    # ---- feedback and closing (HTTP worker threads) -------------------------------------------------
    def feedback(self, session_id: str | None, response_id: str | None, reward: float,
                 comment: str | None, key: str | None = None, owner: str | None = None) -> dict[str, Any]:
        """Record `reward` for a session (named, or found by one of its response ids), sent with the api key
        named `key`; durable on return. A later reward replaces an earlier one until the session is trained.
        `owner`: a client key's name (only its own sessions); None: any session.

        Raises:
            GatewayError: 400 `reward_out_of_range` (outside `reward_range`, or not finite); 403
                `session_forbidden` (another key's session, with `owner`); 404
                `session_not_found` / `response_not_found`; 409 `session_trained` (the trainer took it already);
                410 `session_dropped` (its feedback deadline passed).
        """
        if not self.in_range(reward):
            lo, hi = self.reward_range
            raise GatewayError(400, "reward_out_of_range", f"reward {reward:g} is outside gateway.reward_range "
                               f"[{lo:g}, {hi:g}]: send a finite reward within it (or widen gateway.reward_range)",
                               "reward")
        with self.changed:
            if response_id is not None:
                s = self._by_response.get(response_id)
                if s is None:
                    raise GatewayError(404, "response_not_found", f"no response {response_id[:100]!r} on this gateway "
                                       "(the id is the answer's `id` and its X-Ajet-Response-Id header)", "response_id")
                if session_id is not None and session_id != s.session_id:
                    raise GatewayError(400, "session_mismatch", f"response {response_id[:100]!r} belongs to session "
                                       f"{s.session_id!r}, not {session_id[:100]!r}: send one of the two", "session_id")
            else:
                s = self._sessions.get(session_id or "")
                if s is None:
                    raise GatewayError(404, "session_not_found", f"no session {str(session_id)[:100]!r} on this "
                                       "gateway (the id is every answer's X-Ajet-Session header)", "session_id")
            _check_owner(s, owner)
            if s.taken:
                raise GatewayError(409, "session_trained", f"session {s.session_id!r} was already trained on with reward "
                                   f"{s.reward} ({s.reward_source}); feedback cannot change it any more")
            if s.dropped:
                raise GatewayError(410, "session_dropped", f"session {s.session_id!r} was dropped ({s.dropped}); "
                                   "raise gateway.feedback_deadline_s to accept later feedback")
            self._persist(s)
            self.store.add_feedback(s.session_id, reward, comment, "client", response_id, key_name=key)
            s.reward, s.reward_source, s.comment, s.rated_at = reward, "client", comment, self._clock()
            self.counts["feedback"] += 1
            self.changed.notify_all()
            return {"session_id": s.session_id, "state": s.state, "reward": reward}

    def close(self, session_id: str, reason: str = "closed by the client", owner: str | None = None) -> dict[str, Any]:
        """Close an open session now (a client that knows the conversation is over); `owner`: a client key's name
        (only its own sessions). Raises GatewayError 404, 403 `session_forbidden`."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                raise GatewayError(404, "session_not_found", f"no session {session_id[:100]!r} on this gateway",
                                   "session_id")
            _check_owner(s, owner)
            ending = self._end(s, reason)
        if ending is not None:
            self._finish_close(s, *ending)
        return {"session_id": s.session_id, "state": s.state}

    def get(self, session_id: str, owner: str | None = None) -> dict[str, Any]:
        """A session's state (`Session.to_dict`); `owner`: a client key's name (only its own sessions). Raises
        GatewayError 404, 403 `session_forbidden`."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                raise GatewayError(404, "session_not_found", f"no session {session_id[:100]!r} on this gateway",
                                   "session_id")
            _check_owner(s, owner)
            return s.to_dict()

    # ---- time passing (the reaper thread) -----------------------------------------------------------
    def tick(self) -> None:
        """Close idle sessions; judge or drop closed sessions past their feedback deadline."""
        now = self._clock()
        with self._lock:
            idle = [(s, self._end(s, f"idle for {self.idle_s:g}s")) for s in self._sessions.values()
                    if s.endpoint is not None and s.in_flight == 0 and now - s.last_seen > self.idle_s]
        for s, ending in idle:
            try:
                self._finish_close(s, *ending)
            except Exception:  # noqa: BLE001 - dropped by _finish_close; the other idle sessions still close
                log.warning("gateway: closing idle session %s failed:\n%s", s.session_id, traceback.format_exc())
        with self._lock:
            late = [s for s in self._sessions.values() if s.closed_at is not None and s.reward is None
                    and not s.dropped and not s.taken and now - s.closed_at > self.deadline_s]
        for s in late:
            if self.on_no_feedback == "judge":
                self._judge(s)
            else:
                self._drop(s, f"no feedback within {self.deadline_s:g}s of its close")
        if self.retention_s is not None:
            self._expire(now)

    def _expire(self, now: float) -> None:
        """Delete trained and dropped sessions closed more than `retention_s` ago, from gateway.sqlite and memory."""
        with self._lock:
            old = [s for s in self._sessions.values() if (s.taken or s.dropped) and s.closed_at is not None
                   and now - s.closed_at > self.retention_s]
            if not old:
                return
            self.store.delete_sessions([s.session_id for s in old])
            for s in old:
                del self._sessions[s.session_id]
                for rid in s.responses:
                    self._by_response.pop(rid, None)
            self.counts["deleted"] += len(old)

    def release(self, sessions: list[Session]) -> None:
        """Forget the calls of sessions the trainer has recorded (trajectories.sqlite holds them now; gateway.sqlite
        until retention deletes them): a long-running gateway's memory does not grow with what it trained."""
        with self._lock:
            for s in sessions:
                s.calls, s.live_calls, s.candidates = [], [], []

    def release_rated(self) -> None:
        """Forget the calls of closed, rated sessions no update will take (after training ended); gateway.sqlite
        keeps them (`--resume` reads them back)."""
        with self._lock:
            for s in self._sessions.values():
                if s.calls and s.state == "rated":
                    s.calls, s.live_calls, s.candidates = [], [], []

    def _persist(self, s: Session) -> None:
        """Write `s`'s `sessions` row if it is not written yet (lock held)."""
        if not s.stored:
            self.store.open_session(s.session_id, s.query, s.found_by, at=s.opened_at, key_name=s.key)
            s.stored = True

    def _end(self, s: Session, reason: str) -> tuple[Any, float] | None:
        """Begin closing `s` (lock held): no request joins it from now, and its close is durable (a session
        without a row gets none: see the module docstring). Returns (its endpoint, the close's clock time) for
        `_finish_close`, None when its close already began."""
        if s.endpoint is None:
            return None
        endpoint, s.endpoint, at = s.endpoint, None, self._clock()
        del self._by_token[endpoint.api_key]
        if s.stored:
            self.store.close_session(s.session_id, reason)
        self.counts["closed"] += 1
        return endpoint, at

    def _finish_close(self, s: Session, endpoint, at: float) -> None:
        """Take the closing episode's calls from the proxy (lock not held: the close runs on its event loop, which
        may be busy for a while), then mark `s` closed at `at` together with them: only then can it be ready for
        training (`ready`, `take`) or judged. When the proxy fails to hand them over, `s` is dropped (never trained
        on without its calls) and the error raised. A session without a row (no answer recorded, no feedback) is
        forgotten instead: nothing of it reached the engine's record."""
        try:
            calls = self.proxy.close_episode(endpoint)
        except Exception:
            with self._lock:
                s.closed_at, s.dropped = at, "its calls could not be taken from the proxy"
                if s.stored:
                    self.store.drop_session(s.session_id, s.dropped)
                self.counts["dropped"] += 1
            raise
        with self._lock:
            s.calls, s.live_calls, s.closed_at = calls, [], at
            if not s.stored and not calls and s.in_flight == 0:
                if self._sessions.get(s.session_id) is s:
                    del self._sessions[s.session_id]
                self.counts["forgotten"] += 1
                return
            self._persist(s)
            self.changed.notify_all()

    def _judge(self, s: Session) -> None:
        task, output = self.task_of(s), WorkflowOutput(final_answer=_last_answer(s.calls))
        try:
            score = self.judge(task, output)
            reward = float(asyncio.run(score) if inspect.isawaitable(score) else score)
            if not self.in_range(reward):
                lo, hi = self.reward_range
                raise ValueError(f"the judge's reward {reward} is outside gateway.reward_range [{lo:g}, {hi:g}]")
        except Exception:  # noqa: BLE001 - a broken judge drops the session, never stops the gateway
            log.warning("gateway: the judge failed on session %s:\n%s", s.session_id, traceback.format_exc())
            self.counts["judge_failed"] += 1
            self._drop(s, "the judge failed")
            return
        with self._lock:
            if s.reward is not None or s.dropped or s.taken:   # feedback arrived while the judge ran: it wins
                return
            self.store.add_feedback(s.session_id, reward, None, "judge")
            s.reward, s.reward_source, s.rated_at = reward, "judge", self._clock()
            self.counts["judged"] += 1
            self.changed.notify_all()

    def _drop(self, s: Session, reason: str) -> None:
        with self._lock:
            if s.reward is not None or s.dropped or s.taken:
                return
            self.store.drop_session(s.session_id, reason)
            s.dropped = reason
            s.calls = []                   # (kept in gateway.sqlite)
            self.counts["dropped"] += 1

    # ---- the trainer ---------------------------------------------------------------------------------
    def ready(self) -> int:
        """How many sessions are closed, rated and not yet taken (lock held by the caller or not: a read)."""
        return sum(1 for s in self._sessions.values() if s.state == "rated")

    def take(self, n: int) -> list[Session]:
        """The `n` sessions rated first among those closed, rated and not taken, marked taken (lock held)."""
        ready = sorted((s for s in self._sessions.values() if s.state == "rated"), key=lambda s: s.rated_at)[:n]
        for s in ready:
            s.taken = True
        return ready

    def task_of(self, s: Session) -> Task:
        """The task of a session's episode: its first user message, no reference answer."""
        return Task(task_id=s.session_id, query=s.query, metadata={"session": s.session_id, "found_by": s.found_by})

    def counts_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def states(self) -> dict[str, int]:
        """How many sessions are in each state (see `Session.state`)."""
        with self._lock:
            out: dict[str, int] = {}
            for s in self._sessions.values():
                out[s.state] = out.get(s.state, 0) + 1
            return out

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            states = [s.state for s in self._sessions.values()]
            return {"gateway/open": sum(st in ("open", "open_rated") for st in states),
                    "gateway/waiting_feedback": states.count("closed"), "gateway/ready": states.count("rated"),
                    **{f"gateway/{k}": v for k, v in self.counts.items()}}


def _check_owner(s: Session, owner: str | None) -> None:
    """Raise GatewayError 403 `session_forbidden` when `owner` (a client key's name; None: an admin key) did not
    open session `s`."""
    if owner is not None and s.key != owner:
        raise GatewayError(403, "session_forbidden", f"session {s.session_id!r} was opened with another api key: "
                           f"key {owner!r} (a client key) may use only the sessions it opened; an admin key may use "
                           "any", "session_id")


def message_text(content: Any) -> str:
    """The text of a chat message's `content` (OpenAI wire form): a string as is, the text parts of a list joined
    by spaces, "" for None."""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _last_answer(calls: list[LLMCall]) -> str:
    """The text of the session's last answer (what a judge reads)."""
    return message_text(calls[-1].response_message.get("content")) if calls else ""
