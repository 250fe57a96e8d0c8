"""`ajet --backbone verl` trains on CPU from the verl venv (verl's RayWorkerGroup, FSDP2 on gloo, verl's checkpoint
manager; ajet's engine generates): kill -9 mid-run and --resume give the data order, step count and policy
version of an uninterrupted run, and the actor checkpoint verl wrote converts (verl's model_merger) to a
Hugging Face folder that transformers loads, holding the weights ajet's engine served.
"""

import json
import os
import signal
import subprocess
import time

import torch

from ajet.trajectory_store import TrajectoryStore
from tests.backbone_conformance.venvs import ROOT, venv_python
from tests.test_resume_and_isolation import _setup, _task_order


def _ajet(py, conf, exp, *extra, env=None, popen=False):
    cmd = [py, "-m", "ajet", "--conf", str(conf), "--backbone", "verl", "--exp-dir", str(exp), *extra]
    env = {**os.environ, **(env or {})}
    if popen:           # its own process group: kill -9 takes the Ray workers it started with it
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=conf.parent,
                                start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=conf.parent)


def test_verl_on_cpu_kill_9_then_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    py = venv_python("verl")
    conf = _setup(tmp_path, tiny_model_dir, steps=3, episode_timeout_s=60)
    straight = tmp_path / "straight"
    done = _ajet(py, conf, straight)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[-1]["policy_version"] == 3
    assert [m["train/optimizer_steps"] for m in metrics] == [1.0, 1.0, 1.0]

    killed = tmp_path / "killed"
    proc = _ajet(py, conf, killed, env={"WF_SLEEP": "2.0"}, popen=True)
    deadline = time.monotonic() + 400
    while not (killed / "checkpoints" / "step_1" / "trainer_state.pt").exists():   # step 2 is running now
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-5000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    store = TrajectoryStore(killed / "trajectories.sqlite")
    assert len(store.episodes(step=1)) == 4
    store.close()

    resumed = _ajet(py, conf, killed, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout and "next step 2" in resumed.stdout
    assert _task_order(killed) == _task_order(straight)
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((killed / "metrics.jsonl").read_text().splitlines()[-1])["policy_version"] == 3

    _, served = assert_verl_checkpoint_merges_to_served_weights(py, straight / "checkpoints" / "step_3",
                                                                tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(served[k], initial[k]) for k in served)      # 3 updates moved the weights


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
