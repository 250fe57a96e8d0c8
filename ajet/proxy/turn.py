"""The one turn type every API adapter speaks, and a turn's generation.

An API adapter (`ajet/proxy/api/`) turns its request into a `ChatCompletionRequest` (OpenAI chat wire
format: messages, tools, tool_choice, sampling parameters, stream flag), the proxy's internal turn type,
and writes the turn's `Choice`s back in its own format. Prompt building, generation, recording and the
error contract only ever see this type, so an episode may mix APIs and still merge into one sample.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ajet.engines.base import EngineWait
from ajet.llm_call import Completion, LLMCall, SamplingParams
from ajet.proxy.prompt import Prompt
from ajet.proxy.schema import ChatCompletionRequest, NamedToolChoice, short_repr
from ajet.proxy.strict import StrictTools
from ajet.proxy.wire import ProxyError

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """One generated choice of a request, and the call it was recorded as."""

    index: int
    completion: Completion
    params: SamplingParams
    message: dict[str, Any]
    finish_reason: str
    started: float
    ended: float
    strict_violations: list[str] = field(default_factory=list)
    call: LLMCall | None = None
    queued_s: float = 0.0               # seconds it waited in the engine's queue before generation started


@dataclass(eq=False)
class Turn:
    """One request's generation, shared by the client's retries of it (equal only to itself).

    `events` (streaming requests only) receives `(choice_index, TokenDelta)` as tokens are sampled,
    `(choice_index, Choice)` when a choice ends, and None when the task is done. `forced` is the
    tool-call opening `tool_choice` fixed, `parse_tools` whether tool calls are parsed out of the text,
    `stop` the stop strings generation used, `strict` the validators of the request's `strict: true` tools.
    `cancelled_with`: the answer of a generation cancelled on purpose (default: `episode_closed`).
    `waiting`: the requests waiting for its answer (the first, and retries answered from it); `abandoned`: its
    last waiting client went away before the answer was complete, so it was cancelled (`leave`)."""

    response_id: str
    created: int
    n: int
    streaming: bool
    forced: str
    parse_tools: bool
    stop: tuple[str, ...]
    strict: StrictTools | None = None
    task: asyncio.Future | None = None
    events: asyncio.Queue | None = None
    cancelled_with: ProxyError | None = None
    waiting: int = 0
    abandoned: bool = False

    def __post_init__(self):
        if self.streaming:
            self.events = asyncio.Queue()

    @property
    def failed(self) -> bool:
        return self.task.done() and (self.task.cancelled() or self.task.exception() is not None)

    def error(self) -> ProxyError | None:
        """The error body of a finished generation that failed, else None. A generation cancelled because
        its episode was closed is a 404 `episode_closed`; an unexpected exception (a bug, logged once by
        `settle`) a 500. One cancelled with another answer (`cancel`) is that answer."""
        if self.task.cancelled():
            return self.cancelled_with or episode_closed()
        exc = self.task.exception()
        if exc is None or isinstance(exc, ProxyError):
            return exc
        return ProxyError(500, f"internal error in the ajet proxy ({type(exc).__name__}); see the proxy's log",
                          "server_error", code="internal_error")

    def cancel(self, answer: ProxyError | None = None) -> None:
        """Cancel the generation (a no-op once it is done); its clients get `answer` (default `episode_closed`)."""
        if not self.task.done():
            self.cancelled_with = answer
            self.task.cancel()

    def leave(self, gone: bool) -> None:
        """A request stops waiting for this generation (`waiting` was counted up for it); `gone`: its client
        closed the connection before the answer was complete. When the last waiting client is gone, a generation
        still running is cancelled: its rows leave the engine's batch (nobody would read them), nothing is
        recorded, and a retry of the request starts a new generation (`abandoned`)."""
        self.waiting -= 1
        if gone and self.waiting == 0 and not self.task.done() and not self.abandoned:
            self.abandoned = True
            self.cancel(client_gone())

    def settle(self, ep: OpenEpisode) -> None:
        """The generation task's done-callback (on the event loop): it leaves `ep.inflight`, its exception is
        retrieved whether or not a client still waits for it (a client that went away mid-stream leaves no
        "Task exception was never retrieved" behind), an unexpected one (a bug) is logged once with its
        traceback, and a stream's `events` get their closing None."""
        ep.inflight.discard(self)
        exc = None if self.task.cancelled() else self.task.exception()
        if exc is not None and not isinstance(exc, ProxyError):
            log.error("proxy: unexpected %s in a generation", type(exc).__name__, exc_info=exc)
        if self.events is not None:
            self.events.put_nowait(None)

    async def result(self) -> list[Choice]:
        """The generation's choices, awaited without cancelling it when the waiting request is cancelled (another
        request may wait for it too; a client gone stops it through `leave`).
        Raises the ProxyError of a failed generation (see `error`)."""
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            if self.task.cancelled():          # the episode was closed (or the proxy stopped), not this request
                raise self.error() from None
            raise
        except ProxyError:
            raise
        except Exception:  # noqa: BLE001 - a bug: its 500 body, logged
            raise self.error() from None


@dataclass
class OpenEpisode:
    """The proxy's state of one open episode: its calls in arrival order, its generations by request key
    (a client's retry is answered from the first attempt's), rendered prompts by call id (a cache), and
    the Responses API's stored responses by id (for `previous_response_id` and `GET /v1/responses/{id}`) and
    its output and input items by id (for `item_reference`)."""

    episode_id: str
    token: str
    calls: list[LLMCall] = field(default_factory=list)
    turns: dict[str, Turn] = field(default_factory=dict)   # request key -> its latest generation (for retries)
    # every generation still running, each on its own: two requests with the same key (the same body sent twice)
    # share one entry of `turns`, and closing the episode cancels both
    inflight: set[Turn] = field(default_factory=set)
    rendered: dict[str, str] = field(default_factory=dict)   # call id -> its rendered prompt text (a cache)
    responses: dict[str, Any] = field(default_factory=dict)   # Responses API: response id -> its stored record
    items: dict[str, Any] = field(default_factory=dict)   # Responses API: item id -> the item (`item_reference`)
    open: bool = True
    seed_key: str = ""                  # names the episode in its calls' sampler seeds (`call_seed`)
    requests: int = 0                   # requests started (retries answered from an earlier one excluded)
    engine_wait: EngineWait = field(default_factory=EngineWait)   # its calls' time in the engine's queue


@dataclass
class Prepared:
    """What the prepare thread makes of a request body: the validated request, its retry key, and (unless
    it repeats an earlier request) its prompt."""

    req: ChatCompletionRequest
    key: str
    context: Any = None                 # what the API adapter keeps for writing its answer
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: Prompt | None = None
    prompt_ids: list[int] | None = None
    forced: str = ""
    strict: StrictTools | None = None


def episode_closed() -> ProxyError:
    return ProxyError(404, "the episode was closed while this call was running (the workflow returned or timed "
                           "out before its agent finished): nothing was recorded", code="episode_closed")


def client_gone() -> ProxyError:
    """The answer of a generation cancelled because its client went away (nobody receives it)."""
    return ProxyError(499, "the client closed the connection before its answer was complete: the generation was "
                           "stopped and nothing was recorded", code="client_closed_request")


def server_stopping() -> ProxyError:
    return ProxyError(503, "the ajet proxy is stopping (the run ended or was interrupted): nothing was recorded; "
                           "retry against the restarted server", "server_error", code="server_stopping")


def reject_unsupported(req: ChatCompletionRequest) -> None:
    """A field ajet cannot honour is a 400 naming it, never silently dropped."""
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise ProxyError(400, "tool_choice asks for a tool call but the request has no `tools`", param="tool_choice",
                         code="invalid_value")
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.get("name")
        if name not in {t.function.name for t in req.tools}:
            raise ProxyError(400, f"tool_choice names function {short_repr(name)}, which is not in `tools`",
                             param="tool_choice", code="invalid_value")
    if req.frequency_penalty or req.presence_penalty:
        raise ProxyError(400, "frequency/presence penalties would change the sampling distribution the policy is "
                              "trained on: remove them", param="frequency_penalty", code="unsupported_value")
    if req.top_logprobs and not req.logprobs:
        raise ProxyError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object"):
        raise ProxyError(400, f"response_format type {short_repr(kind)} is not supported (ajet samples without a "
                              "grammar): use 'json_object' and describe the schema in the prompt",
                         param="response_format.type", code="unsupported_value")
    if kind == "json_object" and not any("json" in message_text(m).lower() for m in req.messages):
        raise ProxyError(400, "'messages' must contain the word 'json' in some form, to use 'response_format' of "
                              "type 'json_object'", param="messages", code="invalid_value")


def parses_tools(req: ChatCompletionRequest) -> bool:
    """Whether tool calls are parsed out of the generated text: the request has tools and allows calls."""
    return bool(req.tools) and req.tool_choice != "none"


def message_text(m) -> str:
    c = m.content
    return c if isinstance(c, str) else "".join(p.text for p in c or [])


def forced_tool_call(req: ChatCompletionRequest) -> str:
    """The opening of a tool call that `tool_choice` makes certain, as a grammar-constrained decoder would
    force it: "required" fixes `<tool_call>` and the name key; a named function also fixes its name and
    the arguments' opening brace, and, when its schema has exactly one property, which is required, that
    key (plus the opening quote for a string). These tokens end the prompt (loss mask 0); the model
    samples the rest."""
    if req.tool_choice == "required":
        return '<tool_call>\n{"name": "'
    if not isinstance(req.tool_choice, NamedToolChoice):
        return ""
    name = req.tool_choice.function["name"]
    text = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": {'
    params = next(t.function.parameters for t in req.tools if t.function.name == name) or {}
    props, required = params.get("properties") or {}, params.get("required") or []
    if len(props) == 1 and list(props) == list(required):
        key = required[0]
        text += json.dumps(key) + ": " + ('"' if props[key].get("type") == "string" else "")
    return text
