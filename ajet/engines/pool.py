"""`ServerPool`: one `Engine` over several rollout servers (verl's / Trinity's vLLM replicas), load-balanced and
sticky per conversation so each server's prefix cache keeps serving the episode it started.

The proxy calls `Engine.generate(prompt_ids, ...)` without naming the episode, so stickiness is keyed on the
prompt's opening tokens: every later call of an episode extends the first call's prompt token for token
(ajet's token-in-token-out rendering), hence starts with the same tokens and goes to the same server. A
prompt whose opening this pool has not seen goes to the server with the fewest requests in flight. The
episodes of one GRPO group share their opening (same task prompt), so they land together too, which is what
vLLM's automatic prefix caching rewards. (verl's own `AsyncLLMServerManager` does the same per `request_id`.)

A server that cannot be connected to (`ServerUnreachable`: nothing was sent) gets no calls for `retry_down_s`
seconds: the call goes to another server at once (its per-call seed makes that server sample the same tokens from
the same weights), and so do the conversations stuck to it. A call the server accepted and then lost (the server
killed mid-answer) fails with the server's error: its tokens may be half generated, so it is not sent again. With
every server down, a call fails at once with `ServerUnreachable` naming each.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from ajet.engines.base import Engine, TokenCallback
from ajet.engines.remote import ServerUnreachable
from ajet.llm_call import Completion, SamplingParams

_log = logging.getLogger(__name__)


class ServerPool:
    """An `Engine` that spreads calls over `engines` (e.g. one `RemoteEngine` per vLLM server).

    Args:
        engines: the servers' engines (at least one).
        affinity_tokens: how many opening prompt tokens identify a conversation (tokens).
        max_conversations: sticky entries kept (least recently used dropped first).
        retry_down_s: how long a server that could not be connected to gets no calls, seconds.

    Raises:
        ValueError: no engines.

    Attributes:
        down: server index -> why it is left out now (the connection error), for the servers left out.
    """

    def __init__(self, engines: list[Engine], affinity_tokens: int = 64, max_conversations: int = 100_000,
                 retry_down_s: float = 30.0):
        if not engines:
            raise ValueError("ServerPool needs at least one engine")
        self.engines = list(engines)
        self.affinity_tokens = affinity_tokens
        self.max_conversations = max_conversations
        self.in_flight = [0] * len(self.engines)      # requests running on each server
        self.served = [0] * len(self.engines)         # requests each server answered (for metrics/tests)
        self.retry_down_s = retry_down_s
        self.down: dict[int, str] = {}
        self._down_until = [0.0] * len(self.engines)   # time.monotonic() before which a server gets no calls
        self._sticky: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._policy_version = 0

    @property
    def policy_version(self) -> int:
        """The optimizer step of the weights every server holds (set by the backbone after a weight sync)."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._policy_version = value
        for e in self.engines:
            e.policy_version = value

    def server_for(self, prompt_ids: list[int], exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """The index of the server that serves `prompt_ids` `[prompt_len]` (and remembers the choice): its
        conversation's server, else (or when that one is down or in `exclude`) the least loaded one that is up.

        Raises:
            ServerUnreachable: every server is down or excluded.
        """
        now = time.monotonic()
        for j in [j for j in self.down if self._down_until[j] <= now]:   # time to try it again
            del self.down[j]
        up = [j for j in range(len(self.engines)) if j not in self.down and j not in exclude]
        if not up:
            raise ServerUnreachable("no rollout server can be reached: " + "; ".join(
                self.down.get(j, f"server {j} failed this call") for j in range(len(self.engines))))
        key = tuple(prompt_ids[:self.affinity_tokens])
        i = self._sticky.get(key)
        if i is None or i not in up:
            i = min(up, key=lambda j: (self.in_flight[j], self.served[j]))
            if key not in self._sticky and len(self._sticky) >= self.max_conversations:
                self._sticky.popitem(last=False)
        self._sticky[key] = i
        self._sticky.move_to_end(key)
        return i

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """`Engine.generate` on the server `server_for(prompt_ids)` picks; on another one when it cannot be
        connected to (see the module docstring). Errors are the last server's; `ServerUnreachable` when none is
        up."""
        tried: set[int] = set()
        while True:
            i = self.server_for(prompt_ids, tried)
            self.in_flight[i] += 1
            try:
                return await self.engines[i].generate(prompt_ids, params, on_tokens)
            except ServerUnreachable as exc:
                tried.add(i)
                if i not in self.down:
                    _log.warning("rollout server %d left out for %g s: %s", i, self.retry_down_s, exc)
                self.down[i] = str(exc)
                self._down_until[i] = time.monotonic() + self.retry_down_s
            finally:
                self.in_flight[i] -= 1
                self.served[i] += 1

    def raise_if_failed(self) -> None:
        """Check each server's engine (`Engine.raise_if_failed`).

        Raises:
            EngineUnavailable: the first engine whose server stopped.
        """
        for e in self.engines:
            e.raise_if_failed()

    async def aclose(self) -> None:
        """Close every server's client sessions."""
        for e in self.engines:
            close = getattr(e, "aclose", None)
            if close is not None:
                await close()
