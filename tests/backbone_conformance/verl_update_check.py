"""Runs INSIDE the verl environment (.venvs/verl): the same recorded samples trained by ajet's verl backbone (verl's
RayWorkerGroup, FSDP2 on gloo, verl's ppo_loss and AdamW, on CPU) and by the debug backbone (in-process torch).

    .venvs/verl/bin/python tests/backbone_conformance/verl_update_check.py IN.json OUT.json

IN.json: model_dir, exp_dir (a folder it may write), samples (advantages set), lr, runs: [{name, mode, dp, kl_coef,
select}] (select: "all", "no_forks": the first sample of each episode only, "drop_last": all but the last sample). For
each run, OUT.json gets: the relative L2 distance between verl's and the debug backbone's gradients of the first
update (all parameters as one vector), the same for the weight changes after 1 and after 3 updates; for each side, how
far its weights after update 1 are from those torch's AdamW makes of its gradient in float32 (adam.py's
`adamw_first_step`), in float32 rounding units (`step_units_verl`, `step_units_debug`: adam.py's `rounding_units`);
how far apart those two AdamW steps put the weights (`adam_rel`: the weights' expected distance after update 1) and
what the float64 formula makes of it without the float32 weights (`adam_rel_f64`); verl's grad_norm and optimizer
steps, and, for a run with `same_as` (another run's name), the relative L2 distance between the two runs' verl
gradients (2 FSDP ranks against 1). OUT.json: {"runs": {name: those figures}, "actor_threads": {dp: the torch threads
of each of verl's actor ranks, as they report them}}.

The runs of one (dp, kl_coef) share one verl backbone, one after the other, as a user's run would never: each
starts from a checkpoint of the initial weights and optimizer saved before the first (verl's checkpoint manager),
and gets its `loss_agg_mode` and `loss_scale_factor` from ajet's translation of its own config (`verl_config`)
into the config object verl's loss function reads on every rank (`set_loss_config`). A worker group's start-up
costs about as much CPU as a run's three updates and checks; the first run of each group goes through verl's
own start-up with its config as a user's run does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def rel(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all tensors of two {name: tensor} dicts with the same names."""
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def set_loss_config(verl, cfg) -> None:
    """The `loss_agg_mode` and `loss_scale_factor` that ajet's translation of `cfg` (`verl_config`) gives verl's
    actor, put into the config object each rank's loss function (`partial(ppo_loss, config=...)`, verl's
    engine_workers) reads at every micro-batch."""
    import ray

    from ajet.backbones.verl.backbone import verl_config

    actor = verl_config(cfg, cuda=False).actor_rollout_ref.actor
    mode, scale = actor.loss_agg_mode, actor.get("loss_scale_factor")

    def put(worker):
        config = worker.loss_fn.keywords["config"]
        object.__setattr__(config, "loss_agg_mode", mode)        # verl's config dataclasses refuse plain setattr
        object.__setattr__(config, "loss_scale_factor", scale)
        return config.loss_agg_mode, config.loss_scale_factor

    assert set(ray.get([w.__ray_call__.remote(put) for w in verl.actor_wg.workers])) == {(mode, scale)}


def main(inp: str, out: str) -> None:
    import ray

    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.backbones.verl.backbone import VerlBackbone
    from ajet.config import AjetConfig
    from ajet.tracker.sample import Sample
    from adam import adamw_first_step, first_update_rel, rounding_units   # adam.py, this script's folder

    d = json.load(open(inp))
    all_samples = [Sample(**s) for s in d["samples"]]
    res = {}
    threads = {}
    grads_by_run = {}
    groups: dict[tuple, list[dict]] = {}            # the runs that share a verl backbone, in order
    for run in d["runs"]:
        groups.setdefault((run["dp"], run["kl_coef"]), []).append(run)
    for (dp, _), runs in groups.items():
        verl = init = None
        for run in runs:
            samples = {"all": all_samples, "drop_last": all_samples[:-1],
                       "no_forks": [s for s in all_samples if "fork_reason" not in s.flags]}[run["select"]]
            conf = {"workflow": "x:y", "data": {"train_path": "x"},
                    "model": {"path": d["model_dir"], "max_model_len": 1024},
                    "algorithm": {"loss_agg_mode": run["mode"], "lr": d["lr"], "kl_coef": run["kl_coef"],
                                  "loss_scale_factor": 64.0 if run["mode"] == "seq-mean-token-sum-norm" else None}}
            debug = DebugBackbone(AjetConfig.model_validate({**conf, "model": {**conf["model"], "device": "cpu"}}))
            w0 = {k: v.detach().clone() for k, v in debug.model.named_parameters()}
            debug.accumulate_gradients(samples)
            g_debug = {k: p.grad.detach().clone() for k, p in debug.model.named_parameters()}
            debug.optimizer.zero_grad(set_to_none=True)
            debug.update(samples)
            w1_debug = {k: p.detach().clone() for k, p in debug.model.named_parameters()}
            dw1_debug = {k: w - w0[k] for k, w in w1_debug.items()}
            for _ in range(2):
                debug.update(samples)
            dw_debug = {k: p.detach() - w0[k] for k, p in debug.model.named_parameters()}

            verl_cfg = AjetConfig.model_validate({**conf, "backbone": "verl", "trainer": {"exp_dir": d["exp_dir"]},
                                                  "verl": {"trainer": {"n_gpus_per_node": dp}}})
            if verl is None:            # verl's own start-up, with this run's config
                verl = VerlBackbone(verl_cfg)
                threads[dp] = ray.get([w.__ray_call__.remote(lambda w: torch.get_num_threads())
                                       for w in verl.actor_wg.workers])
                verl.actor_wg.record_grads()
                init = Path(d["exp_dir"]) / f"init_dp{dp}"
                if len(runs) > 1:
                    verl.save_checkpoint(init)
            else:                       # the initial weights and a fresh optimizer; this run's loss
                verl.load_checkpoint(init)
                set_loss_config(verl, verl_cfg)
            assert verl.engine.policy_version == 0
            metrics = [verl.update(samples)]
            g_verl = verl.actor_wg.export_grads()[0]
            w1_verl = {k: v for k, v in verl.actor_wg.export_weights()[0].items() if k in w0}
            assert rel({k: v for k, v in verl.model.state_dict().items() if k in w0}, w1_verl) == 0.0
            dw1_verl = {k: w - w0[k] for k, w in w1_verl.items()}
            for _ in range(2):
                metrics.append(verl.update(samples))
            dw_verl = {k: v - w0[k] for k, v in verl.actor_wg.export_weights()[0].items() if k in w0}
            engine_w = {k: p.detach() - w0[k] for k, p in verl.model.named_parameters()}
            name = run["name"]
            group = debug.optimizer.param_groups[0]     # the config's lr, eps, betas, weight decay (verl: the same)
            hyper = {"lr": group["lr"], "eps": group["eps"], "max_grad_norm": debug.cfg.algorithm.max_grad_norm}
            step = {side: adamw_first_step(w0, g, weight_decay=group["weight_decay"], betas=group["betas"], **hyper)
                    for side, g in (("verl", g_verl), ("debug", g_debug))}
            res[name] = {"grad_rel": rel(g_verl, g_debug), "weight_rel": rel(dw_verl, dw_debug),
                         "weight_rel_1": rel(dw1_verl, dw1_debug),
                         "step_units_verl": rounding_units(w1_verl, step["verl"], w0),
                         "step_units_debug": rounding_units(w1_debug, step["debug"], w0),
                         "adam_rel": rel({k: w - w0[k] for k, w in step["verl"].items()},
                                         {k: w - w0[k] for k, w in step["debug"].items()}),
                         "adam_rel_f64": first_update_rel(g_verl, g_debug, **hyper),
                         "engine_vs_actor": rel(engine_w, dw_verl), "grad_norm": metrics[0]["grad_norm"],
                         "optimizer_steps": [m["optimizer_steps"] for m in metrics], "rows": len(samples),
                         "policy_version": verl.engine.policy_version}
            grads_by_run[name] = g_verl
            debug.close()
        verl.close()
    for run in d["runs"]:                   # data parallel: a run against the run named in its "same_as"
        if run.get("same_as"):
            res[run["name"]]["grad_rel_vs_same_as"] = rel(grads_by_run[run["name"]], grads_by_run[run["same_as"]])
    ray.shutdown()
    json.dump({"runs": res, "actor_threads": threads}, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
