"""`RemoteEngine`: an `Engine` that reaches a vLLM(-compatible) server's `/v1/completions` over HTTP.

Token-in-token-out: the prompt goes out as token ids (`"prompt": [ids]`), and the sampled ids come back
exactly, as `logprobs.tokens` entries "token_id:N" (`return_tokens_as_token_ids`), never as text to
re-tokenize. vLLM includes the end-of-turn (EOS) token it sampled in those tokens, so a completion that
stopped on it ends with its id, as the proxy expects. One request per `generate`: a plain JSON request, or an
SSE stream (`"stream": true`) when the caller wants the tokens as they are sampled.

Sampling matches what the trainer assumes: temperature and top_p from `SamplingParams`, and top_k, min_p and
repetition_penalty sent explicitly as "off", so that defaults vLLM reads from the model's
generation_config.json cannot change the distribution. Empty stop strings are dropped (vLLM would stop after
the first token on one).

**The vLLM server must run with `--logprobs-mode processed_logprobs`** (vLLM >= 0.10.2, engine v1). Its
default, `raw_logprobs`, reports log_softmax of the model's raw logits: no temperature, no top_p, a different
distribution from the one tokens were drawn from. With `processed_logprobs`, vLLM's sampler
(`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`) reports log_softmax of the logits after penalties,
temperature, min_p and top_k/top_p masking (tokens outside the nucleus at -inf, sent as -9999.0): the
truncated-renormalised distribution of `ajet.sampling_dist.processed_logprobs`, which the trainer scores. (vLLM
also stops using FlashInfer's sampler in that mode, since it cannot return processed logprobs.) vLLM's nucleus
rule (drop a token when the mass of the likelier ones already reaches top_p) is ajet's `nucleus_keep`. Greedy
requests (temperature 0) get argmax tokens; their logprob is under temperature 1 (in an all-greedy batch, of
the unprocessed distribution), and greedy tokens are not trained on as samples.

Cancelling `generate` (the proxy does when the call's client disconnects or its episode is closed at its time
limit) closes the request's connection: aiohttp and httpx close a connection whose answer was not read to the
end instead of returning it to the pool, and vLLM aborts a request whose connection closes, so nothing goes on
decoding for nobody (tests/vllm_faults.py reads vLLM's own /metrics to show it). A connection the server
refuses (nothing was sent) raises `ServerUnreachable`, on which `ajet.engines.pool.ServerPool` sends the call to
another server.

`RemoteEngine` checks the mode once, before its first completion: a 1-token probe with top_p = 1e-6 (a nucleus
of one token) must come back with logprob 0 for the sampled token and -9999 (-inf) for any alternative; a
`raw_logprobs` server reports the raw values instead, and `generate` raises a RuntimeError naming the flag.

LoRA adapter per agent role (`agents:` in the config): with `adapter_for`, each request names the adapter of the
agent that made it (`ajet.engines.base.calling_agent()`) as its `model`, which is how a vLLM server started with
`--enable-lora --lora-modules planner=<folder> solver=<folder> ...` picks the adapter for a request (vLLM batches
requests of different adapters together).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any, Callable, Literal

import orjson

from ajet.engines.base import TokenCallback, calling_agent
from ajet.llm_call import Completion, SamplingParams, TokenDelta

_JSON = {"Content-Type": "application/json"}
_CONTEXT_ERROR = re.compile(r"context|max(imum)?[ _-]?(model[ _-]?)?len", re.IGNORECASE)
_ID_PREFIX = len("token_id:")


class ServerUnreachable(RuntimeError):
    """The server could not be connected to (refused, unresolvable, connect timeout): the request was never sent,
    so it may be sent to another server as it is."""


class RemoteEngine:
    """Generates through an OpenAI-style completions server that speaks vLLM's token-id extensions.

    Args:
        base_url: the server's OpenAI base URL, e.g. "http://10.0.0.2:8000/v1" (requests go to
            `base_url + "/completions"`).
        model: the served model name (vLLM's `--served-model-name`, or the model path).
        client: HTTP client library, "aiohttp" (default: lower latency, higher throughput; see
            benchmarks/proxy_overhead.py) or "httpx".
        timeout_s: limit for one request, seconds (aiohttp: the whole request, stream included; httpx: each
            connect, read and write).
        max_connections: most connections open to the server at once (further requests wait for one).
        check_logprobs_mode: probe the server once, before the first completion, for
            `--logprobs-mode processed_logprobs` (see the module docstring); False skips the probe.
        adapter_for: agent tag (None outside the proxy) -> the served LoRA adapter's name (vLLM's
            `--lora-modules NAME=folder`), sent as the request's `model` (`ajet.agent_adapters.adapter_router`);
            None: every request names `model`.

    Attributes:
        policy_version: the optimizer step of the weights the server holds; the backbone sets it after a
            weight sync. A completion carries the value read when its request was sent.

    Each event loop that calls `generate` gets its own HTTP session (created on first use); `aclose` closes them,
    and a session whose loop ends first (`asyncio.run` returning, e.g. the proxy's server thread once stopped) is
    closed by that loop as it ends: a task held open beside the session closes it when `asyncio.run` cancels the
    tasks still pending.
    """

    def __init__(self, base_url: str, model: str, client: Literal["aiohttp", "httpx"] = "aiohttp",
                 timeout_s: float = 600, max_connections: int = 256, check_logprobs_mode: bool = True,
                 adapter_for: Callable[[str | None], str] | None = None):
        if client not in ("aiohttp", "httpx"):
            raise ValueError(f"client must be 'aiohttp' or 'httpx', not {client!r}")
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.adapter_for = adapter_for
        self.client = client
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.policy_version = 0
        self._mode_checked = not check_logprobs_mode
        # event loop -> (its HTTP session, the task that closes the session when the loop ends)
        self._sessions: dict[asyncio.AbstractEventLoop, tuple[Any, asyncio.Task]] = {}

    def request_body(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> dict[str, Any]:
        """The JSON body vLLM's `/v1/completions` receives for one prompt `[prompt_len]`.

        `logprobs` is k >= 1 (vLLM then returns the sampled token's logprob and the top-k alternatives);
        `skip_special_tokens: false` makes stop strings match the text with special tokens in it, as the
        debug engine does (the returned text itself is never used). `model` is the calling agent's adapter
        when the engine has `adapter_for`.
        """
        model = self.model if self.adapter_for is None else self.adapter_for(calling_agent())
        return {"model": model, "prompt": list(prompt_ids), "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": -1, "min_p": 0.0,
                "repetition_penalty": 1.0, "seed": params.seed, "stop": [s for s in params.stop if s],
                "logprobs": max(1, params.top_logprobs), "return_tokens_as_token_ids": True,
                "skip_special_tokens": False, "stream": stream}

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """Sample one completion for `prompt_ids` `[prompt_len]`; see `ajet.engines.base.Engine.generate`.

        Without `on_tokens`, one JSON request; with it, an SSE stream: the chunks in each network read become
        one `on_tokens` call (on this event loop) with their ids and logprobs (vLLM sends one chunk per decode
        step, so while it generates that is one call per chunk; a burst already here is delivered at once).

        Raises:
            ValueError: the server answered 400 about the context length (prompt + max_tokens too long).
            ServerUnreachable (a RuntimeError): no connection could be made (nothing was sent).
            RuntimeError: any other HTTP error status (with a short body), a connection lost or timed out,
                a stream cut off or carrying an error, a response without token ids / logprobs, or a server
                that does not report processed logprobs (see the module docstring).
        """
        if not self._mode_checked:
            await self._check_logprobs_mode(prompt_ids)
        return await self._complete(prompt_ids, params, on_tokens)

    async def _complete(self, prompt_ids: list[int], params: SamplingParams,
                        on_tokens: TokenCallback | None) -> Completion:
        """One completion request (see `generate`), without the logprobs-mode check."""
        version = self.policy_version
        data = orjson.dumps(self.request_body(prompt_ids, params, on_tokens is not None))
        ids: list[int] = []
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        finish = error = None
        try:
            async with self._post(data) as (status, read, pieces):
                if status != 200:
                    error = (status, (await read()).decode(errors="replace"))
                elif on_tokens is None:
                    choice = _choice(await read(), self.url)
                    ids, logprobs, tops = _parse_logprobs(choice.get("logprobs"), params.top_logprobs, self.url)
                    finish = choice.get("finish_reason")
                else:
                    rest = b""
                    async for piece in pieces():             # whatever bytes have arrived
                        *lines, rest = (rest + piece).split(b"\n")
                        delta, finish, done = _stream_events(lines, params.top_logprobs, self.url, finish)
                        if delta is not None:
                            ids += delta.token_ids
                            logprobs += delta.logprobs
                            if tops is not None:
                                tops += delta.top_logprobs
                            on_tokens(delta)
                        if done:
                            break
        except (OSError, asyncio.TimeoutError, self._errors()) as exc:
            if isinstance(exc, self._connect_errors()):
                raise ServerUnreachable(
                    f"{self.url} cannot be reached: {type(exc).__name__}: {_cut(str(exc))}") from exc
            raise RuntimeError(f"{self.url} failed: {type(exc).__name__}: {_cut(str(exc))}") from exc
        if error is not None:
            _raise_for_status(*error, self.url)
        if finish not in ("stop", "length"):
            raise RuntimeError(f"{self.url} ended the completion " + ("without a finish_reason (cut off?)"
                               if finish is None else f"with finish_reason={finish!r}"))
        return Completion(ids, logprobs, finish, version, tops)

    async def _check_logprobs_mode(self, prompt_ids: list[int]) -> None:
        """Probe (1 token of `prompt_ids`, top_p 1e-6, 2 alternatives) that the server reports processed logprobs:
        with a one-token nucleus the sampled token has logprob 0 and every other token -inf (-9999.0 on the wire).
        Raises RuntimeError otherwise, or as `generate` does when the request fails."""
        probe = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=1, top_logprobs=2)
        c = await self._complete(prompt_ids, probe, None)
        others = [lp for tid, lp in (c.top_logprobs or [[]])[0] if tid != c.token_ids[0]] if c.token_ids else []
        if not c.token_ids or abs(c.logprobs[0]) > 1e-6 or any(lp > -9999.0 for lp in others):
            raise RuntimeError(
                f"{self.url} does not report processed logprobs (a 1-token nucleus gave the sampled token logprob "
                f"{c.logprobs[0] if c.logprobs else None} and alternatives {others}): start vLLM with "
                "`--logprobs-mode processed_logprobs` so that recorded logprobs are those of the sampling "
                "distribution (temperature and top_p applied), which the trainer scores")
        self._mode_checked = True

    def raise_if_failed(self) -> None:
        """Nothing to check: the server was started outside this engine, which only calls it (see `Engine`)."""

    async def aclose(self) -> None:
        """Close the HTTP sessions: this loop's, and those of other loops still running (the proxy's thread) or
        stopped but not closed; a closed loop closed its session as it ended (see the class docstring)."""
        here = asyncio.get_running_loop()
        sessions, self._sessions = self._sessions, {}
        for loop, (_, keeper) in sessions.items():
            if loop is here:
                await _finish(keeper)
            elif loop.is_running():
                with contextlib.suppress(RuntimeError, asyncio.TimeoutError):   # the loop ended meanwhile
                    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                        _finish(keeper), loop)), 30)
            elif not loop.is_closed():
                await asyncio.to_thread(loop.run_until_complete, _finish(keeper))

    async def _close_when_cancelled(self, session: Any) -> None:
        """Hold `session` open until this task is cancelled (by `aclose`, or by `asyncio.run` ending its loop),
        then close it on its own loop."""
        try:
            await asyncio.Event().wait()
        finally:
            await (session.close() if self.client == "aiohttp" else session.aclose())

    # ---- HTTP -------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _post(self, data: bytes):
        """POST `data` to the completions URL; yields (status, read, pieces): `await read()` is the body
        (bytes), `pieces()` iterates over it (bytes) as it arrives, in whatever pieces the network delivers."""
        session = self._session()
        if self.client == "aiohttp":
            async with session.post(self.url, data=data, headers=_JSON) as r:
                yield r.status, r.read, r.content.iter_any
        else:
            async with session.stream("POST", self.url, content=data, headers=_JSON) as r:
                yield r.status_code, r.aread, r.aiter_bytes

    def _session(self):
        loop = asyncio.get_running_loop()
        entry = self._sessions.get(loop)
        if entry is None:
            for old in [lp for lp in self._sessions if lp.is_closed()]:   # loops gone: nothing left to close
                del self._sessions[old]
            if self.client == "aiohttp":
                import aiohttp
                session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            else:
                import httpx
                n = self.max_connections
                session = httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(
                    max_connections=n, max_keepalive_connections=n))
            entry = self._sessions[loop] = (session, loop.create_task(self._close_when_cancelled(session)))
        return entry[0]

    def _errors(self) -> type[Exception]:
        """The client library's base class for transport errors."""
        if self.client == "aiohttp":
            import aiohttp
            return aiohttp.ClientError
        import httpx
        return httpx.HTTPError

    def _connect_errors(self) -> type[Exception]:
        """The client library's class for a connection that could not be made (no request sent)."""
        if self.client == "aiohttp":
            import aiohttp
            return aiohttp.ClientConnectorError
        import httpx
        return httpx.ConnectError


async def _finish(task: asyncio.Task) -> None:
    """Cancel `task` and wait for it to end (its `finally` runs)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _choice(payload: bytes, url: str) -> dict[str, Any] | None:
    """The first choice of a completion or stream chunk (JSON bytes); None for a chunk without choices.
    Raises RuntimeError for malformed JSON or an error object (vLLM reports a failure mid-stream as one)."""
    try:
        body = orjson.loads(payload)
    except ValueError as exc:
        raise RuntimeError(f"{url} sent malformed JSON: {_cut(str(exc))}") from exc
    if not isinstance(body, dict) or "error" in body or body.get("object") == "error":   # older vLLM: the latter
        raise RuntimeError(f"{url} failed: {_cut(json.dumps(body))}")
    choices = body.get("choices")
    return choices[0] if choices else None


def _stream_events(lines: list[bytes], k: int, url: str, finish: str | None
                   ) -> tuple[TokenDelta | None, str | None, bool]:
    """Complete SSE lines of a completions stream -> (their tokens as one delta or None, the finish_reason so
    far, whether "[DONE]" came). Blank lines and comments are skipped, as are chunks without choices (usage)
    or without tokens. Raises RuntimeError for an error chunk or malformed JSON."""
    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] | None = [] if k else None
    for line in lines:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return (TokenDelta(ids, logprobs, tops) if ids else None), finish, True
        choice = _choice(payload, url)
        if choice is None:
            continue
        finish = choice.get("finish_reason") or finish
        if (choice.get("logprobs") or {}).get("tokens"):
            c_ids, c_lps, c_tops = _parse_logprobs(choice["logprobs"], k, url)
            ids += c_ids
            logprobs += c_lps
            if tops is not None:
                tops += c_tops
    return (TokenDelta(ids, logprobs, tops) if ids else None), finish, False


def _parse_logprobs(lp: Any, k: int, url: str) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """vLLM's completions `logprobs` block -> (ids `[n]`, logprobs `[n]`, top-k (id, logprob) most likely first
    `[n][k]` or None when k == 0). vLLM's `top_logprobs` entries hold the sampled token plus the top k, keyed
    "token_id:N". Raises RuntimeError when the block is missing or its tokens are not "token_id:N"."""
    try:
        tokens = lp["tokens"]
        if tokens and not tokens[0].startswith("token_id:"):
            raise ValueError(f"token {tokens[0]!r} is text, not 'token_id:N' (return_tokens_as_token_ids ignored?)")
        ids = [int(t[_ID_PREFIX:]) for t in tokens]
        logprobs = [float(x) for x in lp["token_logprobs"]]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
        tops = None if not k else [
            sorted(((int(t[_ID_PREFIX:]), float(v)) for t, v in (step or {}).items()), key=lambda p: -p[1])[:k]
            for step in lp["top_logprobs"]]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"{url} sent no usable token ids/logprobs: {type(exc).__name__}: {_cut(str(exc))}") from exc
    return ids, logprobs, tops


def _raise_for_status(status: int, body: str, url: str) -> None:
    """A non-200 answer: ValueError for a 400 about the context length, RuntimeError otherwise."""
    try:
        err = json.loads(body)
        message = str(err["error"]["message"] if isinstance(err.get("error"), dict) else err.get("message", body))
    except (ValueError, AttributeError, KeyError, TypeError):
        message = body
    if status == 400 and _CONTEXT_ERROR.search(message):
        raise ValueError(_cut(message, 500))
    raise RuntimeError(f"{url} answered HTTP {status}: {_cut(message)}")


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
