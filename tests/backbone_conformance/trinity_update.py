"""Runs INSIDE the Trinity environment (.venvs/trinity): the real Trinity backbone (`TrinityBackbone`: Trinity-RFT's
`VERLTrainer` with its FSDP2 worker in a Ray worker group on CPU) trains ajet's recorded samples, per
`loss_agg_mode`, from the same initial weights: the gradients the worker's optimizer stepped with in the first
update (copied inside the Ray worker) and the weights ajet's engine holds after `steps` updates (synced back through
Trinity's Synchronizer).

    .venvs/trinity/bin/python tests/backbone_conformance/trinity_update.py IN.json OUT.pt

IN.json: {"model_dir", "exp_dir", "samples", "runs", "lr", "steps", "clip_ratio_low", "clip_ratio_high",
"clip_ratio_c"}; "runs": [[loss_agg_mode, micro_batch_tokens or null (the whole batch in one micro-batch)
(, {"rows": the first N samples only, "steps": updates instead of "steps", "world_size": FSDP ranks})], ...].
The runs of one world size share one backbone (`trinity: {cluster: {gpu_per_node: N}}`), one after the other.
OUT.pt: {run_key(run): {"grads": {name: tensor}, "weights_0": {name: tensor} (the engine's, before the first
update: what the test computes torch's AdamW step from), "weights_1": {name: tensor} (after the first update),
"weights": {name: tensor} (after the last), "metrics": [dict per step]}}.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch


def run_key(run: list) -> str:
    """"MODE@TOKENS", plus "/rowsN/dpW" for a run with options."""
    mode, tokens, *opts = run
    o = opts[0] if opts else {}
    return f"{mode}@{tokens}" + (f"/rows{o.get('rows')}/dp{o.get('world_size', 1)}" if o else "")


def capture_grads(backbone) -> None:
    """Make the FSDP actor inside each Ray worker keep a copy of every parameter's `.grad` (full tensors, HF names)
    each time its optimizer steps (verl zeroes the gradients after the step); `worker_grads` reads rank 0's copy.
    Every rank installs it: gathering a sharded gradient (`full_tensor`) is a collective of all ranks."""
    import ray

    def install(worker_dict):
        worker, = worker_dict.worker_dict.values()    # the actor role ("actor_rollout", "_ref" with a reference)
        engine, opt = worker.actor.engine, worker.actor.engine.optimizer
        if not hasattr(opt, "_ajet_step"):
            opt._ajet_step = opt.step

            def step(*args, **kwargs):
                worker._ajet_grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                                      .detach().cpu().clone()
                                      for n, p in engine.module.named_parameters() if p.grad is not None}
                return opt._ajet_step(*args, **kwargs)

            opt.step = step
        return True

    ray.get([w.__ray_call__.remote(install) for w in backbone.trainer.actor_rollout_wg.workers])


def worker_grads(backbone) -> dict[str, torch.Tensor]:
    """The gradients the actor's optimizer last stepped with (see `capture_grads`)."""
    import ray

    def read(worker_dict):
        worker, = worker_dict.worker_dict.values()
        return worker._ajet_grads

    return ray.get(backbone.trainer.actor_rollout_wg.workers[0].__ray_call__.remote(read))


def set_micro_batch_tokens(backbone, tokens: int) -> None:
    """verl's `max_token_len_per_gpu` of the actor's engine (what `algorithm.micro_batch_tokens` sets at start)."""
    import ray

    def put(worker_dict):
        worker, = worker_dict.worker_dict.values()
        object.__setattr__(worker.actor.engine_config, "max_token_len_per_gpu", tokens)   # a frozen verl dataclass
        return True

    ray.get([w.__ray_call__.remote(put) for w in backbone.trainer.actor_rollout_wg.workers])


def main(inp: str, out: str) -> None:
    d = json.load(open(inp))
    res = {}
    by_world: dict[int, list] = {}
    for run in d["runs"]:
        by_world.setdefault((run[2] if len(run) > 2 else {}).get("world_size", 1), []).append(run)
    for world_size, runs in by_world.items():
        res.update(train(d, runs, world_size))
    torch.save(res, out)


def train(d: dict, runs: list, world_size: int) -> dict:
    """The `runs` on one backbone of `world_size` FSDP ranks, each from the initial weights."""
    import ray

    from ajet.backbones.trinity import TrinityBackbone
    from ajet.config import AjetConfig
    from ajet.tracker.sample import Sample

    samples = [Sample(**s) for s in d["samples"]]
    exp_dir = Path(d["exp_dir"]) / f"dp{world_size}"
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, trainer={"exp_dir": str(exp_dir)},
                     model={"path": d["model_dir"], "device": "cpu", "max_model_len": 1024},
                     algorithm={"lr": d["lr"], "loss_agg_mode": runs[0][0], "max_grad_norm": d["max_grad_norm"],
                                "clip_ratio_low": d["clip_ratio_low"],
                                "clip_ratio_high": d["clip_ratio_high"], "clip_ratio_c": d["clip_ratio_c"]},
                     trinity={"cluster": {"gpu_per_node": world_size}})
    bb = TrinityBackbone(cfg)
    assert len(bb.trainer.actor_rollout_wg.workers) == world_size
    init = exp_dir / "init"
    bb.save_checkpoint(init)
    capture_grads(bb)
    res = {}
    try:
        for run in runs:
            mode, tokens, *opts = run
            o = opts[0] if opts else {}
            rows = samples[:o.get("rows", len(samples))]
            bb.load_checkpoint(init)
            set_micro_batch_tokens(bb, tokens or sum(len(s.prompt_ids) + len(s.response_ids) for s in rows))
            algo = copy.deepcopy(bb.config.algorithm)        # Trinity's own way to set the loss on its workers
            algo.loss_agg_mode = mode
            algo.policy_loss_fn_args = {**algo.policy_loss_fn_args, "loss_agg_mode": mode}
            bb.trainer.actor_rollout_wg.set_trinity_config(algo_config=algo, rollout_engine_type="vllm",
                                                           ray_namespace=bb.config.ray_namespace)
            weights_0 = {k: v.detach().clone() for k, v in bb.model.state_dict().items()}
            metrics, grads, weights_1 = [], None, None
            for step in range(o.get("steps", d["steps"])):
                metrics.append(bb.update(rows))
                if step == 0:
                    grads = worker_grads(bb)
                    weights_1 = {k: v.detach().clone() for k, v in bb.model.state_dict().items()}
            res[run_key(run)] = {"grads": grads, "metrics": metrics, "weights_0": weights_0, "weights_1": weights_1,
                                 "weights": {k: v.detach().clone() for k, v in bb.model.state_dict().items()}}
    finally:
        bb.close()
    assert not ray.is_initialized()
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
