"""The trainer's logprob computation before "update only where trained", kept as the reference it is
checked against (tests) and timed against (benchmarks/update_where_trained.py)."""

import torch

from ajet.sampling_dist import entropy, processed_logprobs


def full_token_logprobs(model, input_ids, attention_mask, temperatures, top_ps=None, with_entropy=False,
                        score_mask=None, share_prefixes=None):
    """`token_logprobs` computed the old way: `model(...).logits` and the processed log-softmax over the full
    vocabulary at EVERY position (prompt, tool results and padding included), one row per sequence;
    score_mask and share_prefixes are ignored.
    Shapes and returns as `ajet.backbones.debug.backbone.token_logprobs` with score_mask=None."""
    B, S = input_ids.shape
    temps = temperatures.expand(B, S)[:, 1:]
    temps = torch.where(temps > 0, temps, torch.ones_like(temps))
    tops = None if top_ps is None else top_ps.expand(B, S)[:, 1:]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, S, V]
    logp_all = processed_logprobs(logits[:, :-1, :], temps, tops)                               # [B, S-1, V]
    lp = torch.nn.functional.pad(logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = torch.nn.functional.pad(entropy(logp_all), (1, 0))
    return lp, ent
