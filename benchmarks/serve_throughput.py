"""`ajet serve` throughput: episodes/s and calls/s with 1, 4 and 16 client processes, beside the in-process
rollout of the same agent on the same proxy.

Both sides answer from an instant engine (scripted tokens, no model: `proxy_load.InstantEngine`), so the
figures are ajet's own cost. The serve side is the real episode API + proxy on one uvicorn server
(`ajet.serve.api`), fed by an `EpisodeQueue` whose groups a collector thread takes as fast as they complete
(no training); each client process runs `ajet.client.AjetClient` episodes of `--calls` chat calls
(begin -> calls through the OpenAI SDK -> finish). The in-process side runs the same agent as a `Workflow`
through `ajet.rollout.episodes.rollout` with the same number of episodes in flight.

    python benchmarks/serve_throughput.py [--episodes 64] [--calls 2] [--clients 1 4 16]

Prints one row per client count: episodes/s and calls/s for serve and in-process, and serve / in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_load import InstantEngine  # noqa: E402

from ajet.workflow import Workflow, WorkflowOutput  # noqa: E402

SECRET = "benchmark-secret-0123456789"


class TwoCallAgent(Workflow):
    """The benchmark's agent as a Workflow: `calls` chat calls, each continuing the last."""

    def __init__(self, calls: int):
        self.calls = calls

    async def execute(self, task, tuner):
        messages = [{"role": "user", "content": task.query}]
        for _ in range(self.calls):
            r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        return WorkflowOutput(reward=1.0)


def _client_process(url: str, episodes: int, calls: int, ready, go) -> None:
    """One client process: `episodes` episodes of `calls` calls through the episode API."""
    import openai  # noqa: F401 - imported before the clock starts, as a running agent has it

    from ajet.client import AjetClient

    client = AjetClient(url, secret=SECRET, retry_for_s=60)
    client.status()                   # connected
    ready.wait()
    go.wait()
    for _ in range(episodes):
        with client.episode() as ep:
            llm = ep.openai(max_retries=0)
            messages = [{"role": "user", "content": ep.task["query"]}]
            for _ in range(calls):
                r = llm.chat.completions.create(model=ep.model, messages=messages)
                messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
            ep.finish(reward=1.0)


def _serve_side(tok, tasks, n_clients: int, episodes: int, calls: int) -> float:
    """Seconds for `episodes` episodes run by `n_clients` client processes against the episode API."""
    from ajet.llm_call import SamplingParams
    from ajet.proxy.server import ProxyServer
    from ajet.rollout.episode_queue import EpisodeQueue
    from ajet.serve.api import build_api, compose
    from ajet.task_sampler import MultiTaskSampler

    per_client = episodes // n_clients
    total = per_client * n_clients
    queue = EpisodeQueue(MultiTaskSampler({"train": tasks}), num_repeat=4, tasks_per_step=4, total_steps=10**6, first_step=1, attempt=0,
                         record=lambda step, ep: None, idle_timeout_s=600)
    proxy = ProxyServer(InstantEngine(tok), tok, SamplingParams(max_tokens=64))
    queue.bind(proxy)
    proxy.app = compose(proxy.app, build_api(queue, SECRET), queue.activity)
    proxy.start()
    collected, stop = [0], threading.Event()

    def collector() -> None:
        step = 1
        while not stop.is_set() and collected[0] < total:
            collected[0] += len(queue.collect(step))
            queue.step_done(step)
            step += 1

    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(n_clients + 1), ctx.Event()
    procs = [ctx.Process(target=_client_process, args=(proxy.url, per_client, calls, ready, go)) for _ in range(n_clients)]
    for p in procs:
        p.start()
    ready.wait()                      # every client imported and connected: time only the episodes
    threading.Thread(target=collector, daemon=True).start()
    t0 = time.perf_counter()
    go.set()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - t0
    stop.set()
    assert queue.counts["finished"] == total, queue.counts
    proxy.stop()
    return elapsed


def _in_process_side(tok, tasks, concurrency: int, episodes: int, calls: int) -> float:
    from ajet.llm_call import SamplingParams
    from ajet.proxy.server import ProxyServer
    from ajet.rollout.episodes import rollout

    proxy = ProxyServer(InstantEngine(tok), tok, SamplingParams(max_tokens=64)).start()
    t0 = time.perf_counter()
    done = asyncio.run(rollout(TwoCallAgent(calls), tasks[: episodes // 4], 4, proxy, None, 1, concurrency, 600))
    elapsed = time.perf_counter() - t0
    assert all(e.ok for e in done) and len(done) == episodes // 4 * 4
    proxy.stop()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from ajet.task import Task
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(d))
    tasks = [Task(f"t{i}", f"What is {i} plus {i}?") for i in range(args.episodes)]
    print(f"{args.episodes} episodes x {args.calls} calls, instant engine\n"
          f"{'clients':>8} | {'serve ep/s':>10} {'calls/s':>8} | {'in-process ep/s':>15} {'calls/s':>8} | serve/in-process")
    for n in args.clients:
        eps = args.episodes // n * n
        s = _serve_side(tok, tasks, n, eps, args.calls)
        i = _in_process_side(tok, tasks, n, eps, args.calls)
        print(f"{n:>8} | {eps / s:>10.1f} {eps * args.calls / s:>8.1f} | {eps / i:>15.1f} {eps * args.calls / i:>8.1f} | "
              f"{i / s:.2f}")


if __name__ == "__main__":
    main()
