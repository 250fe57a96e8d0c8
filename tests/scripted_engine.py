"""An engine that answers instantly with scripted replies (for proxy tests; the proxy stays real).

Each reply text is tokenized with the policy tokenizer and closed with the end-of-turn id, so the
proxy, template, tool-call parser and tracker all run on real token ids.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

from ajet.llm_call import Completion, SamplingParams, TokenDelta


class ScriptedEngine:
    def __init__(self, tokenizer, replies: list[str | list[int]]):
        """replies: texts (tokenized, then end-of-turn appended) or exact id lists (returned as given).
        With `on_tokens`, tokens are announced one at a time, yielding to the event loop in between."""
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.policy_version = 0
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None) -> Completion:
        reply = self.replies[len(self.prompts) % len(self.replies)]
        self.prompts.append(list(prompt_ids))
        if isinstance(reply, list):
            ids = list(reply)
        else:
            ids = self.tokenizer.encode(reply, add_special_tokens=False)[: params.max_tokens - 1]
            ids.append(self.tokenizer.eos_token_id)
        self.sampled.append(ids)
        tops = [[(t, -0.5), (t + 1, -1.5)][:params.top_logprobs] for t in ids] if params.top_logprobs else None
        if on_tokens is not None:
            for k, t in enumerate(ids):
                on_tokens(TokenDelta([t], [-0.5], tops[k:k + 1] if tops else None))
                await asyncio.sleep(0)
        return Completion(ids, [-0.5] * len(ids), "stop", self.policy_version, tops)


class FailingEngine(ScriptedEngine):
    """A ScriptedEngine that raises `RuntimeError` for the next `fail_next` calls (set it at any time), and
    returns a malformed completion (token_ids=None, a bug in an engine) while `broken` is true."""

    def __init__(self, tokenizer, replies: list[str | list[int]]):
        super().__init__(tokenizer, replies)
        self.fail_next = 0
        self.broken = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None) -> Completion:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("CUDA error: device-side assert triggered")
        if self.broken:
            return Completion(None, [], "stop", self.policy_version)  # type: ignore[arg-type]
        return await super().generate(prompt_ids, params, on_tokens)


@contextmanager
def scripted_proxy(tokenizer, replies: list[str], max_tokens: int = 64):
    """A started `ProxyServer` over a `ScriptedEngine` answering `replies` in order (T=1, at most
    `max_tokens` tokens); yields (proxy, engine) and stops the proxy after."""
    from ajet.proxy.server import ProxyServer

    engine = ScriptedEngine(tokenizer, replies)
    server = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=max_tokens)).start()
    try:
        yield server, engine
    finally:
        server.stop()
