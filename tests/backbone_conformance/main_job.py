"""The main job through a scale-out backbone (tests/test_backbone_main_job.py for verl,
tests/test_backbone_main_job_trinity.py for Trinity): its config for 2 steps, the one debug-backbone run both are
checked against (run once per test session, shared by the pytest-xdist workers), and the checks that compare a
backbone's run of it with the debug run.

What is checked, for each backbone (`check_against_debug`):
- every task once: each (step, task, repeat) episode of the debug run is there exactly once, trained by exactly one
  update or left out on purpose (dynamic sampling), and nothing else is (trajectory store's ledger);
- the same rollouts: every episode's sampled token ids, call by call, and its reward equal the debug run's, and so
  do the per-step mean rewards, with one optimizer step a step. Step 2 samples from the weights after the
  backbone's own update 1 (verl's FSDP2 actor or Trinity's trainer), so equal tokens there say that update agrees
  with the debug backbone's to far below what would flip one sampled token.

Each backbone's kill -9 and `--resume` (the restored actor serves step 2, the killed attempt's step-2 work is
abandoned, every episode trained once over the attempts) is tests/test_backbone_vllm.py's, where the restored
weights are checked by their logprobs: one start-up of each backbone fewer in CI.

The config differs from the shipped one only where a 2-step check in CI's time needs it: no held-out evaluation
(`val_freq: 0`), one checkpoint, at the end, the paths absolute, one task a step (`TASKS_PER_STEP`, dynamic
sampling: one extra at most), and `rollout.max_batch_size: 1`: each call
decoded alone, so its tokens do not depend on which calls shared its batch, which timing decides
(tests/test_batching_numerics.py); batched, a near tie fell the other way in 1 of 4 runs compared.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from filelock import FileLock

from ajet.trajectory_store import TrajectoryStore
from tests.backbone_conformance.venvs import ROOT, venv_python

TUTORIAL = ROOT / "tutorial" / "example_math_agent"
STEPS = 2
TASKS_PER_STEP = 1    # 4-8 episodes a step (a quarter of the main job's 16-32), to fit CI's time (docs/backbones.md)
NUM_REPEAT = 4        # groups of 4 (the main job: 8)
RUN_S = 1800          # a bound on one CLI run, not a speed target (the machine may be loaded)


def main_job_conf(folder: Path) -> Path:
    """The main job's YAML with absolute paths, no held-out evaluation, a checkpoint at the end, `TASKS_PER_STEP`
    tasks a step (dynamic sampling: as many extra) in groups of `NUM_REPEAT`, each call decoded alone, at temperature
    0.8, written to `folder`."""
    conf = yaml.safe_load((TUTORIAL / "math_agent.yaml").read_text())
    conf["workflow"] = f"{TUTORIAL}/{conf['workflow']}"
    conf["judge"] = f"{TUTORIAL}/{conf['judge']}"
    conf["data"] = {"train_path": str(TUTORIAL / conf["data"]["train_path"])}
    conf["trainer"].update(val_freq=0, save_freq=STEPS, tensorboard=False, tasks_per_step=TASKS_PER_STEP)
    conf["algorithm"]["dynamic_sampling"]["max_oversample"] = TASKS_PER_STEP
    conf["rollout"]["episode_timeout_s"] = RUN_S     # a loaded machine must not time out an episode in one run only
    conf["rollout"]["max_batch_size"] = 1            # tokens independent of timing (module docstring)
    conf["rollout"]["temperature"] = 0.8             # the draws these backbones were compared on (the main job: 0.6)
    conf["rollout"]["num_repeat"] = NUM_REPEAT
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "math_agent.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def _cmd(python: str, conf: Path, backbone: str, exp: Path, *extra: str) -> list[str]:
    return [python, "-m", "ajet", "--conf", str(conf), "--backbone", backbone, "--exp-dir", str(exp),
            "--steps", str(STEPS), "-q", *extra]


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S, cwd=cwd, env=env)
    print(f"{' '.join(cmd[3:])}: {time.monotonic() - t0:.0f} s")                   # shown by pytest -rP
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def rollouts(exp: Path) -> dict[tuple[int, str, int], dict]:
    """(step, task id, repeat) -> that live episode's reward and sampled token ids per call (trajectories.jsonl:
    a resumed run keeps the steps before its checkpoint and appends the later ones)."""
    out = {}
    for line in (exp / "trajectories.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (r["step"], r["task"]["task_id"], r["repeat_index"])
        assert key not in out, f"{key} twice in {exp}"
        out[key] = {"reward": r["reward"], "error": r["error"],
                    "tokens": [c["completion_ids"] for c in r["calls"]]}
    return out


def step_rewards(exp: Path) -> list[float]:
    """The mean reward of each step of `exp`'s metrics.jsonl; asserts steps 1..STEPS, one optimizer step each."""
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1)) and rows[-1]["policy_version"] == STEPS
    assert [m["train/optimizer_steps"] for m in rows] == [1.0] * STEPS
    return [m["reward/mean"] for m in rows]


def live_episodes(exp: Path) -> Counter:
    """(step, task id, repeat) of every episode trained by a live update or left out on purpose, counted; asserts
    that each ok episode is trained at most once and that what no live update used is abandoned (a killed
    attempt's work that its checkpoint did not hold)."""
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        records = {r["episode_id"]: r for r in store.episodes()}      # ids are unique across attempts
        ledger = store.ledger()
    finally:
        store.close()
    live = Counter()
    for e in ledger:
        assert len(e["trained_in"]) <= 1, e
        if e["trained_in"] or e["not_trained"]:
            r = records[e["episode_id"]]
            live[(e["step"], r["task"]["task_id"], r["repeat_index"])] += 1
        else:
            assert e["abandoned"] or not e["ok"], e
    return live


@pytest.fixture(scope="module")
def debug_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted debug-backbone run of the main job's 2-step config (core environment): (conf, exp dir).

    Run once per test session: under pytest-xdist the workers share their session's base folder, and the first
    to arrive runs it under a file lock while the other waits (the run is deterministic, so either could).
    Raises AssertionError when the run fails (its output in the message)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if hasattr(request.config, "workerinput") else base) / "main_job_debug_reference"
    shared.mkdir(exist_ok=True)
    conf, exp, done = shared / "math_agent.yaml", shared / "debug", shared / "done"
    with FileLock(str(shared / "lock")):
        if not done.exists():
            shutil.rmtree(exp, ignore_errors=True)      # a failed earlier try (the other worker's)
            main_job_conf(shared)
            _run(_cmd(sys.executable, conf, "debug", exp), shared)
            shutil.rmtree(exp / "checkpoints")          # 3 GB no check reads (disk: docs/backbones.md)
            done.touch()
    return conf, exp


def run_and_check(backbone: str, debug_run: tuple[Path, Path], tmp_path: Path, *extra: str,
                  env: dict[str, str] | None = None) -> tuple[str, Path]:
    """The main job through `backbone` (verl | trinity) in its venv, uninterrupted, with the command-line arguments
    `extra` and the environment `env` (None: this process's), checked against `debug_run` (`check_against_debug`).
    Returns (the venv's python, the run's exp dir)."""
    python = venv_python(backbone)
    conf, debug = debug_run
    exp = tmp_path / backbone
    _run(_cmd(python, conf, backbone, exp, *extra), conf.parent, env)
    check_against_debug(exp, debug)
    return python, exp


def check_against_debug(exp: Path, debug: Path) -> None:
    """Every task once, and the same rollouts as the debug run (see the module docstring)."""
    ours, ref = rollouts(exp), rollouts(debug)
    assert sorted(ours) == sorted(ref)                        # the same episodes, each once
    assert live_episodes(exp) == live_episodes_of(debug)
    assert all(r["error"] is None for r in ref.values())
    # (each call decoded alone: its tokens do not depend on timing, see the module docstring)
    differ = [k for k in ref if ours[k]["tokens"] != ref[k]["tokens"]]
    assert not differ, f"{len(differ)} of {len(ref)} episodes sampled other tokens, e.g. {differ[:3]}"
    assert {k: v["reward"] for k, v in ours.items()} == {k: v["reward"] for k, v in ref.items()}
    assert step_rewards(exp) == pytest.approx(step_rewards(debug), abs=1e-9)
    assert len({k[0] for k in ref}) == STEPS and len(ref) >= 4 * TASKS_PER_STEP * STEPS    # 4 repeats a task


def live_episodes_of(debug: Path) -> Counter:
    """`live_episodes` of the uninterrupted run (one attempt), each exactly once."""
    out = live_episodes(debug)
    assert set(out.values()) == {1}
    return out


def assert_verl_checkpoint_merges_to_served_weights(py: str, ckpt, hf) -> tuple[dict, dict]:
    """verl's actor checkpoint `ckpt/actor` -> a Hugging Face folder `hf` (verl's model_merger, run with the verl
    venv's python `py`) that transformers loads, holding the weights ajet's engine served at that step (saved
    beside it in `ckpt` as a HF folder), rounded to the merger's default bf16. Returns (merged, served) state
    dicts. Raises AssertionError when the merger fails or any tensor differs."""
    from transformers import AutoModelForCausalLM

    merge = subprocess.run([py, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
                            str(ckpt / "actor"), "--target_dir", str(hf)], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
    assert merge.returncode == 0, merge.stdout[-3000:] + merge.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(hf).state_dict()
    served = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert set(merged) == set(served)
    for k in served:        # the merger writes verl's default bf16: the served fp32 weights, rounded to it
        assert merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], served[k].to(torch.bfloat16)), k
    return merged, served
