"""Starting a sandboxed tool from a big trainer process: ajet's spawn (vfork + exec) vs fork + exec.

    python benchmarks/tool_spawn.py [--rss-gb 4] [--runs 20]

This process first touches `--rss-gb` GiB of memory (a stand-in for a trainer holding a model), then times
`run_python_async("pass")` (asyncio subprocess: CPython's `_posixsubprocess` uses vfork when no `preexec_fn`
is given, so the parent's page tables are not copied) against the peer, the same child started with
`subprocess.Popen(..., preexec_fn=...)` (which forces fork + exec, the old sandbox's way: the kernel copies the
page tables of every mapped GiB). Printed: median / max seconds of each and the ratio fork / ajet, at the given
RSS and at a small RSS. Only the start is compared: both run the same `python -I -S -c pass` child, isolation
"none" (bubblewrap's own start-up is the same for both and would hide the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from ajet.tools.sandbox import run_python_async

CHILD = [sys.executable, "-I", "-S", "-c", "pass"]


def spawn_vfork(runs: int) -> list[float]:
    """Seconds per start with asyncio's subprocess (vfork + exec) of the bare child."""
    async def one() -> float:
        t0 = time.perf_counter()
        p = await asyncio.create_subprocess_exec(*CHILD, start_new_session=True)
        t1 = time.perf_counter()
        await p.wait()
        return t1 - t0

    async def main() -> list[float]:
        return [await one() for _ in range(runs)]

    return asyncio.run(main())


def spawn_fork(runs: int) -> list[float]:
    """Seconds per start when a preexec_fn forces fork + exec (the pre-async sandbox's rlimit setup)."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.Popen(CHILD, preexec_fn=lambda: None)
        out.append(time.perf_counter() - t0)
        p.wait()
    return out


def sandbox_round_trip(runs: int) -> list[float]:
    """Seconds for a whole `run_python_async("pass")` (spawn + interpreter start + exit), for scale."""
    async def main() -> list[float]:
        out = []
        for _ in range(runs):
            r = await run_python_async("pass", isolation="none")
            out.append(r.wall_s)
        return out

    return asyncio.run(main())


def report(label: str, runs: int) -> None:
    fork, vfork = spawn_fork(runs), spawn_vfork(runs)
    f, v = statistics.median(fork), statistics.median(vfork)
    print(f"{label:>12} | fork+exec start median {f * 1e3:7.2f} ms (max {max(fork) * 1e3:7.2f}) | "
          f"ajet vfork+exec start median {v * 1e3:7.2f} ms (max {max(vfork) * 1e3:7.2f}) | fork/ajet {f / v:6.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rss-gb", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    report("small RSS", args.runs)
    ballast = bytearray(int(args.rss_gb * 2**30))
    for i in range(0, len(ballast), 4096):   # touch every page so it is mapped
        ballast[i] = 1
    report(f"{args.rss_gb:g} GiB RSS", args.runs)
    rt = sandbox_round_trip(args.runs)
    print(f"{'':>12} | whole run_python_async('pass') at {args.rss_gb:g} GiB: median {statistics.median(rt):.3f} s")
    del ballast


if __name__ == "__main__":
    main()
