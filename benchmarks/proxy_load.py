"""Load test: 1,000 concurrent episodes x 5 calls through the real proxy; nothing lost, nothing misattributed.

The proxy (uvicorn on 127.0.0.1, this process) answers from an instant engine (scripted tokens, no model;
every other reply is a tool call), so the figures are the proxy's own cost: validation, chat template,
token-in-token-out prompts, tokenization, tool-call parsing, recording. The clients run in a child process
(aiohttp, at most `--connections` requests in flight) so they do not share the proxy's GIL or inflate its
RSS. Each episode's calls continue one another (the assistant reply, then a tool result or a user turn) and
its first user message carries a per-episode marker. Afterwards, from `proxy.close_episode`'s records:
lost calls (an episode with other than `--calls` records, or a non-200), misattributed calls (a call whose
messages lack its episode's marker or carry another's), and episodes that do not merge into one sample.

    python benchmarks/proxy_load.py [--episodes 1000] [--calls 5] [--connections 64]

Exits 1 when anything was lost, misattributed or unmerged.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import re
import resource
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ajet.llm_call import Completion, SamplingParams  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
REPLIES = ['Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>',
           "The answer is 42."]
MARKER = re.compile(r"EPISODE-[0-9a-f]{12}")


class InstantEngine:
    """Answers at once with scripted replies, alternating a tool call and a text answer."""

    def __init__(self, tokenizer):
        self.replies = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in REPLIES]
        self.policy_version = 0
        self.n = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None) -> Completion:
        """The next scripted reply; never calls `on_tokens` (the proxy then streams the finished reply)."""
        ids = self.replies[self.n % len(self.replies)]
        self.n += 1
        return Completion(list(ids), [-0.1] * len(ids), "stop", 0)


# ---- the client process ---------------------------------------------------------------------------
async def _episode(session, limit, base_url, api_key, marker, n_calls, out):
    import aiohttp  # noqa: F401 - imported in the child

    messages = [{"role": "system", "content": "You can call tools."},
                {"role": "user", "content": f"[{marker}] What is 6 * 7?"}]
    for turn in range(n_calls):
        body = {"model": "policy", "messages": messages, "tools": [TOOL]}
        t_queued = time.perf_counter()
        async with limit:
            t0 = time.perf_counter()
            try:
                async with session.post(base_url + "/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {api_key}"}) as r:
                    payload = await r.json(content_type=None)
                    status = r.status
            except Exception as exc:  # noqa: BLE001 - counted as lost, reported
                out["errors"].append(f"{type(exc).__name__}: {exc}")
                return
            t1 = time.perf_counter()
        out["latency"].append(t1 - t0)
        out["latency_queued"].append(t1 - t_queued)
        if status != 200:
            out["errors"].append(f"HTTP {status}: {str(payload)[:200]}")
            return
        msg = payload["choices"][0]["message"]
        messages = messages + [{k: v for k, v in msg.items() if v is not None}]
        if msg.get("tool_calls"):
            messages += [{"role": "tool", "tool_call_id": tc["id"], "content": "42"} for tc in msg["tool_calls"]]
        else:
            messages.append({"role": "user", "content": f"Turn {turn + 2}: and doubled?"})


async def _clients(endpoints, n_calls, connections):
    import aiohttp

    out = {"latency": [], "latency_queued": [], "errors": []}
    limit = asyncio.Semaphore(connections)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections), timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(_episode(session, limit, url, key, marker, n_calls, out)
                               for url, key, marker in endpoints))
        out["wall_s"] = time.perf_counter() - t0
    return out


def run_clients(endpoints: list[tuple[str, str, str]], n_calls: int, connections: int) -> dict:
    """In the child process: all episodes at once, at most `connections` requests in flight. Returns latencies
    (seconds, in flight and including the wait for a connection), error strings and the wall time (s)."""
    return asyncio.run(_clients(endpoints, n_calls, connections))


# ---- the proxy process ----------------------------------------------------------------------------
def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def _pct(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100)[p - 1] * 1e3 if len(xs) > 1 else float("nan")


def main() -> int:
    """Run the load, print the figures; returns the exit code (1 when a call was lost or misattributed)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--connections", type=int, default=64, help="most requests in flight at once")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from ajet.proxy.server import ProxyServer
    from ajet.tracker import merge_calls
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(d))
    proxy = ProxyServer(InstantEngine(tok), tok, SamplingParams(max_tokens=64)).start()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        pool.submit(int, 0).result()          # start the client process before measuring
        rss_before = _peak_rss_mib()
        eps = [proxy.open_episode(f"e{i}") for i in range(args.episodes)]
        markers = [f"EPISODE-{secrets.token_hex(6)}" for _ in eps]
        endpoints = [(ep.base_url, ep.api_key, m) for ep, m in zip(eps, markers)]
        out = pool.submit(run_clients, endpoints, args.calls, args.connections).result(timeout=600)
    rss_after = _peak_rss_mib()

    lost = misattributed = unmerged = 0
    for i, (ep, marker) in enumerate(zip(eps, markers)):
        calls = proxy.close_episode(ep)
        lost += abs(args.calls - len(calls))
        for c in calls:
            found = set(MARKER.findall(" ".join(str(m.get("content")) for m in c.messages)))
            if found != {marker} or c.episode_id != f"e{i}":
                misattributed += 1
        unmerged += len(merge_calls(calls, group_id=f"g{i}")) != 1
    proxy.stop()

    total = len(out["latency"])
    print(f"episodes x calls       {args.episodes} x {args.calls} (at most {args.connections} in flight)")
    print(f"calls answered         {total} of {args.episodes * args.calls}")
    print(f"wall time              {out['wall_s']:.2f} s")
    print(f"throughput             {total / out['wall_s']:.0f} calls/s")
    print(f"latency in flight      p50 {_pct(out['latency'], 50):.1f} ms   p99 {_pct(out['latency'], 99):.1f} ms")
    print(f"latency incl. queueing p50 {_pct(out['latency_queued'], 50):.1f} ms   "
          f"p99 {_pct(out['latency_queued'], 99):.1f} ms")
    print(f"proxy peak RSS         {rss_before:.0f} MiB before, {rss_after:.0f} MiB after")
    print(f"client errors          {len(out['errors'])}" + (f" (first: {out['errors'][0]})" if out["errors"] else ""))
    print(f"lost calls             {lost}")
    print(f"misattributed calls    {misattributed}")
    print(f"episodes not 1 sample  {unmerged}")
    return 1 if lost or misattributed or unmerged or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
