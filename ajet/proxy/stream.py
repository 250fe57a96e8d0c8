"""Streaming a completion as it is sampled: which text is safe to send, and the OpenAI SSE chunks.

The client must end up with exactly the message the non-streaming answer would hold, so text is held
back while it could still change meaning: a trailing partial UTF-8 character, a possible start of
`<tool_call>` (tool-call blocks are parsed when the completion ends and sent as `tool_calls` deltas),
a possible start of a stop string (cut from the answer, as OpenAI does), and trailing whitespace
(the final content is stripped). Once a `<tool_call>` tag appears, no more content streams until the
end; then whatever the final content has beyond what was sent goes out in one delta.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson

from ajet.chat_template import TOOL_CALL_START

log = logging.getLogger(__name__)



def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


class IncrementalContent:
    """Decides, as text grows, which prefix of the final `content` can be sent now.

    Args:
        parse_tools: tool-call blocks will be parsed out at the end (tools given and tool_choice != "none").
        stop: the request's stop strings.

    `update(text)` takes the whole text decoded so far and returns the new content delta ("" when nothing
    is safe yet). `finish(content)` takes the final content and returns the rest of it. The deltas
    concatenate to `content`. Should what was sent not be a prefix of it (a tokenizer whose decode of a
    prefix is not a prefix of the full decode), `finish` logs an error and sends the rest after the
    common prefix: the client's text may then differ, the recorded tokens never do.
    """

    def __init__(self, parse_tools: bool, stop: tuple[str, ...] = ()):
        self.parse_tools = parse_tools
        self.stop = tuple(s for s in stop if s)
        self.sent = ""
        self.frozen = False   # a tool-call tag appeared: nothing more until the end

    def update(self, text: str) -> str:
        if self.frozen:
            return ""
        text = text.rstrip("\ufffd")                       # a multi-byte character still being sampled
        if self.stop:
            text = cut_at_stop(text, self.stop)
            text = text[:len(text) - _partial_suffix(text, self.stop)]
        if self.parse_tools:
            tag = text.find(TOOL_CALL_START)
            if tag >= 0:
                self.frozen, text = True, text[:tag]
            else:
                text = text[:len(text) - _partial_suffix(text, (TOOL_CALL_START,))]
            text = text.lstrip()                         # the final content is stripped at both ends
            text = text.rstrip()
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self, content: str | None) -> str:
        content = content or ""
        if not content.startswith(self.sent):
            log.error("streamed content %r is not a prefix of the final content %r", self.sent[-40:], content[-40:])
        common = len(os.path.commonprefix([self.sent, content]))
        delta, self.sent = content[common:], content
        return delta


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` (or a literal like `[DONE]`) and a blank line."""
    return "data: " + (obj if isinstance(obj, str) else orjson.dumps(obj).decode()) + "\n\n"


def chunk(base: dict[str, Any], index: int, delta: dict[str, Any], finish_reason: str | None = None,
          logprobs: list[dict[str, Any]] | None = None) -> str:
    """A `chat.completion.chunk` event for choice `index`; `base` holds id, object, created, model."""
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
              "logprobs": None if logprobs is None else {"content": logprobs}}
    return sse({**base, "choices": [choice]})


def tool_call_chunks(base: dict[str, Any], index: int, tool_calls: list[dict[str, Any]]) -> list[str]:
    """OpenAI's tool-call deltas: per call one chunk with index, id, type and name (empty arguments), then
    one with the arguments (clients concatenate `arguments` fragments by `index`)."""
    out = []
    for i, tc in enumerate(tool_calls):
        fn = tc["function"]
        out.append(chunk(base, index, {"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                                       "function": {"name": fn["name"], "arguments": ""}}]}))
        out.append(chunk(base, index, {"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
    return out
