"""Runs INSIDE the Trinity environment (.venvs/trinity): ajet's recorded samples -> Trinity `Experience`s ->
Trinity's own batch stacking (`gather_*`) and PPO policy loss (`PPOPolicyLossFn`), for each mode.

    .venvs/trinity/bin/python tests/backbone_conformance/trinity_check.py IN.json OUT.json
"""

from __future__ import annotations

import json
import sys

import torch


def main(inp: str, out: str) -> None:
    import trinity
    from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN
    from trinity.common.experience import (gather_action_masks, gather_attention_masks, gather_response_attrs,
                                           gather_token_ids)

    from ajet.backbones.trinity.data import to_experiences
    from ajet.tracker.sample import Sample

    d = json.load(open(inp))
    exps = to_experiences([Sample(**s) for s in d["samples"]])
    P = max(e.prompt_length for e in exps)
    R = max(len(e.tokens) - e.prompt_length for e in exps)
    tensors = {
        "input_ids": gather_token_ids(exps, P, R, d["pad_id"]).long(),
        "attention_mask": gather_attention_masks(exps, P, R).long(),
        "response_mask": gather_action_masks(exps, R).long(),
        "old_log_probs": gather_response_attrs(exps, "logprobs", R),
        "advantages": gather_response_attrs(exps, "advantages", R),
    }
    res = {"trinity_version": trinity.__version__, "tensors": {k: v.tolist() for k, v in tensors.items()},
           "rewards": [e.reward for e in exps], "runs": [e.eid.run for e in exps], "loss": {}}
    # the loss in float64 on both sides, so that 1e-6 measures the formulas, not float32 rounding
    mask, old, adv = tensors["response_mask"], tensors["old_log_probs"].double(), tensors["advantages"].double()
    for name, lps in d["logprob_sets"].items():
        log_prob = torch.zeros((len(exps), R), dtype=torch.float64)
        for i, lp in enumerate(lps):
            log_prob[i, :len(lp)] = torch.tensor(lp)
        for mode in d["modes"]:
            fn = POLICY_LOSS_FN.get("ppo")(clip_range_low=d["clip_ratio_low"], clip_range_high=d["clip_ratio_high"],
                                          clip_ratio_c=d["clip_ratio_c"], loss_agg_mode=mode)
            loss, _ = fn(logprob=log_prob, old_logprob=old, action_mask=mask, advantages=adv)
            res["loss"][f"{name}/{mode}"] = float(loss)
    json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
