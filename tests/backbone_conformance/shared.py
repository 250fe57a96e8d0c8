"""What the backbone conformance test files share (tests/test_backbone_conformance.py for verl,
tests/test_backbone_conformance_trinity.py for Trinity): the recorded batch (a module fixture; each file records
its own copy, the recording is deterministic), ajet's side of the loss comparison, the bounds of the update
comparisons, and the helpers that run a check script or a config check in a backbone's venv.
"""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from ajet.algorithm.loss import LOSS_AGG_MODES, agg_loss, loss_token_weights, ppo_clip_loss
from ajet.backbones.verl.data import verl_batch_tensors
from ajet.tracker.sample import Sample

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parent
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "loss_scale_factor": 64.0}

# Bounds of the update comparisons (verl's and Trinity's update against the debug backbone's, on the one recorded
# batch, from the same weights), each from where its difference comes from:
# - Gradients: two float32 implementations of one loss (other kernels and summation orders, FSDP's flat
#   parameters) differ by ~1e-7 relative L2; measured 3.9e-7 to 4.3e-7 (verl), 3.3e-7 to 5.0e-7 (Trinity).
GRAD_REL = 1e-5
# - Weights after update 1: AdamW's first update is a fixed function of the (clipped) gradient, -lr g / (|g| + eps)
#   per coordinate (adam.py), so the weights part by many times the gradients' relative L2: Adam moves every
#   coordinate by ~lr whatever its gradient's size, so the near-zero gradients (|g| ~ eps = 1e-8, where float32's
#   differences are a large part of g) count in the weights as much as the large ones that dominate the gradients'
#   L2 (measured: 26x to 94x, gradients 3.3e-7 to 5.0e-7 -> weights 1.0e-5 to 3.9e-5).
#   verl (tests/test_backbone_conformance.py) and Trinity (tests/test_backbone_conformance_trinity.py): each side's
#   weights after update 1 must be what torch's float32 AdamW makes of that side's own gradient from the initial
#   weights (adam.py's `adamw_first_step`), to within STEP1_UNITS float32 rounding units at every coordinate
#   (adam.py's `rounding_units`). Measured: 0 (bit for bit) for both sides in every run: verl with torch's AVX-512
#   and its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), Trinity (the engine's weights, synced back) in every mode, in
#   micro-batches and on 2 ranks; the same step computed another way in float32 (other betas, a gradient 1e-7
#   off): up to 4.4. Fails (the worker mutated): its update 1 not applied (verl: 1.6e7 units), its gradient scaled
#   by 1.001 after it was recorded (verl 868, Trinity 82-444; the earlier bound, 30% of the float64 formula's
#   distance, passed both), lr 1e-4 off (verl: 1640); offline: lr 1e-5 off (160), eps 1e-7 (1e6). The weights'
#   distance then IS the one the two float32 steps make (`adam_rel`), whereas the float64 formula (`adam_rel_f64`,
#   both tests print it) leaves out the rounding of w0 + update to float32, coarse at the RMSNorm gains (1.0,
#   spacing 1.2e-7 above, 0.4% of lr): where a gain's two updates, 1e-8 apart, round to neighbouring floats, that
#   one coordinate adds ~1.1e-5 of the update's norm, in quadrature. That was verl's seq-mean-token-sum-norm "13%"
#   (2.42e-5 measured against 2.14e-5 from the formula: sqrt(2.14^2 + 1.14^2) = 2.42); reproduced with AVX2
#   kernels (2.13e-5 against 1.81e-5, gain 54 of layer 0's input norm, |g| = 1.7e-8), where the float32 steps give
#   2.13e-5 exactly. It shows in that mode because its gradient is the smallest (the token sum / (64 x episodes):
#   norm 0.37, the other modes 0.83-1 after clipping), so the most coordinates sit near eps, where the two sides'
#   updates differ most.
STEP1_UNITS = 10
# - Weights after update k: each update parts from the other side's by about what the first did (the weights
#   differ by ~1e-5 of one update, far too little to move the gradients beyond their float32 differences) and the
#   k updates together move the weights at least as far as the first did, so by the triangle inequality the
#   distance is at most k adam_rel (measured 0.35-0.75 adam_rel after 3: the later updates mostly agree). A fixed
#   bound instead (1e-4) held or failed with the recording: 1.022e-4 on a batch whose amplification was 250x.
UPDATES = 3


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    from tests.backbone_conformance.record import record

    d = record(tiny_model_dir)
    samples = [Sample(**s) for s in d["samples"]]
    # a second policy: the model's logprobs moved token by token (some ratios clip, some dual-clip)
    moved = [[lp + 0.6 * math.sin(7 * i + j) for j, lp in enumerate(lps)] for i, lps in enumerate(d["logprobs"])]
    d["logprob_sets"] = {"model": d.pop("logprobs"), "moved": moved}
    return d, samples


def _padded(rows, B, R):
    out = torch.zeros((B, R), dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
    return out


def ajet_losses(d, samples, loss_scale_factor=CLIP["loss_scale_factor"]):
    """ajet's loss on the verl-layout tensors, per logprob set and mode (rows as verl's sequences), in float64
    (as the check scripts compute the other side); loss_scale_factor None: the padded response width."""
    t = verl_batch_tensors(samples, d["pad_id"])
    B, R = t["responses"].shape
    mask, old, adv = t["response_mask"].double(), t["old_log_probs"].double(), t["advantages"].double()
    counts = [s.num_loss_tokens for s in samples]
    out = {}
    for name, lps in d["logprob_sets"].items():
        lp = _padded(lps, B, R)
        for mode in LOSS_AGG_MODES:
            w = torch.tensor(loss_token_weights(list(range(B)), counts, mode, loss_scale_factor, R),
                             dtype=torch.float64)
            loss, _ = ppo_clip_loss(lp, old, adv, w[:, None] * mask,
                                    CLIP["clip_ratio_low"], CLIP["clip_ratio_high"], clip_ratio_c=CLIP["clip_ratio_c"])
            out[f"{name}/{mode}"] = float(loss)
    loss_mat = torch.sin(torch.arange(B * R, dtype=torch.float64).reshape(B, R)) + 0.5
    agg = {m: float(agg_loss(loss_mat, mask, m, CLIP["loss_scale_factor"])) for m in LOSS_AGG_MODES}
    return t, out, agg


def run_check(py, script, payload, tmp_path, timeout=400, env=None):
    """Run the check script `script` (this folder) with the backbone venv's python `py` on `payload` (JSON, written
    to tmp_path/in.json) in the environment `env` (None: this process's) and return what it wrote to
    tmp_path/out.json. Raises AssertionError (its output's tail) when it exits non-zero; subprocess.TimeoutExpired
    after `timeout` seconds."""
    inp, out = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(json.dumps(payload))
    proc = subprocess.run([py, str(CHECKS / script), str(inp), str(out)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def main_job_lr() -> float:
    """The main job's learning rate (tutorial/example_math_agent/math_agent.yaml's algorithm.lr)."""
    return float(yaml.safe_load((ROOT / "tutorial/example_math_agent/math_agent.yaml").read_text())["algorithm"]["lr"])


# Runs each script of a JSON list [{"script", "argv", "stdin"}] as `python -c script argv...` would (a fresh
# namespace named __main__, that sys.argv and stdin, sys.exit(0) ending it) and prints a JSON list of what each
# printed or, for a script that raised, its error.
_BATCH = """
import contextlib, io, json, sys, traceback
out = []
for case in json.load(open(sys.argv[1])):
    sys.argv, sys.stdin, buf = ["-c", *case["argv"]], io.StringIO(case.get("stdin", "")), io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            try:
                exec(compile(case["script"], "<check>", "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
        out.append({"stdout": buf.getvalue()})
    except BaseException:
        out.append({"stdout": buf.getvalue(), "error": traceback.format_exc()})
print(json.dumps(out))
"""


def run_scripts(py: str, cases: list[dict], tmp_path: Path, timeout: float = 600) -> list[dict]:
    """Run the check scripts `cases` ([{"script", "argv", "stdin"}], each as `py -c script argv...` would, with that
    stdin) in ONE process of the venv's `py`: the venv's imports (verl, Trinity: 3-10 s of CPU each) are paid once,
    not once a script. Each script runs in a fresh namespace, so only what its imports cache is shared. Returns, in
    order, {"stdout"} for each script, plus "error" (its traceback) for one that raised. Raises AssertionError when
    the process itself fails."""
    inp = tmp_path / "scripts.json"
    inp.write_text(json.dumps(cases))
    proc = subprocess.run([py, "-c", _BATCH, str(inp)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def printed(result: dict) -> str:
    """The last line a script of `run_scripts` printed. Raises AssertionError (its traceback) if it raised."""
    assert "error" not in result, result["error"][-3000:]
    return result["stdout"].strip().splitlines()[-1]


def config_case(folder: Path, name: str, script: str, extra: str, *args: str) -> dict:
    """A `run_scripts` case: `script` on a config of the minimal keys + `extra` (written to folder/name.yaml), then
    `args`."""
    conf = folder / f"{name}.yaml"
    conf.write_text("workflow: wf.py:W\ndata: {train_path: tasks.jsonl}\n" + extra)
    return {"script": script, "argv": [str(conf), *args]}
