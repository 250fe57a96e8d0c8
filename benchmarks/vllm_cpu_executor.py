"""vLLM on CPU: ajet's executor (the model run inside the engine core) against vLLM's default (a worker process).

    python benchmarks/vllm_cpu_executor.py [--calls 64] [--at-once 16] [--max-tokens 48] [--rounds 2]

Without CUDA ajet starts its vLLM server with `VLLM_ENABLE_V1_MULTIPROCESSING=0`
(`ajet.engines.vllm_server.CPU_IN_PROCESS_EXECUTOR`): vLLM's uni-process executor, the model run by the engine core
with torch's threads. vLLM's own default on CPU is a worker process bound to one core, whose engine core waits for
each model step by busy-looping (`sched_yield`) on another core. This script starts ajet's `VLLMServer` both ways
(SmolLM2-135M-Instruct, fp32, `--enforce-eager`, 1 GiB KV cache), one server at a time, and times the same
requests: `--calls` seeded completions of `--max-tokens` tokens each (`ignore_eos`), `--at-once` in flight, sent
straight to the server's /v1/completions. The variants alternate for `--rounds` rounds. Printed per run: the
server's start (to /health 200, s), the batch's wall time (s) and tokens/s, the CPU time (user + system, s) that the
server's processes used for the batch (summed over ajet's watchdog and its descendants), their PSS after the
batch (GB), their count, and the 1-minute load average; at the end the ratios (default / ajet's) of the mean
wall time and the mean CPU time.

Torch's threads: OMP_NUM_THREADS as the environment gives it (unset: one per core), for both variants; vLLM's
default binds its worker to the cores it chooses whatever it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ajet.engines.vllm_server import CPU_IN_PROCESS_EXECUTOR, VLLMServer  # noqa: E402
from ajet.model import resolve_model_path  # noqa: E402
from benchmarks.engines import process_tree_memory  # noqa: E402

VARIANTS = {"ajet (in-process executor)": CPU_IN_PROCESS_EXECUTOR[1], "vLLM default (worker process)": "1"}


def tree_cpu_s(pid: int) -> float:
    """User + system CPU time (s) of process `pid` and its live descendants (psutil), as `process_tree_memory`
    counts memory. Raises psutil.NoSuchProcess when `pid` itself does not exist."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:         # gone meanwhile
            continue
    return total


def complete(url: str, name: str, i: int, max_tokens: int) -> int:
    """One seeded completion of exactly `max_tokens` tokens; returns the tokens generated."""
    body = {"model": name, "prompt": f"Question {i}: name three colours, then explain why the sky is blue.",
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "ignore_eos": True}
    req = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def run_variant(label: str, value: str, args: argparse.Namespace, folder: Path) -> dict:
    """Start a server with VLLM_ENABLE_V1_MULTIPROCESSING=`value`, warm it with 2 calls, time the batch."""
    os.environ[CPU_IN_PROCESS_EXECUTOR[0]] = value          # VLLMServer keeps a value the environment sets
    server = VLLMServer(resolve_model_path("smollm2-135m-instruct"), folder / f"vllm-{value}.log", kv_cache_gb=1,
                        max_model_len=2048, max_num_seqs=args.at_once, extra_args=["--enforce-eager"],
                        start_timeout_s=1800)
    t0 = time.monotonic()
    url = server.start()
    start_s = time.monotonic() - t0
    try:
        for i in range(2):
            complete(url, server.served_model_name, 10_000 + i, 4)
        cpu0, t0 = tree_cpu_s(server.process.pid), time.monotonic()
        with ThreadPoolExecutor(args.at_once) as pool:
            tokens = sum(pool.map(lambda i: complete(url, server.served_model_name, i, args.max_tokens),
                                  range(args.calls)))
        wall, cpu = time.monotonic() - t0, tree_cpu_s(server.process.pid) - cpu0
        _, pss, count = process_tree_memory(server.process.pid)
    finally:
        server.stop()
    row = {"variant": label, "start_s": start_s, "wall_s": wall, "tok_s": tokens / wall, "cpu_s": cpu,
           "pss_gb": pss / 1e9, "processes": count, "load": os.getloadavg()[0]}
    print(f"{label:30s} start {start_s:5.0f} s  batch {wall:6.1f} s  {row['tok_s']:6.1f} tok/s  CPU {cpu:6.1f} s  "
          f"PSS {row['pss_gb']:.2f} GB over {count} processes  load {row['load']:.1f}", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--at-once", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"{args.calls} calls of {args.max_tokens} tokens, {args.at_once} at once; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows: dict[str, list[dict]] = {label: [] for label in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(VARIANTS.items())
            for label, value in order if r % 2 == 0 else order[::-1]:
                rows[label].append(run_variant(label, value, args, Path(tmp)))

    def mean(label: str, key: str) -> float:
        return sum(x[key] for x in rows[label]) / len(rows[label])

    ours, theirs = list(VARIANTS)
    print(f"default / ajet's: wall time {mean(theirs, 'wall_s') / mean(ours, 'wall_s'):.2f}x, "
          f"CPU time {mean(theirs, 'cpu_s') / mean(ours, 'cpu_s'):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
