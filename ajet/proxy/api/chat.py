"""The OpenAI Chat Completions API (`POST /v1/chat/completions`): the turn type's own wire format.

The request is validated as it comes (`ChatCompletionRequest`); the answer is a `chat.completion`
body, or `chat.completion.chunk` server-sent events ending with `data: [DONE]` when `stream` is set
(with `logprobs` and `n` choices, as OpenAI sends them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ajet.llm_call import TokenDelta
from ajet.proxy.api import Api
from ajet.proxy.schema import ChatCompletionRequest
from ajet.proxy.stream import IncrementalContent, chunk, sse, tool_call_chunks
from ajet.proxy.turn import Choice, OpenEpisode, Prepared, Turn
from ajet.proxy.wire import validated


class ChatApi(Api):
    """Chat Completions: `parse` validates the body as the turn request itself."""

    name = "chat"
    id_prefix = "chatcmpl-"
    routes = (("/v1/chat/completions", "POST", "serve"), ("/v1/models", "GET", "models"))

    def parse(self, data: dict[str, Any], ep: OpenEpisode) -> tuple[ChatCompletionRequest, None]:
        return validated(ChatCompletionRequest, data), None

    def body(self, turn: Turn, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
        req = prep.req
        return {"id": turn.response_id, "object": "chat.completion", "created": turn.created, "model": req.model,
                "choices": [{"index": c.index, "message": c.message, "finish_reason": c.finish_reason,
                             "logprobs": {"content": self._logprob_entries(c.completion.token_ids, c.completion.logprobs,
                                                                          c.completion.top_logprobs)}
                             if req.logprobs else None} for c in choices],
                "usage": usage(choices)}

    async def events(self, turn: Turn, prep: Prepared, events: asyncio.Queue, first):
        req = prep.req
        base = {"id": turn.response_id, "object": "chat.completion.chunk", "created": turn.created, "model": req.model}
        want_logprobs = bool(req.logprobs)
        states = [IncrementalContent(turn.parse_tools, turn.stop) for _ in range(turn.n)]
        pending_lp: list[list[dict[str, Any]]] = [[] for _ in range(turn.n)]   # entries not yet sent
        ids_so_far: list[list[int]] = [[] for _ in range(turn.n)]
        out = [chunk(base, i, {"role": "assistant", "content": ""}) for i in range(turn.n)]   # sent per wake-up
        event = first
        while event is not None:
            batch = [event]
            while not events.empty():           # coalesce whatever else is already here
                batch.append(events.get_nowait())
            touched: set[int] = set()
            for ev in batch:
                if ev is None:
                    break
                i, item = ev
                if isinstance(item, TokenDelta):
                    ids_so_far[i] += item.token_ids
                    if want_logprobs:
                        pending_lp[i] += self._logprob_entries(item.token_ids, item.logprobs, item.top_logprobs)
                    touched.add(i)
                else:                                   # choice i finished
                    out.append(self._finish_choice(base, states[i], item, pending_lp[i], want_logprobs, ids_so_far[i]))
                    pending_lp[i] = []
                    touched.discard(i)
            for i in touched:
                delta = states[i].update(turn.forced + self.proxy.decode(ids_so_far[i]))
                if delta:
                    out.append(chunk(base, i, {"content": delta}, logprobs=pending_lp[i] if want_logprobs else None))
                    pending_lp[i] = []
            if batch[-1] is None:
                break
            if out:
                yield "".join(out)              # one write per wake-up, however many chunks
                out = []
            event = await events.get()
        if (err := turn.error()) is not None:   # the engine failed, or the episode was closed, mid-stream
            out.append(self.error_event(err))
        else:
            if req.stream_options and req.stream_options.include_usage:
                out.append(sse({**base, "choices": [], "usage": usage(turn.task.result())}))
            out.append(sse("[DONE]"))
        yield "".join(out)

    def _finish_choice(self, base, state: IncrementalContent, c: Choice, pending_lp, want_logprobs: bool,
                       streamed_ids: list[int]) -> str:
        """The last chunks of choice `c`: the content not yet sent, its tool calls, its finish reason."""
        if want_logprobs:   # tokens never announced by the engine (a non-streaming engine) get entries now
            rest = c.completion.token_ids[len(streamed_ids):]
            tops = c.completion.top_logprobs[len(streamed_ids):] if c.completion.top_logprobs else None
            pending_lp = pending_lp + self._logprob_entries(rest, c.completion.logprobs[len(streamed_ids):], tops)
        out = []
        rest_text = state.finish(c.message["content"])
        if rest_text or pending_lp:
            out.append(chunk(base, c.index, {"content": rest_text} if rest_text else {},
                             logprobs=pending_lp if want_logprobs else None))
        out += tool_call_chunks(base, c.index, c.message.get("tool_calls") or [])
        out.append(chunk(base, c.index, {}, c.finish_reason))
        return "".join(out)

    def _logprob_entries(self, ids: list[int], logprobs: list[float],
                         tops: list[list[tuple[int, float]]] | None) -> list[dict[str, Any]]:
        """OpenAI `logprobs.content` entries for sampled tokens (logprobs under the sampling temperature)."""
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = self.proxy.tokenizer.decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (tops[k] if tops else [])]}
                for k, (t, lp) in enumerate(zip(ids, logprobs))]


def usage(choices: list[Choice]) -> dict[str, int]:
    """OpenAI `usage`: prompt tokens (once for all choices), completion tokens summed over choices."""
    n_prompt = len(choices[0].call.prompt_ids)
    n_completion = sum(len(c.completion.token_ids) for c in choices)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
