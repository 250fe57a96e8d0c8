"""Latency the proxy adds over talking to the engine's server directly, and calls/s, streaming and not.

Both servers run uvicorn on 127.0.0.1 in this process's threads and answer from an instant engine
(64 scripted tokens, no model): the *direct* server returns a canned chat completion with no work, the
*proxy* does what it does in training (validate, render the chat template, token-in-token-out prompt,
tokenize, parse tool calls, record the call). Episodes are aiohttp clients, each sending 5 calls that
continue one another; added latency = proxy latency - direct latency at the same percentile.

    python benchmarks/proxy_overhead.py [--concurrency 1 64 256] [--calls 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ajet.llm_call import Completion, SamplingParams  # noqa: E402
from ajet.proxy.server import ProxyServer  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

REPLY = "The answer is 42. " * 12


class InstantEngine:
    """Answers every prompt at once with the same scripted tokens."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode(REPLY, add_special_tokens=False)[:63] + [tokenizer.eos_token_id]
        self.policy_version = 0

    async def generate(self, prompt_ids, params: SamplingParams) -> Completion:
        return Completion(list(self.ids), [-0.1] * len(self.ids), "stop", 0)


def direct_server() -> tuple[str, uvicorn.Server]:
    """A bare engine-side endpoint: canned completion, no validation, no template, no recording."""
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 64, "total_tokens": 74}}

    async def chat(request):
        req = await request.json()
        if req.get("stream"):
            async def gen():
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": REPLY}}]}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse(body)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server


async def episode(session, base_url, api_key, n_calls, stream, latencies, marker):
    messages = [{"role": "user", "content": f"episode {marker}: what is 6 * 7?"}]
    for _ in range(n_calls):
        body = {"model": "m", "messages": messages, "stream": stream}
        t0 = time.perf_counter()
        async with session.post(base_url + "/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {api_key}"}) as r:
            if stream:
                content = ""
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        delta = json.loads(line[6:])["choices"]
                        content += (delta[0]["delta"].get("content") or "") if delta else ""
            else:
                content = (await r.json())["choices"][0]["message"]["content"]
            assert r.status == 200
        latencies.append(time.perf_counter() - t0)
        messages = messages + [{"role": "assistant", "content": content}, {"role": "user", "content": "and again?"}]


async def run(target, n_eps, n_calls, stream, rounds=1, proxy=None):
    """`rounds` rounds of `n_eps` concurrent episodes; returns (p50 ms, p99 ms, calls/s)."""
    latencies: list[float] = []
    wall = 0.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(n_eps, 1))) as session:
        for _ in range(rounds):
            eps = [proxy.open_episode(f"e{i}") for i in range(n_eps)] if proxy else None
            t0 = time.perf_counter()
            await asyncio.gather(*(episode(session, eps[i].base_url if eps else target,
                                           eps[i].api_key if eps else "k", n_calls, stream, latencies, i)
                                   for i in range(n_eps)))
            wall += time.perf_counter() - t0
            if proxy:  # nothing lost on the way
                recorded = sum(len(proxy.close_episode(e)) for e in eps)
                assert recorded == n_eps * n_calls, (recorded, n_eps * n_calls)
    q = statistics.quantiles(latencies, n=100)
    return q[49] * 1e3, q[98] * 1e3, len(latencies) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(d))
    proxy = ProxyServer(InstantEngine(tok), tok, SamplingParams(max_tokens=64)).start()
    direct_url, direct = direct_server()
    print(f"{'stream':>6} {'episodes':>8} {'direct p50':>10} {'proxy p50':>9} {'added p50':>9} {'direct p99':>10} "
          f"{'proxy p99':>9} {'added p99':>9} {'proxy calls/s':>13} {'direct calls/s':>14}")
    for stream in (False, True):
        for n in args.concurrency:
            rounds = max(1, 64 // n)  # enough calls at low concurrency for stable percentiles
            d50, d99, dcps = asyncio.run(run(direct_url, n, args.calls, stream, rounds))
            p50, p99, pcps = asyncio.run(run(None, n, args.calls, stream, rounds, proxy))
            print(f"{str(stream):>6} {n:>8} {d50:>9.2f}ms {p50:>8.2f}ms {p50 - d50:>8.2f}ms {d99:>9.2f}ms "
                  f"{p99:>8.2f}ms {p99 - d99:>8.2f}ms {pcps:>13.0f} {dcps:>14.0f}")
    proxy.stop()
    direct.should_exit = True


if __name__ == "__main__":
    main()
