"""An instant vLLM-compatible server in its own process: the same scripted reply for every prompt, no model.

`POST /v1/completions` speaks vLLM's token-id dialect (prompt as ids; `logprobs` with "token_id:N" tokens as
with `return_tokens_as_token_ids`; the EOS id last, finish_reason "stop"; "length" when `max_tokens` cuts the
reply; "stop" after the token whose text completes a `stop` string, matched as vLLM matches them, so an empty
string stops after the first token), as a JSON body or an SSE stream of one token per chunk.

Logprobs follow vLLM's `--logprobs-mode` (vLLM >= 0.10.2, engine v1): each reply position has a scripted raw
distribution (`raw_logprobs`); with `processed_logprobs` (the default here, the mode `RemoteEngine` requires)
the server reports what vLLM's sampler does: raw logits / temperature, top_k then top_p masked to -inf,
log_softmax (greedy, temperature 0: the raw distribution), -inf sent as -9999.0 as vLLM's server does. `POST /v1/chat/completions` returns the same
reply as a canned chat completion (JSON, or an SSE stream of one chunk per token): the *direct* baseline the
proxy is compared with. `GET /stats` returns how many requests of each kind were served and the last
/v1/completions body. Answers are built once and cached, so serving costs HTTP only.

For tests: a prompt longer than `max_model_len - max_tokens` gets vLLM's 400 about the context length, the
model name "error-500" gets a 500, and "error-stream" a stream that fails after 2 tokens (an error chunk).

    server = InstantServer.start(reply_ids, pieces)   # pieces[i]: the text of reply_ids[i]
    server.url                                        # "http://127.0.0.1:PORT"
    server.stats(); server.stop()
"""

from __future__ import annotations

import functools
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

N_ALTERNATIVES = 20          # the most top_logprobs the proxy asks for


def token_logprob(i: int) -> float:
    """The scripted raw logprob of the reply's i-th token (distinct per position, so misalignment shows)."""
    return -0.1 - 0.001 * i


def raw_distribution(i: int) -> list[float]:
    """Position i's raw logprobs `[1 + N_ALTERNATIVES]`: the reply token (id t, most likely) first, then alternative
    j (id t + j + 1) sharing the remaining mass in halves; every other token has probability 0."""
    rest = -math.expm1(token_logprob(i))                               # 1 - p(reply token)
    norm = 1 - 0.5 ** N_ALTERNATIVES
    return [token_logprob(i)] + [math.log(rest * 0.5 ** (j + 1) / norm) for j in range(N_ALTERNATIVES)]


def processed_distribution(i: int, temperature: float, top_p: float, top_k: int) -> list[float]:
    """What vLLM's sampler reports with `--logprobs-mode processed_logprobs` for position i `[1 + N_ALTERNATIVES]`
    (same order as `raw_distribution`): raw / temperature, top_k, then top_p (keep the most likely tokens until
    the mass of the likelier ones reaches top_p), masked to -inf, log_softmax. Temperature < 1e-5 is greedy:
    the raw distribution, unprocessed (as vLLM does for an all-greedy batch)."""
    raw = raw_distribution(i)
    if temperature < 1e-5:
        return raw
    scaled = [x / temperature for x in raw]                            # already sorted, most likely first
    top = max(scaled)
    probs = [math.exp(x - top) for x in scaled]
    total = sum(probs)
    keep, before = [], 0.0
    for rank, p in enumerate(probs):
        keep.append((top_k <= 0 or rank < top_k) and before < top_p)
        before += p / total
    if temperature == 1.0 and all(keep):
        return raw                          # log_softmax of normalised logprobs: the identity (kept bit-exact)
    log_z = math.log(sum(p for p, k in zip(probs, keep) if k)) + top
    return [x - log_z if k else -math.inf for x, k in zip(scaled, keep)]


def _wire(logprob: float) -> float:
    return max(logprob, -9999.0)      # vLLM's server sends -inf as -9999.0 (JSON has no infinity)


def reply_length(pieces: list[str], max_tokens: int, stop: list[str]) -> tuple[int, str]:
    """(tokens, finish_reason) of the reply under `max_tokens` and stop strings, as vLLM decides: after each
    token, a stop string is searched in the text from just before that token's new characters (so "" matches
    at once)."""
    text = ""
    for n, piece in enumerate(pieces[:max_tokens], 1):
        text += piece
        if any(text.find(s, max(0, len(text) - len(piece) - len(s) + 1)) != -1 for s in stop):
            return n, "stop"
    n = min(max_tokens, len(pieces))
    return n, "stop" if n == len(pieces) else "length"


def build_app(reply_ids: list[int], pieces: list[str], max_model_len: int = 4096,
              logprobs_mode: str = "processed_logprobs"):
    """The Starlette app. reply_ids `[n]` (the last one the EOS id), pieces `[n]` (each token's text),
    logprobs_mode "processed_logprobs" or "raw_logprobs" (vLLM's `--logprobs-mode`)."""
    if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
        raise ValueError(f"logprobs_mode must be 'processed_logprobs' or 'raw_logprobs', not {logprobs_mode!r}")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    n_reply = len(reply_ids)
    assert n_reply == len(pieces), "one text piece per reply token"
    stats = {"completions": 0, "chat": 0, "last_request": None}

    def distribution(i: int, sampling: tuple[float, float, int]) -> list[float]:
        return processed_distribution(i, *sampling) if logprobs_mode == "processed_logprobs" else raw_distribution(i)

    def logprobs_block(start: int, stop: int, k: int, sampling: tuple[float, float, int]) -> dict:
        ids = reply_ids[start:stop]
        dists = [distribution(start + i, sampling) for i in range(len(ids))]
        tops = [{f"token_id:{t + j}" if j else f"token_id:{t}": _wire(lp) for j, lp in enumerate(d[:max(k, 1)])}
                for t, d in zip(ids, dists)]
        return {"text_offset": [0] * len(ids), "token_logprobs": [_wire(d[0]) for d in dists],
                "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops}

    @functools.lru_cache(maxsize=256)
    def completion_json(n: int, finish: str, k: int, sampling: tuple[float, float, int]) -> bytes:
        choice = {"index": 0, "text": "".join(pieces[:n]), "logprobs": logprobs_block(0, n, k, sampling),
                  "finish_reason": finish, "stop_reason": None}
        return json.dumps({"id": "cmpl-instant", "object": "text_completion", "created": 0, "model": "instant",
                           "choices": [choice], "usage": {"prompt_tokens": 0, "completion_tokens": n,
                                                          "total_tokens": n}}).encode()

    @functools.lru_cache(maxsize=256)
    def completion_chunks(n: int, finish: str, k: int, sampling: tuple[float, float, int]) -> tuple[bytes, ...]:
        chunks = []
        for i in range(n):
            choice = {"index": 0, "text": pieces[i], "logprobs": logprobs_block(i, i + 1, k, sampling),
                      "finish_reason": finish if i == n - 1 else None, "stop_reason": None}
            chunks.append(b"data: " + json.dumps({"id": "cmpl-instant", "object": "text_completion", "created": 0,
                                                  "model": "instant", "choices": [choice]}).encode() + b"\n\n")
        return tuple(chunks) + (b"data: [DONE]\n\n",)

    content = "".join(pieces[:-1])          # the chat text leaves the EOS token out
    chat_json = json.dumps({
        "id": "chatcmpl-instant", "object": "chat.completion", "created": 0, "model": "instant",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 0, "completion_tokens": n_reply, "total_tokens": n_reply}}).encode()
    chat_chunks = tuple(
        b"data: " + json.dumps({"id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0,
                                "model": "instant", "choices": [{
                                    "index": 0, "delta": {"content": "" if i == n_reply - 1 else pieces[i]},
                                    "finish_reason": "stop" if i == n_reply - 1 else None, "logprobs": None}]}).encode()
        + b"\n\n" for i in range(n_reply)) + (b"data: [DONE]\n\n",)

    async def sse(chunks):
        for c in chunks:
            yield c

    async def completions(request: Request):
        body = json.loads(await request.body())
        stats["completions"] += 1
        stats["last_request"] = body
        if body.get("model") == "error-500":
            return JSONResponse({"error": {"message": "scripted failure", "type": "InternalServerError",
                                           "param": None, "code": 500}}, status_code=500)
        max_tokens, prompt = body.get("max_tokens") or 16, body["prompt"]
        if len(prompt) + max_tokens > max_model_len:
            message = (f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                       f"{max_model_len} tokens and your request has {len(prompt)} input tokens "
                       f"({max_tokens} > {max_model_len} - {len(prompt)}).")
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None,
                                           "code": 400}}, status_code=400)
        stop = body.get("stop") or []
        n, finish = reply_length(pieces, max_tokens, [stop] if isinstance(stop, str) else stop)
        k = body.get("logprobs") or 0
        t, top_p, top_k = body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("top_k", -1)
        sampling = (1.0 if t is None else float(t), 1.0 if top_p is None else float(top_p),
                    -1 if top_k is None else int(top_k))
        if body.get("stream") and body.get("model") == "error-stream":
            error = b'data: {"error": {"message": "scripted failure mid-stream", "code": 500}}\n\n'
            return StreamingResponse(sse(completion_chunks(n, finish, k, sampling)[:2] + (error, b"data: [DONE]\n\n")),
                                     media_type="text/event-stream")
        if body.get("stream"):
            return StreamingResponse(sse(completion_chunks(n, finish, k, sampling)), media_type="text/event-stream")
        return Response(completion_json(n, finish, k, sampling), media_type="application/json")

    async def chat(request: Request):
        body = json.loads(await request.body())
        stats["chat"] += 1
        if body.get("stream"):
            return StreamingResponse(sse(chat_chunks), media_type="text/event-stream")
        return Response(chat_json, media_type="application/json")

    async def get_stats(_request: Request):
        return JSONResponse(stats)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/stats", get_stats, methods=["GET"])])


def _serve() -> None:
    """Child process: read {"reply_ids", "pieces", "max_model_len", "logprobs_mode"} (JSON) from stdin, bind a free port on
    127.0.0.1, print it, serve until terminated."""
    import uvicorn

    cfg = json.loads(sys.stdin.readline())
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it Nagle holds
    # each response body behind its headers for a delayed ACK (~40 ms a request)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(cfg["reply_ids"], cfg["pieces"], cfg["max_model_len"], cfg["logprobs_mode"]), loop="uvloop",
                            http="httptools", log_level="warning", access_log=False, timeout_keep_alive=60,
                            backlog=4096)
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(config).run(sockets=[sock])


@dataclass
class InstantServer:
    """A running instant server process."""

    url: str
    process: subprocess.Popen

    @classmethod
    def start(cls, reply_ids: list[int], pieces: list[str], max_model_len: int = 4096,
              logprobs_mode: str = "processed_logprobs", timeout_s: float = 30) -> InstantServer:
        """Start the server process (see `build_app` for the arguments) and wait until it answers.
        Raises RuntimeError if it does not."""
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        proc.stdin.write(json.dumps({"reply_ids": list(reply_ids), "pieces": list(pieces),
                                     "max_model_len": max_model_len, "logprobs_mode": logprobs_mode}) + "\n")
        proc.stdin.close()
        port = proc.stdout.readline().strip()          # "" when the child died
        server = cls(f"http://127.0.0.1:{port}", proc)
        deadline = time.monotonic() + timeout_s
        while port and proc.poll() is None and time.monotonic() < deadline:
            try:                                       # the port is bound before uvicorn listens: wait for it
                server.stats()
                return server
            except OSError:
                time.sleep(0.02)
        server.stop()
        raise RuntimeError(f"the instant engine server did not start (exit code {proc.poll()})")

    def stats(self) -> dict:
        """{"completions": n, "chat": n, "last_request": the last /v1/completions body or None}."""
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    _serve()
