"""The main job's held-out gain in several seeds at once, and SFT on a stronger run's traces, then GRPO, against
GRPO alone.

CONF (`--conf`) is the main job by default, tutorial/example_math_agent/math_agent.yaml: 16 GRPO steps, each 2
training problems x a GRPO group of 8 episodes at temperature 0.6 (dynamic sampling rolls out up to 2 more problems a
step in place of groups whose 8 rewards are equal), the 160 held-out problems evaluated greedily before step 1 and
after step 16.

(a) One `ajet --conf CONF --backbone=debug --seed S --exp-dir OUT/seed_S --quiet` per seed, all started together
    (on one GPU when there is one: the debug backbone puts the policy on cuda when torch sees it, `model.device:
    auto`). Per seed: held-out `val/pass@1` at step 0 and after the last step, and the gain in points.
(b) Once the run of `--sft-from-seed` K has finished (the stronger run: a trained policy's rollouts on the training
    tasks), rejection-sampling fine-tuning on its rewarded episodes (Yuan et al. 2023, arXiv:2308.01825):
    `ajet sft --from OUT/seed_K --min-reward R --conf CONF --backbone=debug --steps N --seed S0 --exp-dir OUT/sft`,
    then GRPO from its last checkpoint with CONF's settings, steps and seed S0 (`OUT/sft_grpo`, config
    `OUT/sft_grpo.yaml`: CONF with `model.path` set to the checkpoint and its file paths made absolute), against
    seed S0's run of (a) (GRPO alone). Held-out `val/pass@1` of each, and of the SFT model alone.

Configs: CONF as it is ("shipped"; left out with `--no-shipped`), and each `--candidate NAME KEY=VALUE ...` (CONF
with those fields set, values read as YAML: `--candidate clip_high algorithm.clip_ratio_high=0.28`), every one run
in every seed. `--set KEY=VALUE` (repeated) and `--engine vllm` (`engine.kind`) change all of them. A config other
than CONF as it is is written to `OUT/<config>.yaml` (file paths made absolute); a candidate's runs are
`OUT/<NAME>_seed_S`.

Every run is a plain `ajet` command (the table's figures are read from each run's `metrics.jsonl`); their output
goes to `OUT/<run>.log`. One table per config is printed: per seed, held-out `val/pass@1` before and after, the gain
in points, the held-out valid and grounded `calculate` calls per episode before and after (the tutorial's
`workflow/valid_tool_calls` and `workflow/grounded_tool_calls`: what its reward's two 0.1 terms pay for), its wall
time and the peak RSS and PSS of its process tree (measured every 5 s); under it the config's mean gain, its
minimum and the number of seeds with +10 points or more. All of it goes to `OUT/summary.json`. `--parallel N` runs
at most N at once (default: all). Runs still going at `--deadline-s` are stopped and reported as not finished.

    python benchmarks/main_job_seeds.py                                   # seeds 0-4, then SFT from seed 1's run
    python benchmarks/main_job_seeds.py --seeds 0,1,2 --no-sft --out experiments/seeds
    python benchmarks/main_job_seeds.py --seeds 3,4 --no-sft --engine vllm --parallel 1
    python benchmarks/main_job_seeds.py --seeds 0-9 --no-sft --candidate lr1e-5 algorithm.lr=1.0e-5
    python benchmarks/main_job_seeds.py --seeds 0-9 --no-sft --before-once --parallel 2    # one evaluation before

`--before-once` evaluates the initial policy once (`ajet eval --out OUT/before`: greedy, the same policy and tasks
for every seed) and runs each seed with `trainer.val_before_train: false`: one held-out evaluation fewer per run
(about 3 minutes alone on the 2-core CPU, 6 beside another run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.engines import TreeMemory  # noqa: E402

MEMORY_EVERY_S = 5.0   # how often each run's process tree is measured (its peak is the table's column)
BEFORE_KEYS = ("model", "workflow", "judge", "data", "eval")   # what the initial policy's held-out score depends on
MAIN_JOB = ROOT / "tutorial" / "example_math_agent" / "math_agent.yaml"


class Run:
    """One `python -m ajet ...` child: its name, command, log file, start and end (seconds since the benchmark
    started), exit status (None while it runs) and `memory`, the peak RSS and PSS of its process tree (bytes,
    read every MEMORY_EVERY_S seconds while it runs: `benchmarks.engines.TreeMemory`)."""

    def __init__(self, name: str, argv: list[str], out: Path, env: dict[str, str], t0: float):
        self.name, self.argv, self.exp_dir = name, argv, out / name
        self.log = open(out / f"{name}.log", "w")
        self.started = time.monotonic() - t0
        self.ended: float | None = None
        self.rc: int | None = None
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.memory = TreeMemory(self.proc.pid, t0, MEMORY_EVERY_S)

    def poll(self, t0: float) -> bool:
        """True once the child has exited (its status and end time are then set, its memory no longer read)."""
        if self.rc is None and self.proc.poll() is not None:
            self.rc, self.ended = self.proc.returncode, time.monotonic() - t0
            self.log.close()
            self.memory.stop()
        return self.rc is not None

    def stop(self) -> None:
        """SIGTERM to the child's process group, SIGKILL 10 s later if it is still there."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def held_out(exp_dir: Path, before: dict | None = None) -> dict:
    """A run's figures from its `metrics.jsonl`, of its test set (`test/*`, data.test_path: the main job's 160
    held-out problems) when it logged one, else of its validation set (`val/*`; the key names below say `val/`):
    `val/pass@1` (fraction of the held-out tasks answered right,
    greedy) at its first and last evaluation with their steps, the gain in points (100 x (after - before)), the
    held-out valid and grounded tool calls per episode at both (`val/workflow/valid_tool_calls`,
    `val/workflow/grounded_tool_calls`; None where not logged), the mean training reward over its steps
    (`reward/mean`), the last step logged, the sum of `time/step_s` (s) and, for an SFT run, `sft/kept_episodes`;
    {} when it logged no evaluation. The before is the run's evaluation at step 0 (before step 1) or, for a run
    that did not evaluate there, `before`: the initial policy's held-out figures evaluated once for every run
    (`--before-once`: its `val/*` keys, at step 0); without either the before figures are None and there is no
    gain. The after is the run's last evaluation after a step (None for a run stopped before it); a test set's
    after is measured on the run's final model, whose step (`test/step`) is the after step."""
    path = exp_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if any("test/pass@1" in r for r in rows):   # the reported set: renamed to the val/ keys read below
        rows = [{**{k: v for k, v in r.items() if not k.startswith("val/")},
                 **{f"val/{k[len('test/'):]}": v for k, v in r.items() if k.startswith("test/")}} for r in rows]
    vals = [r for r in rows if "val/pass@1" in r]
    if not vals and not before:
        return {}
    own_before = [r for r in vals if r.get("step", 0) == 0]
    first = own_before[0] if own_before else (before or {})
    afters = [r for r in vals if r.get("step", 0) > 0]
    last = afters[-1] if afters else {}
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    kept = [r["sft/kept_episodes"] for r in rows if "sft/kept_episodes" in r]
    return {"before": first.get("val/pass@1"), "after": last.get("val/pass@1"), "val_tasks": first.get("val/tasks"),
            "before_step": first.get("step"), "after_step": last.get("val/step", last.get("step")),
            # rounded to 1e-6 points: 56/160 - 40/160 is 0.0999... in floats, and +10 points must count as +10
            **({"gain_points": round(100 * (last["val/pass@1"] - first["val/pass@1"]), 6)} if last and first else {}),
            "valid_calls_before": first.get("val/workflow/valid_tool_calls"),
            "grounded_calls_before": first.get("val/workflow/grounded_tool_calls"),
            "valid_calls_after": last.get("val/workflow/valid_tool_calls"),
            "grounded_calls_after": last.get("val/workflow/grounded_tool_calls"),
            "last_step": max((r.get("step", 0) for r in rows), default=0),
            "train_reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "steps_time_s": sum(r.get("time/step_s", 0) for r in rows),
            **({"sft_kept_episodes": kept[-1]} if kept else {})}


def eval_before(out_dir: Path) -> dict | None:
    """`ajet eval --out OUT_DIR`'s figures as a run's step-0 `val/*` row (`held_out`'s `before`): {"step": 0,
    "val/pass@1": ..., "val/workflow/valid_tool_calls": ..., ...}; None when it wrote none or was invalid."""
    path = out_dir / "eval_metrics.json"
    metrics = json.loads(path.read_text()) if path.exists() else {}
    if not metrics.get("valid", 1.0) or "pass@1" not in metrics:
        return None
    return {"step": 0, **{f"val/{k}": v for k, v in metrics.items()}}


def absolute_paths(conf: Path, data: dict) -> dict:
    """CONF's `workflow`, `judge`, `data.train_path`, `val_path` and `test_path` as absolute paths where they name a
    file in CONF's folder (a derived config written elsewhere then finds the same files)."""
    def fix(value: str) -> str:
        file, sep, attr = value.rpartition(":") if ".py:" in value else (value, "", "")
        return str((conf.parent / file).resolve()) + sep + attr if (conf.parent / file).exists() else value

    for key in ("workflow", "judge"):
        if isinstance(data.get(key), str):
            data[key] = fix(data[key])
    for key in ("train_path", "val_path", "test_path"):
        if isinstance((data.get("data") or {}).get(key), str):
            data["data"][key] = fix(data["data"][key])
    return data


def parse_overrides(pairs: list[str]) -> dict:
    """`KEY=VALUE` strings as {dotted key: value}, each value read as YAML (`1.0e-5`, `true`, `[1, 2]`).
    Raises ValueError naming a pair without `=` or with an empty key."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{pair!r} is not KEY=VALUE (e.g. algorithm.lr=1.0e-5)")
        out[key.strip()] = yaml.safe_load(value)
    return out


def config_data(conf: Path, overrides: dict) -> dict:
    """CONF's YAML with its file paths made absolute (`absolute_paths`) and each dotted key of `overrides` set
    (`engine.kind` -> data["engine"]["kind"], sections created where missing). Raises ValueError when a key goes
    through a field that is not a section."""
    data = absolute_paths(conf, yaml.safe_load(conf.read_text()))
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {part} is not a section of the config")
        node[leaf] = value
    return data


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" or "0-9" or "0-4,7" -> the seeds in order, each once. Raises ValueError on anything else."""
    seeds: list[int] = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        lo, dash, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if dash else [int(part)]
    return list(dict.fromkeys(seeds))


def config_summary(runs: list[dict]) -> dict:
    """A config's seeds together: `runs` are `held_out` dicts (one per seed; those without `gain_points`, i.e. not
    finished, are left out). Returns {"seeds": runs given, "finished": with a gain, "mean_gain" and "min_gain"
    (points, None when none finished), "seeds_10": how many gained 10 points or more}."""
    gains = [r["gain_points"] for r in runs if r.get("gain_points") is not None]
    return {"seeds": len(runs), "finished": len(gains), "mean_gain": sum(gains) / len(gains) if gains else None,
            "min_gain": min(gains) if gains else None, "seeds_10": sum(g >= 10 for g in gains)}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _calls(r: dict, when: str) -> str:
    v, g = r.get(f"valid_calls_{when}"), r.get(f"grounded_calls_{when}")
    return "-" if v is None and g is None else f"{'-' if v is None else f'{v:.2f}'} / {'-' if g is None else f'{g:.2f}'}"


def config_table(name: str, runs: dict[str, dict]) -> list[str]:
    """One config's markdown table: a row per run (`runs`: run name -> `held_out` dict plus "rc", "wall_s" and,
    when measured, "peak_rss_gb" / "peak_pss_gb"), then its `config_summary` line."""
    lines = [f"config {name}:", "",
             "| run | exit | held-out val/pass@1 before -> after | gain (points) | valid / grounded calls per episode "
             "before -> after | steps | wall time | peak RSS / PSS |", "|---|---|---|---|---|---|---|---|"]
    for run, r in runs.items():
        gain = f"{r['gain_points']:+.1f}" if r.get("gain_points") is not None else "-"
        wall = f"{r['wall_s']:.0f} s" if r.get("wall_s") is not None else "not finished"
        memory = f"{r['peak_rss_gb']:.2f} / {r['peak_pss_gb']:.2f} GB" if r.get("peak_pss_gb") else "-"
        lines.append(f"| {run} | {r.get('rc')} | {_pct(r.get('before'))} -> {_pct(r.get('after'))} | {gain} | "
                     f"{_calls(r, 'before')} -> {_calls(r, 'after')} | {r.get('last_step', '-')} | {wall} | "
                     f"{memory} |")
    c = config_summary(list(runs.values()))
    if c["finished"]:
        lines.append(f"\n{name}: mean gain {c['mean_gain']:+.1f} points, minimum {c['min_gain']:+.1f}, "
                     f"{c['seeds_10']} of {c['finished']} seeds +10 points or more"
                     + (f" ({c['seeds'] - c['finished']} not finished)" if c["finished"] < c["seeds"] else ""))
    else:
        lines.append(f"\n{name}: no seed finished")
    return lines


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def call_form(expression: str, question: str) -> str:
    """A `calculate` expression's form: each number the question gives written as N, any other number kept, spaces
    dropped: "3 * 8" for "8 pens ..." -> "3*N"; "8 + 8" for "8 pens and 8 more" -> "N+N"."""
    given = set(_NUMBER.findall(question))
    return _NUMBER.sub(lambda m: "N" if m.group() in given else m.group(), expression).replace(" ", "")


def _first_expression(calls: list[dict]) -> str | None:
    """The expression of an episode's first `calculate` call (its calls' records in order), None without one."""
    for call in calls:
        for tc in (call.get("response_message") or {}).get("tool_calls") or []:
            if tc.get("function", {}).get("name") == "calculate":
                try:
                    return str(json.loads(tc["function"]["arguments"])["expression"])
                except (ValueError, KeyError, TypeError):
                    return None
    return None


def dynamics(exp_dir: Path, right_answer: float = 1.0) -> list[dict]:
    """Per training step of a finished run, from `metrics.jsonl` and `trajectories.sqlite`: the mean reward, the
    entropy of the sampling distribution at the trained tokens (`train/entropy`, nats), the share of the step's GRPO
    groups with no signal (`rollout/zero_std_groups` over the groups rolled out, extra tasks included), the extra
    tasks, the training episodes' valid and grounded calls per episode (`workflow/*`), the most common form of the
    episodes' first `calculate` call (`call_form`) with its share of the episodes, and the mean advantage of the
    trained episodes whose first call's form has a number the question does not give ("foreign") against those whose
    form uses two or more of the question's numbers and no other ("question's numbers"), and the share of the
    step's advantage mass (sum of |A| over trained episodes) that went to episodes without the right answer (reward
    below `right_answer`: the tutorial's 1 for the right number); None where there is nothing to average."""
    import sqlite3
    from collections import Counter, defaultdict

    rows = [json.loads(x) for x in (exp_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    n_repeat = 4
    if (exp_dir / "config.json").exists():
        n_repeat = json.loads((exp_dir / "config.json").read_text()).get("rollout", {}).get("num_repeat", 4)
    con = sqlite3.connect(f"file:{exp_dir / 'trajectories.sqlite'}?mode=ro", uri=True)
    calls: dict[str, list[dict]] = defaultdict(list)
    for eid, rec in con.execute("select episode_id, record from calls order by episode_id, idx"):
        calls[eid].append(json.loads(rec))
    adv = dict(con.execute("select episode_id, avg(advantage) from samples group by episode_id"))
    episodes: dict[int, list[tuple[str, str | None]]] = defaultdict(list)   # step -> (episode id, first call's form)
    rewards: dict[str, float] = {}
    for eid, step, reward, rec in con.execute("select episode_id, step, reward, record from episodes"):
        expression = _first_expression(calls.get(eid, []))
        query = json.loads(rec)["task"]["query"]
        episodes[step].append((eid, None if expression is None else call_form(expression, query)))
        rewards[eid] = reward if reward is not None else 0.0
    con.close()

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    out = []
    for r in (r for r in rows if "reward/mean" in r):
        step = r["step"]
        forms = Counter(f for _, f in episodes.get(step, []) if f is not None)
        top, top_n = forms.most_common(1)[0] if forms else (None, 0)
        foreign = [adv[e] for e, f in episodes.get(step, []) if f and e in adv and re.search(r"\d", f)]
        own = [adv[e] for e, f in episodes.get(step, []) if f and e in adv and not re.search(r"\d", f)
               and f.count("N") >= 2]
        groups = r.get("rollout/episodes", 0) / n_repeat
        trained = [e for e, _ in episodes.get(step, []) if e in adv]
        mass = sum(abs(adv[e]) for e in trained)
        wrong_mass = sum(abs(adv[e]) for e in trained if rewards[e] < right_answer)
        out.append({"step": step, "reward_mean": r["reward/mean"], "entropy": r.get("train/entropy"),
                    "no_signal_share": r.get("rollout/zero_std_groups", 0) / groups if groups else None,
                    "oversampled": r.get("rollout/oversampled_tasks"),
                    "valid_calls": r.get("workflow/valid_tool_calls"),
                    "grounded_calls": r.get("workflow/grounded_tool_calls"),
                    "top_form": top, "top_form_share": top_n / len(episodes[step]) if episodes.get(step) else None,
                    "adv_foreign": mean(foreign), "adv_own": mean(own), "n_foreign": len(foreign), "n_own": len(own),
                    "wrong_answer_adv_share": wrong_mass / mass if mass else None})
    return out


def dynamics_table(steps: list[dict]) -> list[str]:
    """`dynamics` as a markdown table, one row per step."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["| step | reward | entropy | groups without signal | extra tasks | valid / grounded calls | commonest "
             "first call (share) | advantage: foreign number (n) / question's numbers (n) | share of \\|advantage\\| "
             "on wrong answers |", "|---" * 9 + "|"]
    for d in steps:
        lines.append(f"| {d['step']} | {f(d['reward_mean'], '.3f')} | {f(d['entropy'], '.3f')} | "
                     f"{f(d['no_signal_share'], '.2f')} | {f(d['oversampled'], '.0f')} | {f(d['valid_calls'], '.2f')} / "
                     f"{f(d['grounded_calls'], '.2f')} | `{d['top_form']}` ({f(d['top_form_share'], '.2f')}) | "
                     f"{f(d['adv_foreign'], '+.3f')} ({d['n_foreign']}) / {f(d['adv_own'], '+.3f')} ({d['n_own']}) | "
                     f"{f(d['wrong_answer_adv_share'], '.2f')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conf", type=Path, default=MAIN_JOB, help="the job's config (default: the main job)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="seeds, one run each per config: 0,1,2 or 0-9")
    p.add_argument("--out", type=Path, default=Path("experiments/main_job_seeds"), help="runs' folders and logs")
    p.add_argument("--steps", type=int, help="override trainer.total_steps of every GRPO run")
    p.add_argument("--engine", choices=["in_process", "vllm"], help="engine.kind of every run (default: CONF's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field of every run "
                   "(YAML value), e.g. engine.kv_cache_gb=1; repeat for more")
    p.add_argument("--candidate", action="append", nargs="+", default=[], metavar="NAME KEY=VALUE",
                   help="a config to compare with CONF: a name, then its fields (e.g. --candidate lr1e-5 "
                        "algorithm.lr=1.0e-5); repeat for more; each runs in every seed")
    p.add_argument("--parallel", type=int, default=0, help="runs at once, at most (0: all)")
    p.add_argument("--no-sft", action="store_true", help="only (a)")
    p.add_argument("--no-shipped", action="store_true", help="run only the candidates (CONF as it is is not run: its "
                   "figures are known); needs --candidate and --no-sft")
    p.add_argument("--before-once", action="store_true", help="evaluate the initial policy once (`ajet eval`, "
                   "greedy: the same for every seed) instead of in every run (`trainer.val_before_train: false`); "
                   "not with candidates that change the model, workflow, judge, data or eval")
    p.add_argument("--sft-from-seed", type=int, default=1, help="the stronger run whose rewarded episodes SFT trains on")
    p.add_argument("--sft-seed", type=int, default=0, help="seed of the SFT and of the GRPO run after it (compared "
                   "with this seed's run of GRPO alone)")
    p.add_argument("--sft-steps", type=int, default=3, help="SFT updates (each one pass over the kept episodes)")
    p.add_argument("--min-reward", type=float, default=1.0, help="keep episodes with reward >= this (main job: "
                   "1 = the right answer)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each run (default: CPU cores / runs at once)")
    p.add_argument("--deadline-s", type=float, default=0, help="stop the runs still going after this many seconds "
                   "(0: none)")
    p.add_argument("--dynamics", type=Path, metavar="RUN_DIR", help="run nothing: print a finished run's per-step "
                   "dynamics (entropy, groups without signal, call forms, valid/grounded calls, advantages)")
    args = p.parse_args(argv)
    if args.dynamics:
        if not (args.dynamics / "metrics.jsonl").exists() or not (args.dynamics / "trajectories.sqlite").exists():
            p.error(f"--dynamics: {args.dynamics} has no metrics.jsonl and trajectories.sqlite (a run's --exp-dir)")
        print("\n".join(dynamics_table(dynamics(args.dynamics))))
        return 0

    try:
        seeds = parse_seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds: comma-separated seeds or ranges (0,1,2 or 0-9), got {args.seeds!r}")
    sft = not args.no_sft
    if sft and args.sft_from_seed not in seeds or sft and args.sft_seed not in seeds:
        p.error("--sft-from-seed and --sft-seed must be among --seeds (or pass --no-sft)")
    try:
        common = {**parse_overrides(args.set), **({"engine.kind": args.engine} if args.engine else {})}
        candidates = {c[0]: parse_overrides(c[1:]) for c in args.candidate}
    except ValueError as exc:
        p.error(f"--set/--candidate: {exc}")
    if ("shipped" in candidates or len(candidates) < len(args.candidate) or any("=" in n or "/" in n for n in candidates)
            or any(len(c) < 2 for c in args.candidate)):
        p.error("--candidate: each needs its own name (not 'shipped', no '=' or '/') and then one or more KEY=VALUE "
                "fields (e.g. --candidate lr1e-5 algorithm.lr=1.0e-5)")
    if args.no_shipped and (not candidates or sft):
        p.error("--no-shipped runs the candidates alone: give at least one --candidate, and --no-sft (SFT trains on "
                "the shipped config's run)")
    if args.before_once and (sft or any(k.split(".")[0] in BEFORE_KEYS for f in [common, *candidates.values()]
                                         for k in f)):
        p.error(f"--before-once: the initial policy is evaluated once, so every run must share it: pass --no-sft "
                f"and no --set/--candidate field under {', '.join(BEFORE_KEYS)}")
    if args.before_once:
        common["trainer.val_before_train"] = False
    conf = args.conf.resolve()
    if not conf.is_file():
        p.error(f"--conf: {args.conf} is not a file (the job's YAML)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs: dict[str, Path] = {}                      # config name -> its YAML
    for name, fields in (({} if args.no_shipped else {"shipped": {}}) | candidates).items():
        overrides = {**common, **fields}
        if not overrides:
            configs[name] = conf
            continue
        try:
            data = config_data(conf, overrides)
        except ValueError as exc:
            p.error(f"--set/--candidate {name}: {exc}")
        configs[name] = out / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(data, sort_keys=False))

    def run_name(config: str, seed: int) -> str:
        return f"seed_{seed}" if config == "shipped" else f"{config}_seed_{seed}"

    total = len(configs) * len(seeds) + 2 * int(sft) + int(args.before_once)
    parallel = args.parallel or total
    threads = args.threads or max(1, (os.cpu_count() or 1) // min(parallel, total))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    steps = ["--steps", str(args.steps)] if args.steps else []
    ajet = [sys.executable, "-m", "ajet"]
    t0 = time.monotonic()

    def grpo(name: str, conf_path: Path, seed: int) -> list[str]:
        return ajet + ["--conf", str(conf_path), "--backbone=debug", "--seed", str(seed), "--exp-dir",
                       str(out / name), "--quiet"] + steps

    # runs not started yet, in order (seed by seed, every config in each); SFT runs go to the front when due
    pending: list[tuple[str, list[str]]] = [(run_name(c, s), grpo(run_name(c, s), path, s))
                                            for s in seeds for c, path in configs.items()]
    if args.before_once:
        split = ["--split", "test"] if config_data(conf, {}).get("data", {}).get("test_path") else []
        pending.insert(0, ("before", ajet + ["eval", "--conf", str(conf), *split, "--out", str(out / "before"),
                                             "--quiet"]))
    runs: dict[str, Run] = {}
    print(f"[{time.monotonic() - t0:6.0f} s] {len(pending)} runs, {parallel} at once (OMP_NUM_THREADS={threads}) "
          f"-> {out}", flush=True)
    stopped: list[str] = []
    try:
        while True:
            while pending and sum(r.rc is None for r in runs.values()) < parallel:
                name, argv_ = pending.pop(0)
                runs[name] = Run(name, argv_, out, env, t0)
                print(f"[{runs[name].started:6.0f} s] started {name}", flush=True)
            for name, run in list(runs.items()):
                if run.rc is None and run.poll(t0):
                    print(f"[{run.ended:6.0f} s] {name} exited {run.rc}", flush=True)
                    if not sft or run.rc != 0:
                        continue
                    if name == f"seed_{args.sft_from_seed}":
                        pending.insert(0, ("sft", ajet + [
                            "sft", "--from", str(run.exp_dir), "--min-reward", str(args.min_reward), "--conf",
                            str(configs["shipped"]), "--backbone=debug", "--steps", str(args.sft_steps), "--seed",
                            str(args.sft_seed), "--exp-dir", str(out / "sft"), "--quiet"]))
                    elif name == "sft":
                        data = config_data(conf, common)
                        data["experiment_name"] = "sft_grpo"
                        data.setdefault("model", {})["path"] = str(out / "sft" / "checkpoints" /
                                                                   f"step_{args.sft_steps}")
                        derived = out / "sft_grpo.yaml"
                        derived.write_text(yaml.safe_dump(data, sort_keys=False))
                        pending.insert(0, ("sft_grpo", grpo("sft_grpo", derived, args.sft_seed)))
            if not pending and all(r.rc is not None for r in runs.values()):
                break
            if args.deadline_s and time.monotonic() - t0 > args.deadline_s:
                stopped = [n for n, r in runs.items() if r.rc is None] + [n for n, _ in pending]
                print(f"[{time.monotonic() - t0:6.0f} s] deadline: stopping {stopped}", flush=True)
                for n in stopped:
                    if n in runs:
                        runs[n].stop()
                        runs[n].poll(t0)
                break
            time.sleep(1)
    finally:
        for r in runs.values():
            r.stop()

    summary = {"conf": str(conf), "seeds": seeds, "steps": args.steps, "overrides": common,
               "candidates": candidates, "wall_s": time.monotonic() - t0, "stopped_at_deadline": stopped,
               "runs": {}, "configs": {}}
    before = eval_before(out / "before") if args.before_once else None
    summary["before_once"] = before
    for name, r in runs.items():
        summary["runs"][name] = {"rc": r.rc, "started_s": round(r.started, 1),
                                 "wall_s": round(r.ended - r.started, 1) if r.ended is not None else None,
                                 "peak_rss_gb": round(r.memory.peak_rss / 2**30, 2),
                                 "peak_pss_gb": round(r.memory.peak_pss / 2**30, 2),
                                 **({} if name == "before" else held_out(r.exp_dir, before))}
    for config in configs:
        rows = {n: summary["runs"].get(n, {"rc": None, "wall_s": None}) for n in (run_name(config, s) for s in seeds)}
        summary["configs"][config] = config_summary(list(rows.values()))
        print("\n" + "\n".join(config_table(config, rows)))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    if sft and "sft_grpo" in summary["runs"] and f"seed_{args.sft_seed}" in summary["runs"]:
        a, b = summary["runs"][f"seed_{args.sft_seed}"], summary["runs"]["sft_grpo"]
        print(f"\nSFT (from seed_{args.sft_from_seed}, reward >= {args.min_reward:g}, {args.sft_steps} steps) then GRPO: "
              f"{_pct(b.get('after'))}; GRPO alone (seed {args.sft_seed}): {_pct(a.get('after'))}; both from "
              f"{_pct(a.get('before'))} before any training")
    print(f"\ntotal wall time {summary['wall_s']:.0f} s; {out / 'summary.json'}")
    return 0 if all(r.rc == 0 for r in runs.values()) and not stopped else 1


if __name__ == "__main__":
    sys.exit(main())
