"""`ServerPool`: one `Engine` over several rollout servers (verl's / Trinity's vLLM replicas), load-balanced and
sticky per conversation so each server's prefix cache keeps serving the episode it started.

The proxy calls `Engine.generate(prompt_ids, ...)` without naming the episode, so stickiness is keyed on the
prompt's opening tokens: every later call of an episode extends the first call's prompt token for token
(ajet's token-in-token-out rendering), hence starts with the same tokens and goes to the same server. A
prompt whose opening this pool has not seen goes to the server with the fewest requests in flight. The
episodes of one GRPO group share their opening (same task prompt), so they land together too, which is what
vLLM's automatic prefix caching rewards. (verl's own `AsyncLLMServerManager` does the same per `request_id`.)
"""

from __future__ import annotations

from collections import OrderedDict

from ajet.engines.base import Engine, TokenCallback
from ajet.llm_call import Completion, SamplingParams


class ServerPool:
    """An `Engine` that spreads calls over `engines` (e.g. one `RemoteEngine` per vLLM server).

    Args:
        engines: the servers' engines (at least one).
        affinity_tokens: how many opening prompt tokens identify a conversation (tokens).
        max_conversations: sticky entries kept (least recently used dropped first).
    Raises:
        ValueError: no engines.
    """

    def __init__(self, engines: list[Engine], affinity_tokens: int = 64, max_conversations: int = 100_000):
        if not engines:
            raise ValueError("ServerPool needs at least one engine")
        self.engines = list(engines)
        self.affinity_tokens = affinity_tokens
        self.max_conversations = max_conversations
        self.in_flight = [0] * len(self.engines)      # requests running on each server
        self.served = [0] * len(self.engines)         # requests each server answered (for metrics/tests)
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

    def server_for(self, prompt_ids: list[int]) -> int:
        """The index of the server that serves `prompt_ids` `[prompt_len]` (and remembers the choice)."""
        key = tuple(prompt_ids[:self.affinity_tokens])
        i = self._sticky.get(key)
        if i is None:
            i = min(range(len(self.engines)), key=lambda j: (self.in_flight[j], self.served[j]))
            if len(self._sticky) >= self.max_conversations:
                self._sticky.popitem(last=False)
        self._sticky[key] = i
        self._sticky.move_to_end(key)
        return i

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """`Engine.generate` on the server `server_for(prompt_ids)` picks (errors are that server's)."""
        i = self.server_for(prompt_ids)
        self.in_flight[i] += 1
        try:
            return await self.engines[i].generate(prompt_ids, params, on_tokens)
        finally:
            self.in_flight[i] -= 1
            self.served[i] += 1

    async def aclose(self) -> None:
        """Close every server's client sessions."""
        for e in self.engines:
            close = getattr(e, "aclose", None)
            if close is not None:
                await close()
