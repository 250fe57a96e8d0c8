"""The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
sampling) through the vLLM engine: `ajet --conf ... --backbone=debug` with `engine: {kind: vllm}`, the server ajet
starts from the vLLM venv (skip/fail rules of tests/test_vllm_engine.py), two steps of two tasks and a held-out
evaluation of four problems before step 1 and after step 2.

It trains: each step's loss is finite and an optimizer step ran; the weights reach the server after each update
(the server's own log shows its two reloads, the step-2 calls record policy version 1, and vLLM's logprobs at step 2
agree with the trainer's recomputation under the updated weights); the held-out line is printed; the run ends
without an unclosed HTTP session.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import yaml

from ajet.trajectory_store import TrajectoryStore
# importing `venv_python` marks this module as one that waits for a venv build (scheduled first under xdist)
from tests.backbone_conformance.venvs import ROOT, venv_python  # noqa: F401
from tests.test_vllm_engine import START_LIMIT_S, vllm_python

TUTORIAL = ROOT / "tutorial" / "example_math_agent"
STEPS = 2
HELD_OUT = 4          # held-out problems evaluated (of the tutorial's 160)


def test_the_main_job_trains_two_steps_through_vllm(tmp_path):
    python = vllm_python()
    conf = yaml.safe_load((TUTORIAL / "math_agent.yaml").read_text())
    conf["workflow"] = f"{TUTORIAL}/{conf['workflow']}"
    conf["judge"] = f"{TUTORIAL}/{conf['judge']}"
    val = (TUTORIAL / conf["data"]["val_path"]).read_text().splitlines()[:HELD_OUT]
    (tmp_path / "val.jsonl").write_text("\n".join(val) + "\n")
    conf["data"] = {"train_path": str(TUTORIAL / conf["data"]["train_path"]), "val_path": str(tmp_path / "val.jsonl")}
    conf["trainer"].update(total_steps=STEPS, tasks_per_step=2, val_freq=STEPS, save_freq=0, tensorboard=False)
    conf["algorithm"]["dynamic_sampling"]["max_oversample"] = 2
    # the temperature these two steps were checked at: with the main job's 0.6 this draw's step 2 had 16 episodes
    # of reward 0 (no group with signal: dynamic sampling skips the update, as it should), and this test is about
    # the update and sync through vLLM, which needs one in each step
    conf["rollout"]["temperature"] = 0.8
    conf["rollout"]["num_repeat"] = 4                   # 2 groups of 4 a step (the main job: 2 of 8), for time
    conf["rollout"]["episode_timeout_s"] = 900          # a loaded machine must not fail an episode on time
    conf["engine"] = {"kind": "vllm", "python": python, "kv_cache_gb": 1, "start_timeout_s": START_LIMIT_S}
    (tmp_path / "math_agent.yaml").write_text(yaml.safe_dump(conf))
    exp = tmp_path / "exp"
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(tmp_path / "math_agent.yaml"),
                               "--backbone=debug", "--exp-dir", str(exp)], stdout=out, stderr=subprocess.STDOUT,
                              timeout=START_LIMIT_S + 1200, cwd=tmp_path)
    output = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "Unclosed" not in output, output[-4000:]

    metrics = {m["step"]: m for m in map(json.loads, (exp / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        m = metrics[step]
        assert math.isfinite(m["train/loss"]) and m["train/optimizer_steps"] >= 1, m
        assert m["policy_version"] == step and m["train/weight_sync_s"] > 0, m
    assert metrics[2]["train/logprob_diff"] < 1e-3, metrics[2]      # vLLM served the step-1 weights at step 2
    # the server's own log: one reload per update
    log = (exp / "engine" / "vllm.log").read_text()
    assert log.count('"POST /collective_rpc HTTP/1.1" 200') == STEPS, log[-3000:]
    # every call records the policy version that produced it, in the trajectory store
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        versions = {(e["step"] if "step" in e else step, c["policy_version"])
                    for step in (1, 2) for e in store.episodes(step=step) for c in e["calls"]}
    finally:
        store.close()
    assert versions == {(1, 0), (2, 1)}, versions
    # the held-out evaluation before step 1 and after step 2, the line that compares them
    assert metrics[0].get("val/valid", 1) == 1 and metrics[2].get("val/valid", 1) == 1 and "val/pass@1" in metrics[2]
    assert f"held-out at step {STEPS} (vs step 0):" in output, output[-3000:]
