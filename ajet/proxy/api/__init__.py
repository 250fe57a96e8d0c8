"""API adapters: each turns its request into the proxy's one turn type and writes the turn back.

`Api` is the interface the shared request path (`ajet.proxy.server.ProxyServer._serve`) calls:
`parse` (in the prepare thread) -> the shared path builds the prompt, generates, records -> `recorded`
(once the turn's calls are recorded, whether or not the client still waits) -> `body` or `events`.
Each adapter declares the paths it serves (`routes`); the server receives the adapter classes
(`ProxyServer(apis=...)`) and gives each a `Host` (the tokenizer and `decode`). Nothing here imports the
server: the adapters sit below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

from pydantic import BaseModel
from starlette.responses import Response

from ajet.llm_call import TokenDelta
from ajet.proxy.stream import IncrementalContent, sse
from ajet.proxy.wire import ProxyError, validated

if TYPE_CHECKING:
    import asyncio

    from ajet.proxy.schema import ChatCompletionRequest
    from ajet.proxy.turn import Choice, OpenEpisode, Prepared, Turn


def validated_at(model: type[BaseModel], data: Any, where: str) -> Any:
    """`validated(model, data)` for the value at dotted path `where` of a request body (an input item, a content
    block, a tool): a ProxyError 400 whose message and param name the field from the body's root, in the client's
    own terms (`input.2.name: Input should be a valid string`), not the turn type's."""
    try:
        return validated(model, data)
    except ProxyError as exc:
        param = f"{where}.{exc.param}" if exc.param else where
        message = f"{where}.{exc.message}" if exc.param else f"{where}{exc.message}"
        raise ProxyError(exc.status, message, exc.type, param, exc.code) from exc.__cause__


class Host(Protocol):
    """What an adapter needs of the proxy that serves it."""

    tokenizer: Any
    sampling_policy: str   # "config" (the config's sampling replaces the client's) or "client"

    def decode(self, ids: list[int]) -> str:
        """Completion ids to the text the client is answered (special tokens dropped)."""


class Api:
    """One API's adapter (Chat Completions, Responses, Messages, Gemini). `name` is recorded on each call.

    `routes` are the paths it serves, each `(path, method, handler)`: the handler is "serve" (a model call
    through the shared request path), "stored" (`stored(ep, id)`), "count_tokens" or "models"; the server
    serves each path per episode (`/ep/{token}...`, `/ep/{token}/agent/{tag}...`) and bare. `error_paths`:
    the path fragments whose errors (unknown path, 500) are written in this API's shape."""

    name = ""
    id_prefix = ""     # of the answer's id (`chatcmpl-`, `resp_`, `msg_`)
    routes: tuple[tuple[str, str, str], ...] = ()
    error_paths: tuple[str, ...] = ()

    def __init__(self, proxy: Host):
        self.proxy = proxy
        self.hosted_tools_left_out = 0   # tools only a hosted service can run (web search, ...), left out so far

    def parse(self, data: dict[str, Any], ep: OpenEpisode) -> tuple[ChatCompletionRequest, Any]:
        """The turn request for JSON body `data`, and a context object for `body`/`events`. Raises
        ProxyError 400 naming the offending field (in this API's terms)."""
        raise NotImplementedError

    def parse_request(self, data: dict[str, Any], ep: OpenEpisode, route: dict[str, Any],
                      **kw) -> tuple[ChatCompletionRequest, Any]:
        """`parse`, for an API whose request also lives in its path or query: `route` holds the request's
        `path`, `path_params` and `query` (the Gemini API's model and streaming)."""
        return self.parse(data, ep, **kw)

    def count_body(self, n: int) -> dict[str, Any]:
        """The answer of a token count of `n` tokens."""
        return {"input_tokens": n}

    def recorded(self, ep: OpenEpisode, turn: Turn, prep: Prepared, choices: list[Choice]) -> None:
        """Called once the turn's calls are recorded (on the event loop)."""

    def body(self, turn: Turn, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed answer."""
        raise NotImplementedError

    def events(self, turn: Turn, prep: Prepared, events: asyncio.Queue, first) -> AsyncIterator[str]:
        """The streamed answer: server-sent events text, one string per write. `events` yields
        `(choice_index, TokenDelta)`, `(choice_index, Choice)` when a choice ends, and None at the end;
        `first` is its first item, already taken."""
        raise NotImplementedError

    def error_response(self, err: ProxyError) -> Response:
        return err.response()

    def error_event(self, err: ProxyError) -> str:
        return sse(err.body())

    async def steps(self, turn: Turn, events: asyncio.Queue, first) -> AsyncIterator[tuple[list[str], Choice | None]]:
        """For a one-choice stream (Responses, Messages): per wake-up, the content deltas now safe to send
        (see `IncrementalContent`) and the choice when it has finished (else None); ends after the last."""
        state = IncrementalContent(turn.parse_tools, turn.stop)
        ids: list[int] = []
        event = first
        while event is not None:
            batch = [event]
            while not events.empty():           # coalesce whatever else is already here
                batch.append(events.get_nowait())
            finished = None
            for ev in batch:
                if ev is None:
                    break
                if isinstance(ev[1], TokenDelta):
                    ids += ev[1].token_ids
                else:
                    finished = ev[1]
            delta = (state.finish(finished.message["content"]) if finished is not None
                     else state.update(turn.forced + self.proxy.decode(ids)))
            yield ([delta] if delta else []), finished
            if batch[-1] is None:
                return
            event = await events.get()
