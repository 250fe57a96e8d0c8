"""Conformance with the real Trinity-RFT package, in its own venv (.ci/make_backbone_env.sh): the recorded episodes
(tests/backbone_conformance/shared.py) as Trinity's Experiences and policy loss, Trinity's trainer updating on them
against the debug backbone (1 and 2 FSDP ranks), and the `trinity:` block reaching Trinity's typed config. Each
test skips, naming the build command, when the venv is absent; in CI it fails instead.
"""

import json
import subprocess

import pytest
import torch

from ajet.tracker.sample import Sample
from tests.backbone_conformance.adam import adamw_first_step, first_update_rel, rounding_units
from tests.backbone_conformance.shared import (CHECKS, CLIP, GRAD_REL, LOSS_AGG_MODES, ROOT, STEP1_UNITS, UPDATES,
                                               ajet_losses, config_case, main_job_lr, printed, run_check,
                                               run_scripts)
from tests.backbone_conformance.shared import recorded  # noqa: F401  (the module fixture the tests take)
from tests.backbone_conformance.venvs import venv_python

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 4.00 alone on 2026-12-06, 4.75 in .ci/run on 2026-12-07
PEAK_MEMORY_GB = 5.0


def test_trinity_experiences_and_policy_loss_equal_ajets(recorded, tmp_path):
    py = venv_python("trinity")
    d, samples = recorded
    res = run_check(py, "trinity_check.py", {**d, **CLIP, "modes": list(LOSS_AGG_MODES)}, tmp_path)
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


TRINITY_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# the modes trained on 2 ranks too: loss tokens (token-mean) and rows (seq-mean-*: the padding row must not count)
DP_MODES = ["token-mean", "seq-mean-token-mean"]


def _l2(a: dict) -> float:
    """The L2 norm of all tensors of `a` as one vector."""
    return float(torch.cat([v.flatten().double() for v in a.values()]).norm())


def _rel_l2(a: dict, b: dict) -> float:
    keys = sorted(b)
    x = torch.cat([a[k].flatten().double() for k in keys])
    y = torch.cat([b[k].flatten().double() for k in keys])
    return float((x - y).norm() / y.norm())


def _step_1(got: dict, ref: dict, hyper: dict) -> dict:
    """How each side's weights after update 1 stand to torch's float32 AdamW step of its own gradient from its own
    initial weights (`adamw_first_step` with the debug backbone's optimizer settings `hyper`, which Trinity's
    config must give its worker too), in float32 rounding units (`step_units_trinity`, `step_units_debug`: adam.py's
    `rounding_units`); how far apart the two steps put the weights (`adam_rel`, relative L2 of the two changes:
    the weights' expected distance after update 1) and the float64 formula's distance without the weights
    (`adam_rel_f64`, printed only). `got`: a Trinity run of trinity_update.py; `ref`: the debug backbone's run."""
    names = sorted(ref["stepped"])
    differ = [k for k in names if not torch.equal(got["weights_0"][k], ref["initial"][k])]
    assert not differ, f"Trinity's engine and the debug backbone start from other weights: {differ[:5]}"
    w0 = {k: ref["initial"][k] for k in names}
    step = {side: adamw_first_step(w0, g, **hyper)
            for side, g in (("trinity", got["grads"]), ("debug", ref["stepped"]))}
    return {"step_units_trinity": rounding_units({k: got["weights_1"][k] for k in names}, step["trinity"], w0),
            "step_units_debug": rounding_units({k: ref["weights_1"][k] for k in names}, step["debug"], w0),
            "adam_rel": _rel_l2({k: w - w0[k] for k, w in step["trinity"].items()},
                                {k: w - w0[k] for k, w in step["debug"].items()}),
            "adam_rel_f64": first_update_rel(got["grads"], ref["stepped"], hyper["lr"], hyper["eps"],
                                             hyper["max_grad_norm"])}


def test_trinity_update_equals_the_debug_backbones(recorded, tiny_model_dir, tmp_path):
    """The real Trinity trainer (VERLTrainer -> TrinityActorRolloutRefWorker -> verl 0.8 FSDP2 on gloo, Trinity's PPO
    loss) and the debug backbone train the same recorded batch from the same weights: the gradients the worker's
    optimizer stepped with in the first update (copied inside the Ray worker) agree to GRAD_REL (relative L2); on
    each side the weights after update 1 (the engine's, for Trinity) are exactly what torch's float32 AdamW makes
    of that side's own gradient from the initial weights at the main job's lr (to STEP1_UNITS float32 rounding
    units at every weight, as verl's test; measured 0; Trinity's gradient scaled by 1.001 after it was recorded:
    82-444 units, which the earlier 30% bound on the float64 formula passed), so the two sides' weights part only
    as far as AdamW makes of the two gradients (`adam_rel`), and after 3 updates within 3x that, for every
    `loss_agg_mode` the two share; the engine's weights moved as far as the debug backbone's (an update that never
    reached them fails). Trinity's sequences are rows, so the debug
    side gets one episode per row (with forks, ajet counts episodes: a documented difference); Trinity's
    seq-mean-token-sum-norm divides by the horizon only, so its gradient is rows x the debug backbone's at the same
    horizon (pinned), and the debug run of the weights uses the horizon / rows. No gradient clipping on either side
    (max_grad_norm 1e6): clipping is torch's `clip_grad_norm_` on both. The shared modes run again with the batch
    split into >= 3 micro-batches: verl sums their losses, so each must be scaled to its share of the step
    (`backbones/trinity/loss.py`), else the gradient is ~3x the debug backbone's. Data parallel: token-mean
    and seq-mean-token-mean on 2 FSDP ranks (`trinity: {cluster: {gpu_per_node: 2}}`: 2 Ray workers, gloo) train an
    odd number of rows (one all-masked padding row) to the gradient of 1 rank and the debug backbone's within
    GRAD_REL (a padding row counted as a row moves seq-mean-token-mean by 1/rows), and their weights after the
    update to torch's AdamW step of their gradient as above.
    """
    py = venv_python("trinity")
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig

    d, _ = recorded
    lr = main_job_lr()
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
        bb.close()
        bb = debug(mode, width / len(rows) if norm else None)
        group = bb.optimizer.param_groups[0]               # the config's lr, eps, betas, weight decay
        hyper = {k: group[k] for k in ("lr", "eps", "betas", "weight_decay")} | {"max_grad_norm": 1e6}   # no clipping
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
        return {"grads": grads, "stepped": stepped, "hyper": hyper, "initial": initial, "weights_1": weights_1,
                "weights": weights}

    refs = {mode: reference(mode) for mode in TRINITY_MODES}
    measured = {}
    for mode, tokens in runs:
        ref, got = refs[mode], trinity[f"{mode}@{tokens}"]
        assert set(got["grads"]) == set(ref["grads"]), (mode, tokens)

        def change(w, ref=ref):
            return {k: w[k] - ref["initial"][k] for k in ref["weights"]}

        measured[f"{mode}@{tokens}"] = m = {
            "grad_rel": _rel_l2(got["grads"], ref["grads"]), **_step_1(got, ref, ref["hyper"]),
            "weight_rel_1": _rel_l2(change(got["weights_1"]), change(ref["weights_1"])),
            "weight_rel": _rel_l2(change(got["weights"]), change(ref["weights"])),
            # how far the engine's weights moved from the initial ones, and the debug backbone's (L2)
            "moved": _l2(change(got["weights"])), "moved_debug": _l2(change(ref["weights"])),
            "moved_max": max(float(v.abs().max()) for v in change(got["weights"]).values())}
        print(f"{mode}@{tokens}: grads {m['grad_rel']:.2e}, weights after 1 {m['weight_rel_1']:.3e} (AdamW of the "
              f"gradients {m['adam_rel']:.3e}, float64 formula {m['adam_rel_f64']:.3e}; each side from its AdamW: "
              f"Trinity {m['step_units_trinity']:.3g}, debug {m['step_units_debug']:.3g} rounding units), after 3 "
              f"{m['weight_rel']:.3e}")                                                      # shown by pytest -rP
    for (mode, tokens), (key, m) in zip(runs, measured.items()):
        assert m["grad_rel"] < GRAD_REL, (key, m)
        assert m["step_units_trinity"] <= STEP1_UNITS and m["step_units_debug"] <= STEP1_UNITS, (key, m)
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
             **_step_1(two, ref, ref["hyper"]),
             "weight_rel_1": _rel_l2({k: two["weights_1"][k] - ref["initial"][k] for k in ref["weights"]},
                                     {k: ref["weights_1"][k] - ref["initial"][k] for k in ref["weights"]})}
        print(f"{mode} on {odd} rows, 2 ranks: vs 1 rank {m['grad_rel_2_vs_1']:.2e}, grads vs debug "
              f"{m['grad_rel']:.2e}, weights after 1 {m['weight_rel_1']:.3e} (AdamW of the gradients "
              f"{m['adam_rel']:.3e}, float64 formula {m['adam_rel_f64']:.3e}; 2 ranks from their AdamW "
              f"{m['step_units_trinity']:.3g}, debug {m['step_units_debug']:.3g} rounding units)")
        assert m["grad_rel_2_vs_1"] < GRAD_REL and m["grad_rel"] < GRAD_REL, (mode, m)
        assert m["step_units_trinity"] <= STEP1_UNITS and m["step_units_debug"] <= STEP1_UNITS, (mode, m)
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
      a.optimizer.lr, c.trainer.save_interval, c.trainer.trainer_config["actor"]["fsdp_config"]["mixed_precision"],
      c.trainer.trainer_config["model"]["enable_gradient_checkpointing"])
"""


# (the config's extra keys, what the check prints first)
TRINITY_CONFIG_CASES = [
    ("algorithm: {lr: 2.0e-5, loss_agg_mode: seq-mean-token-sum}\n",
     "composed dapo ppo ['clip_range_high', 'clip_range_low', 'clip_ratio_c', 'loss_agg_mode'] seq-mean-token-sum "
     "none 2e-05 0 {'param_dtype': 'fp32', 'reduce_dtype': 'fp32', 'buffer_dtype': 'fp32'} True"),
    # model.gradient_checkpointing unset: on (above); false reaches Trinity's trainer config
    ("model: {gradient_checkpointing: false}\n",
     "composed dapo ppo ['clip_range_high', 'clip_range_low', 'clip_ratio_c', 'loss_agg_mode'] seq-mean-token-mean "
     "none 1e-06 0 {'param_dtype': 'fp32', 'reduce_dtype': 'fp32', 'buffer_dtype': 'fp32'} False"),
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
    ("rollout: {ray_address: '127.0.0.1:6379'}\n", "ConfigError: rollout.ray_address='127.0.0.1:6379' (--ray-address)"),
]


@pytest.fixture(scope="module")
def trinity_configs(tmp_path_factory) -> list[dict]:
    """What TRINITY_CONFIG_CHECK prints for each of TRINITY_CONFIG_CASES in the trinity venv ({"stdout"}, plus
    "error" for one that raised), all in one process (`run_scripts`): Trinity's import once instead of once a case."""
    folder = tmp_path_factory.mktemp("trinity_configs")
    cases = [config_case(folder, f"c{i}", TRINITY_CONFIG_CHECK, extra)
             for i, (extra, _) in enumerate(TRINITY_CONFIG_CASES)]
    return run_scripts(venv_python("trinity"), cases, folder)


@pytest.mark.parametrize("case", range(len(TRINITY_CONFIG_CASES)))
def test_the_trinity_block_reaches_trinitys_config(trinity_configs, case):
    """ajet's keys and the `trinity:` block compose into Trinity's own typed Config (its validators run, in the
    trinity venv): Trinity's algorithm choice passes through with that algorithm's own defaults; a misspelt key is
    a ConfigError naming it; a setting the backbone cannot honour is a ConfigError naming the ajet key."""
    line = printed(trinity_configs[case])
    assert line.startswith(TRINITY_CONFIG_CASES[case][1]), line


HOOK_CHECK = """
import json, sys
from ajet.backbones.trinity.loss import _build_trinity_loss_shared, setup_worker
setup_worker()                  # as Ray runs it first in each worker of the backbone's cluster
before = sorted(m for m in ("torch", "trinity", "verl") if m in sys.modules)
import trinity.trainer.verl.workers as workers
import torch
import verl.utils.device as device
print(json.dumps({"before": before, "trinity_loss": workers.build_trinity_loss is _build_trinity_loss_shared,
                  "backend": device.get_nccl_backend(), "capability": list(torch.cuda.get_device_capability())}))
"""


def test_the_workers_setup_hook_changes_verl_and_trinity_once_the_worker_imports_them():
    """Ray's setup hook of the backbone's cluster imports neither torch nor verl (a worker that never imports them,
    such as ajet's explorer handle, pays for neither), and a worker that then imports Trinity's worker module gets
    the CPU changes and the micro-batch loss: the state the checks above train in."""
    proc = subprocess.run([venv_python("trinity"), "-c", HOOK_CHECK], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"before": [], "trinity_loss": True, "backend": "gloo", "capability": [0, 0]}, out
