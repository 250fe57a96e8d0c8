"""Does a request with a huge number of tiny items stall other episodes' calls? (issue 24, item 5)

The proxy (uvicorn on 127.0.0.1, this process, the instant engine of `proxy_load.py`) serves two kinds of
clients at once, both in a child process so they do not share the proxy's GIL: one episode calling
`/chat/completions` with a small conversation in a loop, and `--big` requests (each `--messages` tiny
messages, ~30 bytes apiece: under the 8 MiB body limit) sent together a second into the loop. Printed:
the small calls' latency before and while the big requests are in the proxy (median, max), and how the
big requests were answered and how long they took.

    python benchmarks/proxy_big_requests.py [--big 3] [--messages 200000] [--one-message]

Before the item cap (`MAX_JSON_ITEMS`) each big request was validated, dumped and rendered in the
2-thread prepare pool (seconds each) and the small calls queued behind them; with it each is a 400 after
a walk of at most 20,000 objects. Run it on the tree before the change (PYTHONPATH=<that tree>) for the
ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ajet.llm_call import SamplingParams  # noqa: E402

SMALL = {"model": "policy", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is 6 * 7?"}]}


def run_clients(small_url: str, small_key: str, big: list[tuple[str, str]], n_messages: int,
                one_message: bool = False) -> dict:
    """In the child process: the small-call loop, and after 1 s the big requests all at once. Returns the
    small calls as (start offset s, latency s, status), and each big request's (status, seconds)."""
    import httpx
    import orjson

    messages = ([{"role": "user", "content": "a, " * (10 * n_messages)}] if one_message   # the same bytes, 1 item
                else [{"role": "user", "content": "a"}] * n_messages)
    body = orjson.dumps({"model": "policy", "messages": messages})
    small: list[tuple[float, float, int]] = []
    bigs: list[tuple[int, float]] = []
    done = threading.Event()
    window: dict[str, float] = {}
    t_zero = time.perf_counter()

    def small_loop():
        with httpx.Client(timeout=300) as http:
            while not done.is_set() or time.perf_counter() - window.get("end", 1e18) < 0.5:
                t0 = time.perf_counter()
                r = http.post(small_url + "/chat/completions", json=SMALL,
                              headers={"Authorization": f"Bearer {small_key}"})
                small.append((t0 - t_zero, time.perf_counter() - t0, r.status_code))

    def big_one(url: str, key: str):
        with httpx.Client(timeout=300) as http:
            t0 = time.perf_counter()
            r = http.post(url + "/chat/completions", content=body,
                          headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})
            bigs.append((r.status_code, time.perf_counter() - t0))

    loop = threading.Thread(target=small_loop)
    loop.start()
    time.sleep(1.0)
    window["start"] = time.perf_counter() - t_zero
    threads = [threading.Thread(target=big_one, args=b) for b in big]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window["end"] = time.perf_counter()
    done.set()
    loop.join()
    return {"small": small, "big": bigs, "big_start": window["start"],
            "big_end": window["end"] - t_zero, "body_mib": len(body) / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", type=int, default=3, help="big requests sent at once")
    ap.add_argument("--messages", type=int, default=200_000, help="tiny messages in each big request")
    ap.add_argument("--one-message", action="store_true",
                    help="instead, one message of as many bytes (what a body of that size costs anyway)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from ajet.proxy.server import ProxyServer
    from benchmarks.proxy_load import InstantEngine
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(d))
    proxy = ProxyServer(InstantEngine(tok), tok, SamplingParams(max_tokens=16)).start()
    try:
        small_ep = proxy.open_episode("small")
        big_eps = [proxy.open_episode(f"big-{i}") for i in range(args.big)]
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            out = pool.submit(run_clients, small_ep.base_url, small_ep.api_key,
                              [(e.base_url, e.api_key) for e in big_eps], args.messages, args.one_message).result()
    finally:
        proxy.stop()
    before = [lat for t0, lat, _ in out["small"] if t0 + lat < out["big_start"]]
    during = [lat for t0, lat, _ in out["small"] if t0 < out["big_end"] and t0 + lat > out["big_start"]]
    bad = sum(status != 200 for *_, status in out["small"])
    shape = "one message" if args.one_message else f"{args.messages} tiny messages"
    print(f"{args.big} big requests x {shape} ({out['body_mib']:.1f} MiB each), "
          f"instant engine, tiny tokenizer")
    print(f"  big requests: status {sorted({s for s, _ in out['big']})}, "
          f"{max(t for _, t in out['big']):.2f} s the slowest")
    print(f"  small calls before: {len(before)}, median {statistics.median(before) * 1e3:.1f} ms, "
          f"max {max(before) * 1e3:.1f} ms")
    print(f"  small calls while the big requests ran: {len(during)}, median "
          f"{statistics.median(during) * 1e3:.1f} ms, max {max(during) * 1e3:.1f} ms (the stall)")
    print(f"  small calls not answered 200: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
