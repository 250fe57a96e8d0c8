"""Conformance with the real verl and Trinity packages, each in its own venv (.ci/make_backbone_env.sh).

Episodes are recorded here (real proxy, tiny model, tool results between calls, a forked call), saved as
JSON and loaded inside the backbone's venv by a script that uses only that project's own functions. The
test compares, in this environment: the tensors ajet's conversion produces here with those verl's
`DataProto` holds there, and ajet's loss (`ppo_clip_loss` with `loss_token_weights`, and `agg_loss`) with
verl's `compute_policy_loss_vanilla` / `agg_loss` (Trinity's policy loss) for every `loss_agg_mode`.
Each venv test skips, naming the build command, when that venv is absent; in CI it fails instead
(tests/backbone_conformance/venvs.py).
"""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from ajet.backbones.verl.data import verl_batch_tensors
from ajet.algorithm.loss import LOSS_AGG_MODES, agg_loss, loss_token_weights, ppo_clip_loss
from ajet.tracker.sample import Sample
from tests.backbone_conformance.adam import first_update_rel
from tests.backbone_conformance.venvs import venv_python

ROOT = Path(__file__).resolve().parent.parent
CHECKS = Path(__file__).resolve().parent / "backbone_conformance"
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "loss_scale_factor": 64.0}

# Bounds of the update comparisons (verl's and Trinity's update against the debug backbone's, on the one recorded
# batch, from the same weights), each from where its difference comes from:
# - Gradients: two float32 implementations of one loss (other kernels and summation orders, FSDP's flat
#   parameters) differ by ~1e-7 relative L2; measured 3.9e-7 to 4.3e-7 (verl), 3.3e-7 to 5.0e-7 (Trinity).
GRAD_REL = 1e-5
# - Weights after update 1: AdamW's first update is a fixed function of the (clipped) gradient, -lr g / (|g| + eps)
#   per coordinate (adam.py), so the weights may part only by what it makes of the two measured gradients,
#   `adam_rel`. That is many times the gradients' relative L2: Adam moves every coordinate by ~lr whatever its
#   gradient's size, so the near-zero gradients (|g| ~ eps = 1e-8, where float32's differences are a large part
#   of g) count in the weights as much as the large ones that dominate the gradients' L2 (measured: 26x to 94x,
#   gradients 3.3e-7 to 5.0e-7 -> weights 1.0e-5 to 3.9e-5; clipping scales g towards eps). The weights' measured
#   distance is adam_rel to within 0.8% (verl) and 1.5% (Trinity) for every mode but verl's
#   seq-mean-token-sum-norm, which gives 13% with transformers 5.24 (2.42e-5 against 2.14e-5, the same in two
#   runs, its gradients 3.7e-7 apart; cause not found); allowed: 30% of it plus 1e-6 for float32
#   rounding of w + update (an ulp of a weight, ~1e-8, against the update's norm, ~350 lr = 1e-2). What the bound
#   is for still fails: an update not applied, or applied with another lr, betas or eps, parts the weights by ~1,
#   four orders of magnitude above it.
STEP1_REL, STEP1_ABS = 0.30, 1e-6
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


def test_the_recording_is_the_same_in_every_process(recorded, tiny_model_dir, tmp_path):
    """Every backbone comparison trains this batch, so it must not change from one recording to the next (it did:
    with calls drawing from the engine's generator in arrival order, batched as timing made them, 4 of 12 samples
    had other tokens, and the measured weight differences moved with the batch, not with the backbones)."""
    import sys

    d, _ = recorded
    out = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, "-m", "tests.backbone_conformance.record", tiny_model_dir, str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(out.read_text())
    assert again["samples"] == json.loads(json.dumps(d["samples"]))
    assert again["logprobs"] == d["logprob_sets"]["model"]


def test_recorded_episodes_are_multi_turn_with_tool_tokens_and_forks(recorded):
    _, samples = recorded
    assert any("fork_reason" in s.flags for s in samples)                              # forked branches
    merged = [s for s in samples if "fork_reason" not in s.flags]
    # tool result between the calls: a run of 0s inside the loss mask, 1s on both sides
    assert all(0 in s.loss_mask[s.loss_mask.index(1):] and s.loss_mask[-1] == 1 for s in merged)
    assert len({s.advantage for s in samples}) > 1


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


def _run(py, script, payload, tmp_path, timeout=400):
    inp, out = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(json.dumps(payload))
    proc = subprocess.run([py, str(CHECKS / script), str(inp), str(out)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_verl_dataproto_and_losses_equal_ajets(recorded, tmp_path):
    py = venv_python("verl")
    d, samples = recorded
    res = _run(py, "verl_check.py", {**d, **CLIP, "modes": list(LOSS_AGG_MODES)}, tmp_path)
    t, ajet_loss, ajet_agg = ajet_losses(d, samples)
    assert res["verl_version"].startswith("0.9")
    # identical tensors through verl's DataProto (TensorDict), and verl's own position-id helper agrees
    assert res["len"] == len(samples) and set(res["tensors"]) == set(t)
    for k, v in t.items():
        assert res["tensors"][k] == v.tolist(), k
    assert res["verl_position_ids"] == t["position_ids"].tolist()
    assert res["uid"] == [s.group_id for s in samples] and res["temperature"] == 1.0
    for i, s in enumerate(samples):     # response_mask is ajet's loss mask, zeros on the tool tokens
        assert res["tensors"]["response_mask"][i][:len(s.loss_mask)] == s.loss_mask
    # the same loss under verl's policy loss + agg_loss, every mode, both policies
    assert set(res["loss"]) == set(ajet_loss)
    for key, value in ajet_loss.items():
        assert abs(res["loss"][key] - value) < 1e-6, (key, res["loss"][key], value)
    for mode, value in ajet_agg.items():
        assert abs(res["agg"][mode] - value) < 1e-6, (mode, res["agg"][mode], value)
    assert len({round(v, 6) for v in ajet_loss.values()}) > 4          # the modes really differ on this data


def test_the_debug_backbones_loss_equals_verls_token_mean(recorded, tiny_model_dir, tmp_path):
    """The whole debug-backbone path (collate, forward, weights by episode) against verl's vanilla loss on
    the DataProto; token-mean counts tokens, so episode vs row does not matter there."""
    py = venv_python("verl")
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig

    d, samples = recorded
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"},
                     model={"path": tiny_model_dir, "device": "cpu", "max_model_len": 1024},
                     algorithm={"loss_agg_mode": "token-mean", "clip_ratio_high": CLIP["clip_ratio_high"],
                                "clip_ratio_c": CLIP["clip_ratio_c"]})
    bb = DebugBackbone(cfg)
    try:
        stats = bb.accumulate_gradients([Sample(**s) for s in d["samples"]])
    finally:
        bb.close()
    res = _run(py, "verl_check.py", {**d, **CLIP, "modes": ["token-mean"],
                                     "logprob_sets": {"model": d["logprob_sets"]["model"]}}, tmp_path)
    assert abs(stats["loss"] - res["loss"]["model/token-mean"]) < 1e-6, (stats["loss"], res["loss"])


# The main job's lr; "drop_last" leaves 11 rows, which 2 ranks cannot split evenly (one all-masked pad row)
VERL_UPDATE_RUNS = [
    {"name": "token-mean", "mode": "token-mean", "dp": 1, "kl_coef": 0.0, "select": "drop_last"},
    {"name": "seq-mean-token-sum", "mode": "seq-mean-token-sum", "dp": 1, "kl_coef": 0.0, "select": "all"},
    {"name": "seq-mean-token-sum-norm", "mode": "seq-mean-token-sum-norm", "dp": 1, "kl_coef": 0.0, "select": "all"},
    # with forks verl's per-row token means differ from ajet's per-episode ones by design (docs/backbones.md)
    {"name": "seq-mean-token-mean", "mode": "seq-mean-token-mean", "dp": 1, "kl_coef": 0.0, "select": "no_forks"},
    {"name": "token-mean/dp2/kl", "mode": "token-mean", "dp": 2, "kl_coef": 0.1, "select": "drop_last",
     "same_as": "token-mean"},
]


def test_verl_update_on_cpu_equals_the_debug_backbones(recorded, tiny_model_dir, tmp_path):
    """verl's own update (RayWorkerGroup of AjetActorWorker, FSDP2 on gloo, ppo_loss, AdamW; CPU platform) and the
    debug backbone on the same recorded batch: first-update gradients within GRAD_REL, the weight changes after
    update 1 what AdamW makes of the two gradients and after 3 within 3x that (relative L2; see the bounds at the
    top) for every loss_agg_mode; 2 FSDP ranks (with an odd row count, padded) give the gradient of 1 rank; the
    KL term uses verl's reference worker; the engine serves the actor's weights after every update (verl's
    weight export)."""
    py = venv_python("verl")
    d, samples = recorded
    assert len(samples) % 2 == 0            # so that "drop_last" makes the row count odd
    res = _run(py, "verl_update_check.py", {"model_dir": tiny_model_dir, "samples": d["samples"], "lr": _main_job_lr(),
                                            "runs": VERL_UPDATE_RUNS}, tmp_path, timeout=1800)   # a bound
    assert set(res) == {r["name"] for r in VERL_UPDATE_RUNS}
    for name, r in res.items():                                           # shown by pytest -rP
        print(f"{name}: grads {r['grad_rel']:.2e}, weights after 1 {r['weight_rel_1']:.3e} (AdamW of the gradients "
              f"{r['adam_rel']:.3e}), after 3 {r['weight_rel']:.3e}; 2 ranks vs 1 {r.get('grad_rel_vs_same_as')}")
    for name, r in res.items():
        assert r["grad_rel"] < GRAD_REL, (name, r)
        assert abs(r["weight_rel_1"] - r["adam_rel"]) <= STEP1_REL * r["adam_rel"] + STEP1_ABS, (name, r)
        assert r["weight_rel"] <= UPDATES * r["adam_rel"], (name, r)
        assert r["engine_vs_actor"] == 0.0, (name, r)          # ajet's engine holds exactly the actor's weights
        assert r["optimizer_steps"] == [1.0, 1.0, 1.0] and r["policy_version"] == 3, (name, r)
    assert res["token-mean/dp2/kl"]["grad_rel_vs_same_as"] < GRAD_REL
    assert res["token-mean"]["rows"] == len(samples) - 1
    # the modes really differ on this batch (the comparison is not mode-blind)
    assert len({round(r["grad_norm"], 4) for n, r in res.items() if "dp2" not in n}) >= 3


def test_trinity_experiences_and_policy_loss_equal_ajets(recorded, tmp_path):
    py = venv_python("trinity")
    d, samples = recorded
    res = _run(py, "trinity_check.py", {**d, **CLIP, "modes": list(LOSS_AGG_MODES)}, tmp_path)
    t, ajet_loss, _ = ajet_losses(d, samples, loss_scale_factor=None)
    assert res["trinity_version"].startswith("0.6")
    # Trinity stacks the Experiences into exactly verl's layout
    for k, v in res["tensors"].items():
        assert v == t[k].tolist(), k
    assert res["rewards"] == [s.reward for s in samples]
    # Trinity's seq-mean-token-sum-norm divides by the horizon only (no 1/num_sequences) and uses the padded
    # width: ajet's (at C = the padded width) times the number of rows; the other three modes are equal
    rows = len(samples)
    for key, value in ajet_loss.items():
        expected = value * (rows if key.endswith("/seq-mean-token-sum-norm") else 1)
        assert abs(res["loss"][key] - expected) < 1e-6, (key, res["loss"][key], expected)


CLI_CONF = """
workflow: wf.py:W
data: {train_path: tasks.jsonl}
model: {path: Qwen/Qwen2.5-0.5B-Instruct}
"""
CLI_WORKFLOW = """
from ajet.workflow import Workflow, WorkflowOutput
class W(Workflow):
    async def execute(self, task, tuner):
        return WorkflowOutput(reward=0.0)
"""


def _ajet_cli(python, tmp_path):
    (tmp_path / "c.yaml").write_text(CLI_CONF)
    (tmp_path / "wf.py").write_text(CLI_WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "q", "answer": "a"}\n')
    return subprocess.run([python, "-m", "ajet", "--conf", str(tmp_path / "c.yaml"), "--backbone", "verl",
                           "--exp-dir", str(tmp_path / "exp")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_ajet_backbone_verl_without_the_extra_names_it(tmp_path):
    import importlib.util
    import sys

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed in this environment")
    proc = _ajet_cli(sys.executable, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pip install 'ajet[verl]'" in proc.stderr


def test_ajet_backbone_verl_asking_for_vllm_without_a_gpu_says_it_needs_one(tmp_path):
    """Without CUDA the verl backbone trains with ajet's engine as its rollout; asking for verl's vLLM rollout
    there is a config error naming the key, not a traceback."""
    conf = CLI_CONF + "verl: {actor_rollout_ref.rollout.name: vllm}\n"
    (tmp_path / "c.yaml").write_text(conf)
    (tmp_path / "wf.py").write_text(CLI_WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "q", "answer": "a"}\n')
    proc = subprocess.run([venv_python("verl"), "-m", "ajet", "--conf", str(tmp_path / "c.yaml"), "--backbone",
                           "verl", "--exp-dir", str(tmp_path / "exp")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "actor_rollout_ref.rollout.name=vllm" in proc.stderr and "needs a CUDA GPU" in proc.stderr


VERL_CONFIG_CHECK = """
import sys
from ajet.backbones.verl.backbone import verl_config
from ajet.config import load_config
from ajet.errors import ConfigError
try:
    c = verl_config(load_config(sys.argv[1]), cuda=sys.argv[2] == "cuda")
except ConfigError as exc:
    print("ConfigError:", exc)
    sys.exit(0)
a = c.actor_rollout_ref
print("composed", a.actor.loss_agg_mode, a.actor.loss_scale_factor, a.model.lora_rank, a.rollout.n,
      c.trainer.n_gpus_per_node, a.rollout.name, a.actor.strategy, a.actor.optim.clip_grad,
      a.actor.fsdp_config.mixed_precision.param_dtype, a.model.override_config.attn_implementation)
"""


@pytest.mark.parametrize("device, extra, expected", [
    ("cuda", "model: {path: Qwen/Qwen2.5-0.5B-Instruct, lora: {rank: 8, alpha: 16}}\nrollout: {num_repeat: 5}\n"
     "algorithm: {kl_coef: 0.01, loss_agg_mode: seq-mean-token-sum-norm, loss_scale_factor: 512, max_grad_norm: 0.5}\n"
     "verl: {trainer: {n_gpus_per_node: 8}, actor_rollout_ref.rollout.engine_kwargs.vllm.logprobs_mode: "
     "processed_logprobs}\n", "composed seq-mean-token-sum-norm 512.0 8 5 8 vllm fsdp 0.5 fp32 sdpa"),
    # without CUDA: ajet's engine generates, verl's actor gets the CPU settings (FSDP2), model.dtype -> fp32
    ("cpu", "model: {path: Qwen/Qwen2.5-0.5B-Instruct}\nverl: {trainer: {n_gpus_per_node: 2}}\n",
     "composed seq-mean-token-mean None 0 4 2 vllm fsdp2 1.0 fp32 sdpa"),
    ("cuda", "model: {path: Qwen/Qwen2.5-0.5B-Instruct}\nverl: {actor_rollout_ref.rollout.nmae: vllm}\n",
     "ConfigError: verl's config has no key `actor_rollout_ref.rollout.nmae`"),
])
def test_every_translated_key_exists_in_verls_own_config(tmp_path, device, extra, expected):
    """verl's ppo_trainer.yaml composed by Hydra in the verl venv takes every key the translation writes;
    a misspelt key in the `verl:` block is a ConfigError naming it."""
    line = _config_check(venv_python("verl"), VERL_CONFIG_CHECK, extra, tmp_path, device)
    assert line.startswith(expected), line


def _config_check(py: str, script: str, extra: str, tmp_path, *args: str) -> str:
    """The last line `script` prints for a config of the minimal keys + `extra` (then `args`), run by the venv's `py`."""
    (tmp_path / "c.yaml").write_text("workflow: wf.py:W\ndata: {train_path: tasks.jsonl}\n" + extra)
    proc = subprocess.run([py, "-c", script, str(tmp_path / "c.yaml"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


VERL_API_CHECK = """
import inspect
from verl.checkpoint_engine import CheckpointEngineManager
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.metric import reduce_metrics
from verl.workers.rollout.llm_server import LLMServerManager
import ajet.backbones.verl.backbone
assert {"add_actor_rollout_worker", "init_resource_pool_mgr"} <= set(dir(BaseTaskRunner))
assert {"init_workers", "_update_actor"} <= set(dir(RayPPOTrainer))
assert {"sleep_replicas", "update_weights"} <= set(dir(CheckpointEngineManager))
assert "self.server_addresses" in inspect.getsource(LLMServerManager)
assert {"train_dataset", "val_dataset", "collate_fn"} <= set(inspect.signature(RayPPOTrainer.__init__).parameters)
print("ok")
"""


def test_the_verl_api_the_adapter_calls_exists():
    """The GPU-only adapter (backbones/verl/backbone.py) is written against verl 0.9.1: every verl name it
    calls must exist in the pinned verl, so a verl bump that renames one fails here, not on a GPU cluster."""
    proc = subprocess.run([venv_python("verl"), "-c", VERL_API_CHECK], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


VERL_AGG_LOSS = """
import json, sys
import torch
from verl.trainer.ppo.core_algos import agg_loss
d = json.load(sys.stdin)
mat, mask = torch.tensor(d["loss_mat"], dtype=torch.float64), torch.tensor(d["mask"], dtype=torch.float64)
print(json.dumps({f"{m}/{f}": float(agg_loss(mat, mask, m, loss_scale_factor=f)) for m in d["modes"]
                  for f in (None, 64.0)}))
"""


def test_agg_loss_equals_verls_own_with_fully_masked_rows():
    """ajet's `agg_loss` against verl 0.9.1's own `agg_loss` (not a re-written reference) on a batch with a
    fully masked row, which verl leaves out of the sequence count of the seq-mean modes (1e-7: verl adds 1e-8
    to each row's token count in seq-mean-token-mean)."""
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=g) > 0.4).double()
    mask[2] = 0
    mask[4] = 0
    mask[0, 0] = 1
    payload = {"loss_mat": loss_mat.tolist(), "mask": mask.tolist(), "modes": list(LOSS_AGG_MODES)}
    proc = subprocess.run([venv_python("verl"), "-c", VERL_AGG_LOSS], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verl = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in LOSS_AGG_MODES:
        for factor in (None, 64.0):
            ours = float(agg_loss(loss_mat, mask, mode, factor))
            assert abs(verl[f"{mode}/{factor}"] - ours) < 1e-7, (mode, factor, verl[f"{mode}/{factor}"], ours)


TRINITY_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# the modes trained on 2 ranks too: loss tokens (token-mean) and rows (seq-mean-*: the padding row must not count)
DP_MODES = ["token-mean", "seq-mean-token-mean"]


def _main_job_lr() -> float:
    import yaml

    return float(yaml.safe_load((ROOT / "tutorial/example_math_agent/math_agent.yaml").read_text())["algorithm"]["lr"])


def _l2(a: dict) -> float:
    """The L2 norm of all tensors of `a` as one vector."""
    return float(torch.cat([v.flatten().double() for v in a.values()]).norm())


def _rel_l2(a: dict, b: dict) -> float:
    keys = sorted(b)
    x = torch.cat([a[k].flatten().double() for k in keys])
    y = torch.cat([b[k].flatten().double() for k in keys])
    return float((x - y).norm() / y.norm())


def test_trinity_update_equals_the_debug_backbones(recorded, tiny_model_dir, tmp_path):
    """The real Trinity trainer (VERLTrainer -> TrinityActorRolloutRefWorker -> verl 0.8 FSDP2 on gloo, Trinity's PPO
    loss) and the debug backbone train the same recorded batch from the same weights: the gradients the worker's
    optimizer stepped with in the first update (copied inside the Ray worker) agree to GRAD_REL (relative L2), and
    the weight changes of the engine's weights to the bounds verl's test uses (after update 1: what AdamW makes of
    the two gradients; after 3 at the main job's lr: 3x that), for every `loss_agg_mode` the two share; the
    engine's weights moved as far as the debug backbone's (an update that never reached them fails). Trinity's
    sequences are rows, so the debug side gets one episode per row (with forks, ajet counts episodes: a documented
    difference); Trinity's seq-mean-token-sum-norm divides by the horizon only, so its gradient is rows x the debug
    backbone's at the same horizon (pinned), and the debug run of the weights uses the horizon / rows. No gradient
    clipping on either side (max_grad_norm 1e6): clipping is torch's `clip_grad_norm_` on both. The shared modes run
    again with the batch split into >= 3 micro-batches: verl sums their losses, so each must be scaled to its share
    of the step (`backbones/trinity/loss.py`), else the gradient is ~3x the debug backbone's. Data parallel: token-mean
    and seq-mean-token-mean on 2 FSDP ranks (`trinity: {cluster: {gpu_per_node: 2}}`: 2 Ray workers, gloo) train an
    odd number of rows (one all-masked padding row) to the gradient of 1 rank within GRAD_REL, and to the debug
    backbone's first update within its bounds (a padding row counted as a row moves seq-mean-token-mean by 1/rows).
    """
    py = venv_python("trinity")
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig

    d, _ = recorded
    lr = _main_job_lr()
    rows = [Sample(**{**s, "episode_id": f"{s['episode_id']}#{i}"}) for i, s in enumerate(d["samples"])]
    width = max(len(s.response_ids) for s in rows)          # Trinity's horizon: the padded response width
    inp, out = tmp_path / "in.json", tmp_path / "out.pt"
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in rows]
    micro = max(max(lengths), sum(lengths) // 3)            # >= 3 micro-batches of whole rows (verl's packing)
    runs = [[m, None] for m in TRINITY_MODES] + [[m, micro] for m in TRINITY_MODES[:3]]
    # data parallel: 1 and 2 FSDP ranks (2 Ray workers, gloo) on an odd number of rows (one padding row), 1 update
    odd = len(rows) - 1
    assert odd % 2 == 1
    dp_runs = [[m, None, {"rows": odd, "steps": 1, "world_size": w}] for m in DP_MODES for w in (1, 2)]
    inp.write_text(json.dumps({"model_dir": tiny_model_dir, "exp_dir": str(tmp_path / "exp"), "samples": d["samples"],
                               "runs": runs + dp_runs, "lr": lr, "steps": 3, **CLIP, "max_grad_norm": 1e6}))
    proc = subprocess.run([py, str(CHECKS / "trinity_update.py"), str(inp), str(out)], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)       # a bound, not a speed target: 900 s ran out at load ~20
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    trinity = torch.load(out, weights_only=False)

    def debug(mode, scale):
        return DebugBackbone(AjetConfig(
            workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu",
                                                             "max_model_len": 1024},
            algorithm={"lr": lr, "loss_agg_mode": mode, "loss_scale_factor": scale, "max_grad_norm": 1e6,
                       "clip_ratio_low": CLIP["clip_ratio_low"], "clip_ratio_high": CLIP["clip_ratio_high"],
                       "clip_ratio_c": CLIP["clip_ratio_c"]}))

    def reference(mode, rows=rows):                        # the debug backbone's gradients and weights
        norm = mode == "seq-mean-token-sum-norm"
        bb = debug(mode, None)
        bb.optimizer.zero_grad(set_to_none=True)
        bb.accumulate_gradients(rows)
        ratio = len(rows) if norm else 1.0                  # Trinity = rows x ajet (horizon only, no 1/sequences)
        grads = {k: p.grad * ratio for k, p in bb.model.named_parameters() if p.grad is not None}
        eps = bb.optimizer.param_groups[0]["eps"]
        bb.close()
        bb = debug(mode, width / len(rows) if norm else None)
        initial = {k: v.clone() for k, v in bb.model.state_dict().items()}
        bb.optimizer.zero_grad(set_to_none=True)
        bb.accumulate_gradients(rows)                      # what its first update steps with (for sum-norm not
        stepped = {k: p.grad.clone() for k, p in bb.model.named_parameters() if p.grad is not None}   # bitwise
        bb.optimizer.zero_grad(set_to_none=True)           # `grads`: another scale, other float32 roundings)
        bb.update(rows)
        weights_1 = {k: v.clone() for k, v in bb.model.state_dict().items()}
        for _ in range(UPDATES - 1):
            bb.update(rows)
        weights = bb.model.state_dict()
        bb.close()
        return {"grads": grads, "stepped": stepped, "eps": eps, "initial": initial, "weights_1": weights_1,
                "weights": weights}

    refs = {mode: reference(mode) for mode in TRINITY_MODES}
    measured = {}
    for mode, tokens in runs:
        ref, got = refs[mode], trinity[f"{mode}@{tokens}"]
        assert set(got["grads"]) == set(ref["grads"]), (mode, tokens)

        def change(w, ref=ref):
            return {k: w[k] - ref["initial"][k] for k in ref["weights"]}

        measured[f"{mode}@{tokens}"] = m = {
            "grad_rel": _rel_l2(got["grads"], ref["grads"]),
            "adam_rel": first_update_rel(got["grads"], ref["stepped"], lr, ref["eps"], 1e6),   # 1e6: no clipping
            "weight_rel_1": _rel_l2(change(got["weights_1"]), change(ref["weights_1"])),
            "weight_rel": _rel_l2(change(got["weights"]), change(ref["weights"])),
            # how far the engine's weights moved from the initial ones, and the debug backbone's (L2)
            "moved": _l2(change(got["weights"])), "moved_debug": _l2(change(ref["weights"])),
            "moved_max": max(float(v.abs().max()) for v in change(got["weights"]).values())}
        print(f"{mode}@{tokens}: grads {m['grad_rel']:.2e}, weights after 1 {m['weight_rel_1']:.3e} (AdamW of the "
              f"gradients {m['adam_rel']:.3e}), after 3 {m['weight_rel']:.3e}")           # shown by pytest -rP
    for (mode, tokens), (key, m) in zip(runs, measured.items()):
        assert m["grad_rel"] < GRAD_REL, (key, m)
        assert abs(m["weight_rel_1"] - m["adam_rel"]) <= STEP1_REL * m["adam_rel"] + STEP1_ABS, (key, m)
        assert m["weight_rel"] <= UPDATES * m["adam_rel"], (key, m)
        # the update reached the engine's weights: they moved from the initial ones as far as the debug backbone's
        # (AdamW moves a weight by up to lr per update; an engine never loaded moved 0)
        assert m["moved"] > 0.9 * m["moved_debug"] and m["moved_max"] > lr, (key, m)
        assert [s["optimizer_steps"] for s in trinity[key]["metrics"]] == [1.0, 1.0, 1.0]
        if tokens is not None:     # the step really ran as several micro-batches, each scaled to its share
            share = trinity[key]["metrics"][0]["actor/micro_batch_share"]
            assert 0 < share < 0.6, (key, share)
    # 2 ranks train the odd batch (padded by one all-masked row) as 1 rank does, and as the debug backbone
    for mode in DP_MODES:
        ref = reference(mode, rows[:odd])
        one, two = (trinity[f"{mode}@None/rows{odd}/dp{w}"] for w in (1, 2))
        m = {"grad_rel_2_vs_1": _rel_l2(two["grads"], one["grads"]), "grad_rel": _rel_l2(two["grads"], ref["grads"]),
             "adam_rel": first_update_rel(two["grads"], ref["stepped"], lr, ref["eps"], 1e6),
             "weight_rel_1": _rel_l2({k: two["weights_1"][k] - ref["initial"][k] for k in ref["weights"]},
                                     {k: ref["weights_1"][k] - ref["initial"][k] for k in ref["weights"]})}
        print(f"{mode} on {odd} rows, 2 ranks: vs 1 rank {m['grad_rel_2_vs_1']:.2e}, grads vs debug "
              f"{m['grad_rel']:.2e}, weights after 1 {m['weight_rel_1']:.3e} (AdamW of the gradients "
              f"{m['adam_rel']:.3e})")
        assert m["grad_rel_2_vs_1"] < GRAD_REL and m["grad_rel"] < GRAD_REL, (mode, m)
        assert abs(m["weight_rel_1"] - m["adam_rel"]) <= STEP1_REL * m["adam_rel"] + STEP1_ABS, (mode, m)
        assert [s["optimizer_steps"] for s in two["metrics"]] == [1.0]
    # the modes really differ on this batch (else the test could not tell them apart)
    g = [torch.cat([v.flatten() for v in trinity[f"{m}@None"]["grads"].values()]) for m in TRINITY_MODES[:3]]
    assert float((g[0] - g[1]).norm()) > 1e-3 * float(g[0].norm()) and float((g[0] - g[2]).norm()) > 1e-3 * float(
        g[0].norm())


TRINITY_CONFIG_CHECK = """
import sys
from ajet.backbones.trinity.config import trinity_config, world_size_of
from ajet.config import load_config
from ajet.errors import ConfigError
try:
    cfg = load_config(sys.argv[1])
    c = trinity_config(cfg, "MODEL", "/tmp/ckpt", world_size_of(cfg, on_cpu=True), on_cpu=True)
except ConfigError as exc:
    print("ConfigError:", exc)
    sys.exit(0)
a = c.algorithm
print("composed", a.algorithm_type, a.policy_loss_fn, sorted(a.policy_loss_fn_args), a.loss_agg_mode, a.kl_loss_fn,
      a.optimizer.lr, c.trainer.save_interval, c.trainer.trainer_config["actor"]["fsdp_config"]["mixed_precision"])
"""


@pytest.mark.parametrize("extra, expected", [
    ("algorithm: {lr: 2.0e-5, loss_agg_mode: seq-mean-token-sum}\n",
     "composed dapo ppo ['clip_range_high', 'clip_range_low', 'clip_ratio_c', 'loss_agg_mode'] seq-mean-token-sum "
     "none 2e-05 0 {'param_dtype': 'fp32', 'reduce_dtype': 'fp32', 'buffer_dtype': 'fp32'}"),
    ("algorithm: {kl_coef: 0.01}\ntrinity: {algorithm: {policy_loss_fn: gspo}, trainer.save_interval: 5}\n",
     "composed grpo gspo ['clip_range_high', 'clip_range_low', 'loss_agg_mode'] seq-mean-token-mean low_var_kl 1e-06 5"),
    ("trinity: {algorithm: {polciy_loss_fn: gspo}}\n", "ConfigError: `trinity.algorithm.polciy_loss_fn`"),
    ("algorithm: {mini_batches: 2}\n", "ConfigError: algorithm.mini_batches=2"),
    ("algorithm: {loss_agg_mode: seq-mean-token-sum-norm, micro_batch_tokens: 4096}\n",
     "ConfigError: algorithm.micro_batch_tokens with loss_agg_mode seq-mean-token-sum-norm"),
    ("algorithm: {micro_batch_tokens: 1024}\n", "ConfigError: algorithm.micro_batch_tokens=1024 < model.max_model_len"),
    ("algorithm: {loss_agg_mode: seq-mean-token-sum-norm}\ntrinity: {cluster: {gpu_per_node: 2}}\n",
     "ConfigError: loss_agg_mode seq-mean-token-sum-norm with 2 Trinity ranks"),
    ("trinity: {cluster: {node_num: 2, gpu_per_node: 1}}\n", "ConfigError: `trinity.cluster.node_num: 2` on a machine"),
])
def test_the_trinity_block_reaches_trinitys_config(tmp_path, extra, expected):
    """ajet's keys and the `trinity:` block compose into Trinity's own typed Config (its validators run, in the
    trinity venv): Trinity's algorithm choice passes through with that algorithm's own defaults; a misspelt key is
    a ConfigError naming it; a setting the backbone cannot honour is a ConfigError naming the ajet key."""
    line = _config_check(venv_python("trinity"), TRINITY_CONFIG_CHECK, extra, tmp_path)
    assert line.startswith(expected), line
