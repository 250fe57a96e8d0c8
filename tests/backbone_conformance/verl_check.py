"""Runs INSIDE the verl environment (.venvs/verl): ajet's recorded samples -> verl's DataProto, and verl's own
policy loss (`compute_policy_loss_vanilla`) and loss aggregation (`agg_loss`) on them, for each mode.

    .venvs/verl/bin/python tests/backbone_conformance/verl_check.py IN.json OUT.json

IN.json (from record.py + the test): pad_id, samples, logprob_sets ({name: current-policy logprobs per response
token of each sample}), modes, clip_ratio_low/high/c, loss_scale_factor. OUT.json: the DataProto's tensors (as
lists), verl's helper results, verl's policy loss per logprob set and mode, and verl's agg_loss per mode.
"""

from __future__ import annotations

import json
import sys

import torch


def main(inp: str, out: str) -> None:
    import verl
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos
    from verl.utils.model import compute_position_id_with_mask

    from ajet.backbones.verl.data import to_data_proto
    from ajet.tracker.sample import Sample

    d = json.load(open(inp))
    samples = [Sample(**s) for s in d["samples"]]
    proto = to_data_proto(samples, d["pad_id"])
    b = proto.batch
    B, R = b["responses"].shape
    mask = b["response_mask"]
    # losses in float64 on both sides, so that 1e-6 measures the formulas, not float32 rounding
    old, adv = b["old_log_probs"].double(), b["advantages"].double()
    loss_mat = torch.sin(torch.arange(B * R, dtype=torch.float64).reshape(B, R)) + 0.5   # any fixed [B, R]
    res = {"verl_version": verl.__version__, "batch_keys": sorted(b.keys()), "len": len(proto),
           "tensors": {k: b[k].tolist() for k in b.keys()},
           "uid": proto.non_tensor_batch["uid"].tolist(), "temperature": proto.meta_info["temperature"],
           "verl_position_ids": compute_position_id_with_mask(b["attention_mask"]).tolist(), "loss": {}, "agg": {}}
    policy_loss = core_algos.get_policy_loss_fn("vanilla")
    for mode in d["modes"]:
        res["agg"][mode] = float(_agg(core_algos.agg_loss, loss_mat, mask, mode, d["loss_scale_factor"], B))
    for (name, lps), mode in [(item, m) for item in d["logprob_sets"].items() for m in d["modes"]]:
        log_prob = torch.zeros((B, R), dtype=torch.float64)
        for i, lp in enumerate(lps):
            log_prob[i, :len(lp)] = torch.tensor(lp)
        cfg = OmegaConf.create({
            "clip_ratio": 0.2, "clip_ratio_low": d["clip_ratio_low"], "clip_ratio_high": d["clip_ratio_high"],
            "clip_ratio_c": d["clip_ratio_c"], "loss_agg_mode": mode, "loss_scale_factor": d["loss_scale_factor"],
            "policy_loss": {"loss_mode": "vanilla"},
            # what verl's ppo_loss (verl/workers/utils/losses.py) fills in before calling the policy loss
            "global_batch_info": {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": B,
                                  "loss_scale_factor": d["loss_scale_factor"]},
        })
        loss, _ = policy_loss(old_log_prob=old, log_prob=log_prob, advantages=adv,
                              response_mask=mask, loss_agg_mode=mode, config=cfg)
        res["loss"][f"{name}/{mode}"] = float(loss)
    json.dump(res, open(out, "w"))


def _agg(agg_loss, loss_mat, mask, mode, loss_scale_factor, batch_size):
    """verl's agg_loss at one data-parallel rank, with the whole batch as the global batch."""
    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, dp_size=1,
                    batch_num_tokens=int(mask.sum()), global_batch_size=batch_size,
                    loss_scale_factor=loss_scale_factor)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
