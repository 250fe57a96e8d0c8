"""The `Engine` protocol: what the proxy needs from a backbone's inference server.

An engine turns prompt token ids into sampled completion token ids with their logprobs
(token-in-token-out). The debug backbone's engine generates in-process with transformers; the verl
and trinity backbones wrap vLLM servers.

Queue time: an engine that queues requests (the debug engine, when more calls arrive than `max_batch_size` rows)
reports how long each call waited before it was admitted, so that an episode's timeout counts the episode's own
time, not the engine's queue. The proxy opens a `QueueTicket` around each `Engine.generate` (a context variable:
the protocol's signature stays as it is); the engine reads it with `queue_ticket()` when the request arrives and
calls `ticket.queued()` when it enqueues it and `ticket.admitted()` when generation starts for it (prefill).
Each episode's `EngineWait` sums the time during which at least one of its calls was queued. An engine that
never reports (vLLM servers: their queue is not visible over HTTP) leaves every call counted as the episode's
own time.
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Callable, Protocol, runtime_checkable

from ajet.llm_call import Completion, SamplingParams, TokenDelta

TokenCallback = Callable[[TokenDelta], None]


@runtime_checkable
class Engine(Protocol):
    """Generates completions for prompt token ids.

    Attributes:
        policy_version: the optimizer step of the weights currently served (0 = initial weights).
    """

    policy_version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """Sample one completion for `prompt_ids` `[prompt_len]`.

        `on_tokens`, when given, is called on the caller's event loop with each batch of newly sampled
        tokens while generation runs (the proxy streams them to the client); the deltas concatenate to the
        returned completion's ids. An engine that cannot stream may never call it: the proxy then streams
        the finished completion at once. An engine that queues requests reports this call's wait to
        `queue_ticket()`, when there is one (see the module docstring).

        Raises:
            ValueError: the prompt plus `params.max_tokens` does not fit the model's context.
            RuntimeError: the engine failed or was shut down.
        """
        ...

    def raise_if_failed(self) -> None:
        """Raise when generation cannot go on (a server the engine started has stopped); return otherwise.

        The trainer calls it after each step's rollout, so that a run whose engine died stops there with one
        line naming the cause. An engine that starts no server of its own has nothing to check (a no-op).

        Raises:
            EngineUnavailable: the engine's server stopped (its address, exit status and log).
        """
        ...


class EngineWait:
    """How long one episode's calls have waited in the engine's queue: the total time, seconds, during which at
    least one of its calls was queued (not yet admitted), so calls queued together count once. Thread-safe: the
    engine's worker thread reports admissions, the episode's runner reads it from its own event loop.

    Attributes:
        queued_calls: calls of the episode queued right now.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queued_calls = 0
        self._since = 0.0          # time.monotonic() at which queued_calls went from 0 to 1
        self._total = 0.0          # seconds of the intervals already closed

    def ticket(self) -> QueueTicket:
        """A ticket for one call (see `QueueTicket`)."""
        return QueueTicket(self)

    def seconds(self) -> float:
        """Seconds so far during which a call of the episode was queued (including a wait still going on)."""
        with self._lock:
            return self._total + (time.monotonic() - self._since if self.queued_calls else 0.0)

    def _enter(self, now: float) -> None:
        with self._lock:
            if self.queued_calls == 0:
                self._since = now
            self.queued_calls += 1

    def _leave(self, now: float) -> None:
        with self._lock:
            self.queued_calls -= 1
            if self.queued_calls == 0:
                self._total += max(0.0, now - self._since)


class QueueTicket:
    """One call's passage through an engine's queue: `queued()` when the engine enqueues it, `admitted()` when
    generation starts for it (the proxy also calls `admitted()` when `generate` returns or raises: a call
    cancelled or failed while queued stops counting). Each may be called from any thread; repeats are ignored.

    Attributes:
        waited_s: seconds this call spent queued (0 until it is admitted; 0 for an engine that never reports).
    """

    def __init__(self, wait: EngineWait):
        self._wait = wait
        self._lock = threading.Lock()
        self._queued_at: float | None = None
        self._done = False
        self.waited_s = 0.0

    def queued(self) -> None:
        """The engine has queued the call (it is waiting for a free row)."""
        with self._lock:
            if self._queued_at is not None or self._done:
                return
            self._queued_at = time.monotonic()
            self._wait._enter(self._queued_at)

    def admitted(self) -> None:
        """Generation starts for the call (or it left the queue otherwise)."""
        with self._lock:
            if self._done:
                return
            self._done = True
            if self._queued_at is not None:
                now = time.monotonic()
                self.waited_s = now - self._queued_at
                self._wait._leave(now)


_TICKET: contextvars.ContextVar[QueueTicket | None] = contextvars.ContextVar("ajet_queue_ticket", default=None)


def queue_ticket() -> QueueTicket | None:
    """The ticket of the call now entering `Engine.generate` (an engine reads it at the start of `generate`, in
    the caller's task), or None when the caller keeps no account (a call from outside the proxy)."""
    return _TICKET.get()


def set_queue_ticket(ticket: QueueTicket | None) -> contextvars.Token:
    """Make `ticket` the current task's ticket (the proxy, right before `Engine.generate`); returns the token
    for `contextvars.ContextVar.reset`."""
    return _TICKET.set(ticket)


def reset_queue_ticket(token: contextvars.Token) -> None:
    """Undo `set_queue_ticket` (with the token it returned)."""
    _TICKET.reset(token)


# Which agent role makes the call now entering `Engine.generate` (the `tuner.agent(...)` tag; "default" for calls
# made without one): an engine serving one LoRA adapter per role (`agents:` in the config) picks the call's adapter
# from it. A context variable, like the queue ticket, so that the protocol's signature stays as it is.
_AGENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ajet_calling_agent", default=None)


def calling_agent() -> str | None:
    """The agent tag of the call now entering `Engine.generate` (read at its start, in the caller's task), or None
    when the caller names none (a call from outside the proxy)."""
    return _AGENT.get()


def set_calling_agent(tag: str | None) -> contextvars.Token:
    """Make `tag` the current task's calling agent (the proxy, right before `Engine.generate`); returns the token
    for `reset_calling_agent`."""
    return _AGENT.set(tag)


def reset_calling_agent(token: contextvars.Token) -> None:
    """Undo `set_calling_agent` (with the token it returned)."""
    _AGENT.reset(token)
