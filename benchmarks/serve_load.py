"""`ajet serve` under load: >= 200 concurrent clients on 127.0.0.1, about 10% of them killed mid-episode,
the server itself SIGKILLed once and restarted with `--resume`, over >= 1,000 episodes (docs/serve.md).

The server is the real `python -m ajet serve` (debug backbone) on the **tiny random model** of
`tests/tiny_model.py` (2 layers, hidden 64; `rollout.max_tokens: 4`): SmolLM2 would make 1,000 episodes and
their updates far too slow on a 2-core machine, and what is measured here is the server's bookkeeping,
not the model. Every step really trains (GRPO update, ledger, checkpoint every step).

The clients are `--procs` processes of `--clients / --procs` asyncio clients each (`ajet.client.AsyncAjetClient`
for the episode API, httpx for the one chat call of each episode). A client logs each episode the server
acknowledged ("finished", or a retried finish answered `episode_already_finished`) to its process's
jsonl file at once. Killed clients: one whole client process is SIGKILLed mid-run (its clients' episodes
are mid-call or between calls) and started again, and each client dies mid-episode (drops its connection,
never finishes) with probability `--die` per episode and is replaced by a new one. The server is SIGKILLed
once, when `--kill-at` of the episodes are acknowledged, and restarted on the same port with `--resume`;
the clients retry through the gap.

    python benchmarks/serve_load.py [--clients 220] [--procs 10] [--steps 30] [--tasks-per-step 16]

Prints, from the trajectory store's ledger after the run: acknowledged episodes lost (acknowledged but not
in the store; must be 0), episodes trained twice by live updates (must be 0), acknowledged episodes left
untrained (their groups were still open when the run ended), the clients killed, and the server's RSS over
time (it should stay flat once warm). The peer is the server itself: RSS late in the run / RSS early.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SECRET = "load-secret-0123456789abcdef"


# ---- the client side (one process: many asyncio clients) --------------------------------------------
async def _one_client(url: str, k: int, out, die: float, stats: dict) -> None:
    """Episodes until the run is finished; with probability `die` per episode, die mid-episode (the
    connection dropped, no finish) and come back as a new client."""
    import httpx

    from ajet.client import AjetClientError, AsyncAjetClient, EpisodeGone, RunFinished

    rng = random.Random(f"{os.getpid()}-{k}")
    gen = 0
    while True:
        client = AsyncAjetClient(url, secret=SECRET, client_id=f"p{os.getpid()}-c{k}-{gen}", retry_for_s=180,
                                 timeout_s=120)
        llm = httpx.AsyncClient(timeout=120)
        try:
            while True:
                try:
                    ep = await client.begin()
                except (RunFinished, httpx.TransportError):   # over (a client that missed the 410: server gone)
                    return
                dies = rng.random() < die
                try:
                    call = llm.post(ep.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                                    json={"model": ep.model, "messages": [{"role": "user", "content": ep.task["query"]}]})
                    if dies:                                   # killed mid-call: the request is cut off
                        task = asyncio.ensure_future(call)
                        await asyncio.sleep(rng.random() * 0.05)
                        task.cancel()
                        stats["died"] += 1
                        break
                    r = await call
                    reward = float(len(r.text) % 3) if r.status_code == 200 else 0.0
                    done = await ep.finish(reward=reward)
                except (EpisodeGone, httpx.TransportError):    # abandoned, or the server restarted
                    continue
                except AjetClientError as exc:
                    stats["refused"] += 1
                    print(f"refused: {exc}", file=sys.stderr, flush=True)
                    continue
                if done.get("status") in ("finished", "episode_already_finished"):
                    out.write(json.dumps({"episode_id": ep.episode_id, "reward": reward, "t": time.time()}) + "\n")
                    out.flush()
        finally:
            await llm.aclose()
            await client.aclose()
        gen += 1


def client_process(url: str, n: int, die: float, log_path: str) -> None:
    """Entry of one client process: `n` asyncio clients; acknowledged episodes -> `log_path` (jsonl)."""
    stats = {"died": 0, "refused": 0}

    async def main():
        with open(log_path, "a") as out:
            await asyncio.gather(*(_one_client(url, k, out, die, stats) for k in range(n)))

    asyncio.run(main())
    Path(log_path + ".stats").write_text(json.dumps(stats))


# ---- the server side ---------------------------------------------------------------------------------
def _conf(d: Path, model: str, steps: int, tasks_per_step: int, num_repeat: int, idle_s: float) -> Path:
    (d / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"What is {i} plus 1?",
                                                      "answer": str(i + 1)}) + "\n" for i in range(400)))
    conf = d / "conf.yaml"
    conf.write_text(textwrap.dedent(f"""
        model: {{path: "{model}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: {num_repeat}, max_tokens: 4}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {steps}, tasks_per_step: {tasks_per_step}, save_freq: 1, tensorboard: false}}
        serve: {{episode_idle_timeout_s: {idle_s}}}
    """))
    return conf


def _start_server(conf: Path, exp: Path, port: int, resume: bool, log) -> subprocess.Popen:
    env = {**os.environ, "AJET_SECRET": SECRET}
    cmd = [sys.executable, "-m", "ajet", "serve", "--conf", str(conf), "--exp-dir", str(exp), "--port", str(port)]
    proc = subprocess.Popen(cmd + (["--resume"] if resume else []), stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=conf.parent)
    return proc


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _wait_up(port: int, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ajet/v1/status", headers={"Authorization": f"Bearer {SECRET}"},
                         timeout=5).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise RuntimeError("ajet serve did not come up")


def _acked(logs: list[Path]) -> list[dict]:
    rows = []
    for p in logs:
        if p.exists():
            for line in p.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:      # a line torn by the client process's SIGKILL: never acknowledged output
                    pass
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=220)
    ap.add_argument("--procs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tasks-per-step", type=int, default=16)
    ap.add_argument("--num-repeat", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=4.0, help="serve.episode_idle_timeout_s")
    ap.add_argument("--die", type=float, default=0.02, help="per-episode chance that a client dies mid-episode")
    ap.add_argument("--kill-at", type=float, default=0.4, help="SIGKILL the server at this share of the episodes")
    ap.add_argument("--keep", help="keep the experiment in this folder (default: a temporary one)")
    args = ap.parse_args()
    from tests.tiny_model import build_tiny_model

    work = Path(args.keep or tempfile.mkdtemp(prefix="ajet-serve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(str(work / "model"))
    conf = _conf(work, model, args.steps, args.tasks_per_step, args.num_repeat, args.idle_s)
    exp, trained_target = work / "exp", args.steps * args.tasks_per_step * args.num_repeat
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server_log = open(work / "server.log", "w")
    server = _start_server(conf, exp, port, False, server_log)
    _wait_up(port)
    t0 = time.monotonic()

    per = args.clients // args.procs
    logs = [work / f"client{i}.jsonl" for i in range(args.procs + 1)]
    cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import serve_load as s; "
           "s.client_process(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])",
           str(Path(__file__).resolve().parent)]
    procs = [subprocess.Popen(cmd + [url, str(per), str(args.die), str(logs[i])], cwd=ROOT) for i in range(args.procs)]
    rss: list[tuple[float, int, float]] = []           # (seconds, acknowledged, server RSS MiB)
    process_killed = server_killed = False
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.is_set():
            mib = _rss_mib(server.pid)
            if mib is not None:
                rss.append((time.monotonic() - t0, len(_acked(logs)), mib))
            stop_sampling.wait(2.0)

    threading.Thread(target=sample, daemon=True).start()
    try:
        deadline = time.monotonic() + 3600
        while server.poll() is None or not server_killed:
            assert time.monotonic() < deadline, "the run did not finish within an hour"
            acked = len(_acked(logs))
            if not process_killed and acked >= 0.2 * trained_target:     # ~10% of the clients die at once
                os.kill(procs[0].pid, signal.SIGKILL)
                procs[0].wait()
                procs.append(subprocess.Popen(cmd + [url, str(per), str(args.die), str(logs[-1])], cwd=ROOT))
                process_killed = True
                print(f"[{time.monotonic() - t0:.0f}s] SIGKILLed client process 1 of {args.procs} ({per} clients); "
                      "started a fresh one", flush=True)
            if not server_killed and acked >= args.kill_at * trained_target:
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
                killed_at = acked
                print(f"[{time.monotonic() - t0:.0f}s] SIGKILLed the server at {acked} acknowledged episodes; "
                      "restarting with --resume", flush=True)
                server = _start_server(conf, exp, port, True, server_log)
                server_killed = True
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        server_rc = server.returncode
        end = time.monotonic() + 15                      # clients hear 410 run_finished; stragglers are killed
        for p in procs[1:]:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        stop_sampling.set()
        for p in [server, *procs]:
            if p.poll() is None:
                p.kill()
        server_log.close()

    from ajet.trajectory_store import TrajectoryStore

    store = TrajectoryStore(exp / "trajectories.sqlite")
    ledger, stored = store.ledger(), {r["episode_id"] for r in store.episodes()}
    store.close()
    acked = _acked(logs)
    acked_ids = {r["episode_id"] for r in acked}
    fate = {e["episode_id"]: e for e in ledger}          # ids carry their attempt ("a1-..."): unique
    lost = sorted(acked_ids - stored)
    trained_twice = [e for e in ledger if len(e["trained_in"]) > 1]
    untrained = sorted(i for i in acked_ids if i in fate and not fate[i]["trained_in"])
    trained = sum(1 for e in ledger if e["trained_in"])
    died = sum(json.loads(Path(str(p) + ".stats").read_text())["died"] for p in logs if Path(str(p) + ".stats").exists())
    abandoned = sum(1 for e in ledger if not e["ok"])

    print(f"\nserve_load: {args.clients} clients in {args.procs} processes, tiny random model, {args.steps} steps x "
          f"{args.tasks_per_step} groups x {args.num_repeat}; server exit code {server_rc}; {elapsed:.0f} s")
    print(f"  episodes acknowledged to clients      {len(acked_ids)}  ({len(acked)} lines)")
    print(f"  episodes stored (all, incl. abandoned) {len(ledger)}; trained {trained} (target {trained_target})")
    print(f"  clients killed                        {per} (one SIGKILLed process) + {died} died mid-episode "
          f"(in the surviving processes); episodes stored abandoned/failed: {abandoned}")
    print(f"  server SIGKILLed once at              {killed_at} acknowledged episodes, resumed")
    print(f"  ACKNOWLEDGED EPISODES LOST            {len(lost)}  {lost[:5]}")
    print(f"  EPISODES TRAINED TWICE                {len(trained_twice)}  {[e['episode_id'] for e in trained_twice[:5]]}")
    print(f"  acknowledged, left untrained          {len(untrained)}  (groups still open when the run ended)")
    print("  server RSS over time (s, acknowledged, MiB):")
    step = max(1, len(rss) // 16)
    for t, n, mib in rss[::step] + rss[-1:]:
        print(f"    {t:7.0f} {n:6d} {mib:8.1f}")
    second = [r for r in rss if r[1] >= killed_at]        # the resumed server's life
    if len(second) >= 8:
        q = len(second) // 4
        early = sorted(m for *_, m in second[q:2 * q])[q // 2]
        late = sorted(m for *_, m in second[-q:])[q // 2]
        print(f"  resumed server RSS: median of its 2nd quarter {early:.1f} MiB, of its last quarter {late:.1f} MiB "
              f"(late / early = {late / early:.3f})")


if __name__ == "__main__":
    main()
