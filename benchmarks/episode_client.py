"""CPU time to build the OpenAI client an episode uses: the SDK's default against `Tuner.client`.

ajet builds one `openai.AsyncOpenAI` client per episode (`Tuner.client`); the SDK's default httpx client makes a new
TLS context for each, loading certifi's CA bundle, while `Tuner.client` shares one (`ajet/tls.py`). Both sides are
built `--clients` times, alternating in rounds, in this process; printed: ms of CPU (process time) per client and
the ratio.

    python benchmarks/episode_client.py [--clients 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from ajet.workflow import Tuner

URL = "http://127.0.0.1:9/v1"      # never contacted: building a client opens no connection


def _sdk_default(i: int):
    return openai.AsyncOpenAI(base_url=URL, api_key="k", max_retries=2, timeout=600)


def _tuner(i: int):
    return Tuner(URL, "k", "m", f"e{i}").client


def _cpu_ms_per_client(build, n: int) -> float:
    t0 = time.process_time()
    for i in range(n):
        build(i)
    return (time.process_time() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    _tuner(0), _sdk_default(0)                         # imports and the shared context, not measured
    sdk, ours = [], []
    for r in range(args.rounds):
        sdk.append(_cpu_ms_per_client(_sdk_default, args.clients))
        ours.append(_cpu_ms_per_client(_tuner, args.clients))
        print(f"round {r}: SDK default {sdk[-1]:.2f} ms, Tuner.client {ours[-1]:.2f} ms of CPU per client")
    a, b = statistics.median(sdk), statistics.median(ours)
    print(f"median: SDK default {a:.2f} ms, Tuner.client {b:.2f} ms per client ({a / b:.0f}x less)")


if __name__ == "__main__":
    main()
