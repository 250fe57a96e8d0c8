"""Peak resident memory of the main job, per phase: model load, rollout, held-out evaluation, update, checkpoint.

    python benchmarks/main_job_memory.py [--steps 3] [--val-tasks 64] [--seed 0] [--full] [--set KEY=VALUE ...]
        [--heap-trim-interval S] [--eval-only] [--update-only GROUPS]

Runs the README's main job (`tutorial/example_math_agent/math_agent.yaml`, debug backbone) in this process with
the same shapes, shortened by default: `--steps` GRPO steps (each 4 tasks x 4 episodes, dynamic sampling on),
a checkpoint every `--save-freq` steps, and the held-out evaluation (greedy, batches of 32) before step 1 and
after the last step on the first `--val-tasks` held-out problems (`--full`: the whole job, 16 steps and all 160).
A thread reads the process's resident set size (RSS, `/proc/self/statm`) every 10 ms and charges each reading to
the phase running then (the trainer's own calls are wrapped: `source.collect`, `Validator.__call__`,
`backbone.update`, `checkpoint.save`; everything else is "other", e.g. merging samples and logging).

`--set KEY=VALUE` overrides a config field (e.g. `--set model.gradient_checkpointing=false` for the update without
activation checkpointing; on a loaded machine `--set rollout.episode_timeout_s=7200`, so that slow episodes are not
cut off before the update has anything to train on).

`--eval-only`: only `ajet eval` of the main job's config (the base model) on the first `--val-tasks` problems, its
peak RSS and wall time; `--heap-trim-interval S` sets how often the debug engine may hand the heap back (e.g.
`--eval-only --val-tasks 160 --heap-trim-interval 5` against the engine's default).

Printed: per phase, the peak RSS (GB) and the RSS when the phase last ended; the process's high-water mark
(`ru_maxrss`); wall time; and a digest (sha256) of every token id the run sampled (training episodes in store
order, then each evaluation's episodes), so two runs of one seed can be checked for the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONF = ROOT / "tutorial" / "example_math_agent" / "math_agent.yaml"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PhaseMemory:
    """Peak RSS per named phase, sampled every `interval_s` seconds by a daemon thread. `enter(name)` /
    `leave(token)` nest: the outermost phase open gets the readings."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.current = "load"
        self.peak: dict[str, int] = {}
        self.at_end: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._since = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rss-sampler", daemon=True)

    def start(self) -> PhaseMemory:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._charge(rss_bytes())

    def _charge(self, rss: int) -> None:
        name = self.current
        self.peak[name] = max(self.peak.get(name, 0), rss)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._charge(rss_bytes())

    def enter(self, name: str) -> str | None:
        if self.current not in ("other", "load"):
            return None                     # nested: the outer phase keeps the readings
        self._switch(name)
        return name

    def leave(self, token: str | None) -> None:
        if token is not None:
            self.at_end[token] = rss_bytes()
            self._switch("other")

    def _switch(self, name: str) -> None:
        now = time.perf_counter()
        self._charge(rss_bytes())
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._since
        self._since, self.current = now, name
        self._charge(rss_bytes())


def wrap(owner, attr: str, mem: PhaseMemory, name: str) -> None:
    """Charge every call of `owner.attr` to phase `name`."""
    inner = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        token = mem.enter(name)
        try:
            return inner(*args, **kwargs)
        finally:
            mem.leave(token)

    setattr(owner, attr, wrapped)


def token_digest(exp: Path) -> tuple[str, int]:
    """sha256 over every sampled token id of the run (training calls by episode id and call index, then each
    evaluation's episodes by episode id), and how many ids went in: independent of the order episodes finished."""
    h, n = hashlib.sha256(), 0
    con = sqlite3.connect(exp / "trajectories.sqlite")
    calls = [(e, i, json.loads(r)) for e, i, r in con.execute("select episode_id, idx, record from calls")]
    con.close()
    for p in sorted((exp / "val").glob("step_*/eval_trajectories.jsonl"), key=lambda p: int(p.parent.name[5:])):
        for line in p.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                calls += [(f"{p.parent.name}/{d['episode_id']}", i, c) for i, c in enumerate(d.get("calls", []))]
    for episode, idx, c in sorted(calls, key=lambda t: (t[0], t[1])):
        ids = c.get("completion_ids") or []
        h.update(json.dumps([episode, idx, ids]).encode())
        n += len(ids)
    return h.hexdigest()[:16], n


def parse_overrides(sets: list[str]) -> dict:
    """`--set KEY=VALUE` arguments as config overrides, each value read as YAML (`4096`, `false`, `[1, 2]`)."""
    return {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in sets)}


def held_out_subset(folder: Path, n: int) -> Path:
    """`folder/val.jsonl`: the first `n` problems of the main job's 160 held-out problems (its test set,
    `tasks/test.jsonl`)."""
    val = folder / "val.jsonl"
    val.write_text("\n".join((CONF.parent / "tasks" / "test.jsonl").read_text().splitlines()[:n]) + "\n")
    return val


def eval_only(val_tasks: int) -> None:
    """`ajet eval --conf <the main job's YAML>` on the first `val_tasks` held-out problems, in this process:
    prints the peak RSS (sampled, and `ru_maxrss`), the wall time and pass@1."""
    from ajet.cli import main as cli

    with tempfile.TemporaryDirectory(prefix="ajet-mem-") as tmp:
        val = held_out_subset(Path(tmp), val_tasks)
        mem = PhaseMemory().start()
        token = mem.enter("eval")
        t0 = time.perf_counter()
        cli(["eval", "--conf", str(CONF), "--data", str(val), "--out", str(Path(tmp) / "out"), "--quiet"])
        wall = time.perf_counter() - t0
        mem.leave(token)
        mem.stop()
        pass1 = json.loads((Path(tmp) / "out" / "eval_metrics.json").read_text()).get("pass@1")
    print(f"eval only: {val_tasks} held-out problems, load {os.getloadavg()[0]:.1f}; peak RSS "
          f"{mem.peak['eval'] / 1e9:.2f} GB (ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.2f}"
          f" GB); wall {wall:.0f} s; pass@1 {pass1}")


def update_only(groups: int, overrides: dict) -> None:
    """One update of the main job's shape (`groups` GRPO groups of 4 samples: a ~270-token prompt, a 48-token
    call, a 12-token tool result, a 30-48-token call; `benchmarks/update_where_trained.py`'s samples) on the main
    job's model and config: the peak RSS during the update, and over the RSS just before it."""
    import torch

    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import load_config
    from benchmarks.update_where_trained import main_job_samples

    cfg = load_config(CONF, {"backbone": "debug", **overrides})
    bb = DebugBackbone(cfg)
    samples = main_job_samples(bb.model.config.vocab_size, groups, 4, 268)
    mem = PhaseMemory().start()
    before = rss_bytes()
    token = mem.enter("update")
    t0 = time.perf_counter()
    out = bb.update(samples)
    dt = time.perf_counter() - t0
    mem.leave(token)
    mem.stop()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in bb.model.parameters())).hexdigest()[:16]
    bb.close()
    print(f"update only: {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens, overrides "
          f"{overrides or 'none'}, load {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")
    print(f"RSS before {before / 1e9:.2f} GB, peak during the update {mem.peak['update'] / 1e9:.2f} GB "
          f"(+{(mem.peak['update'] - before) / 1e9:.2f} GB); {dt:.0f} s; optimizer steps {out['optimizer_steps']:.0f}; "
          f"weights after: sha256 {digest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps (the main job: 16)")
    ap.add_argument("--val-tasks", type=int, default=64, help="held-out problems per evaluation (the main job: 160)")
    ap.add_argument("--save-freq", type=int, default=2, help="checkpoint every N steps (the main job: 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full", action="store_true", help="the whole main job: 16 steps, 160 held-out problems, "
                                                         "a checkpoint every 8 steps")
    ap.add_argument("--exp-dir", help="where the run goes (default: a temporary folder, removed after)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override (YAML value), e.g. model.gradient_checkpointing=false")
    ap.add_argument("--eval-only", action="store_true", help="only `ajet eval` of the main job's config (the base "
                    "model, greedy) on the first --val-tasks held-out problems: its peak RSS and wall time")
    ap.add_argument("--heap-trim-interval", type=float, metavar="S", help="the debug engine's heap_trim_interval_s "
                    "(hand the heap back at most every S seconds when rows leave; default: the engine's)")
    ap.add_argument("--update-only", type=int, metavar="GROUPS", help="only one update of GROUPS main-job GRPO "
                                                                        "groups (synthetic samples; no rollout)")
    args = ap.parse_args()
    if args.heap_trim_interval is not None:
        from ajet.backbones.debug import engine

        init = engine.HFEngine.__init__
        engine.HFEngine.__init__ = lambda self, *a, **kw: init(self, *a, **{**kw, "heap_trim_interval_s":
                                                                             args.heap_trim_interval})
    if args.eval_only:
        return eval_only(args.val_tasks)
    if args.update_only:
        return update_only(args.update_only, parse_overrides(args.set))
    if args.full:
        args.steps, args.val_tasks, args.save_freq = 16, 160, 8

    from ajet import checkpoint
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import load_config
    from ajet.eval import Validator
    from ajet.rollout.dynamic_sampling import DynamicSampling
    from ajet.rollout.in_process import InProcessRollout
    from ajet.trainer import run

    tmp = tempfile.TemporaryDirectory(prefix="ajet-mem-")
    exp = Path(args.exp_dir) if args.exp_dir else Path(tmp.name) / "exp"
    val = held_out_subset(Path(tmp.name), args.val_tasks)
    cfg = load_config(CONF, {"trainer.total_steps": args.steps, "trainer.val_freq": args.steps,
                             "trainer.save_freq": args.save_freq, "trainer.seed": args.seed,
                             "trainer.exp_dir": str(exp), "trainer.progress": False,
                             "data.val_path": str(val), "data.test_path": None, "backbone": "debug",
                             **parse_overrides(args.set)})

    mem = PhaseMemory().start()
    wrap(DynamicSampling, "collect", mem, "rollout")
    wrap(InProcessRollout, "collect", mem, "rollout")
    wrap(Validator, "__call__", mem, "eval")
    wrap(DebugBackbone, "update", mem, "update")
    wrap(checkpoint, "save", mem, "checkpoint")
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    mem.stop()

    digest, n_tokens = token_digest(exp)
    gb = 1e9
    print(f"main job memory: {args.steps} steps, {args.val_tasks} held-out problems, seed {args.seed}, "
          f"overrides {args.set or 'none'}, "
          f"load {os.getloadavg()[0]:.1f}, env MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', '-')}")
    print(f"{'phase':<12}{'peak RSS GB':>12}{'RSS after GB':>14}{'seconds':>10}")
    for name in ("load", "eval", "rollout", "update", "checkpoint", "other"):
        if name in mem.peak:
            after = mem.at_end.get(name)
            print(f"{name:<12}{mem.peak[name] / gb:>12.2f}{(after / gb if after else float('nan')):>14.2f}"
                  f"{mem.seconds.get(name, 0.0):>10.1f}")
    print(f"process peak (ru_maxrss): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gb:.2f} GB; "
          f"wall {wall:.0f} s")
    print(f"sampled tokens: {n_tokens}, digest {digest}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
