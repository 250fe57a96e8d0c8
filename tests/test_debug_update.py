"""The debug backbone's update: per-episode weighting and merged-vs-split equivalence on a real model."""

import copy

import pytest
import torch

from ajet.backbones.debug.backbone import DebugBackbone
from ajet.config import AjetConfig
from ajet.tracker.sample import Sample


@pytest.fixture(scope="module")
def backbone(tiny_model_dir):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu"},
                     algorithm={"micro_batch_tokens": 64})
    bb = DebugBackbone(cfg)
    yield bb
    bb.close()


def _grads(bb, samples):
    bb.model.zero_grad(set_to_none=True)
    stats = bb.accumulate_gradients(samples)
    g = torch.cat([p.grad.flatten() for p in bb.model.parameters() if p.grad is not None]).clone()
    bb.model.zero_grad(set_to_none=True)
    return g, stats


def _sample(ep, prompt, response, mask, adv, old=None):
    return Sample(episode_id=ep, group_id="g", agent_tag="default", call_ids=["c"], prompt_ids=prompt,
                  response_ids=response, loss_mask=mask, old_logprobs=old or [-1.0] * len(response),
                  policy_versions=[0] * len(response), advantage=adv)


def _on_policy(bb, samples):
    from ajet.backbones.debug.backbone import _collate, token_logprobs

    batch = _collate(samples, [1.0] * len(samples), bb.tokenizer.pad_token_id, bb.device)
    with torch.no_grad():
        lp, _ = token_logprobs(bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"])
    for i, s in enumerate(samples):
        P = len(s.prompt_ids)
        s.old_logprobs = [x if m else 0.0 for x, m in zip(lp[i, P:P + len(s.response_ids)].tolist(), s.loss_mask)]


def test_an_episode_split_into_three_samples_gives_the_merged_gradient(backbone):
    torch.manual_seed(0)
    prompt = torch.randint(3, 200, (12,)).tolist()
    c1, tool1, c2, tool2, c3 = (torch.randint(3, 200, (n,)).tolist() for n in (5, 7, 4, 6, 3))
    merged = _sample("e1", prompt, c1 + tool1 + c2 + tool2 + c3,
                     [1] * 5 + [0] * 7 + [1] * 4 + [0] * 6 + [1] * 3, adv=1.0)
    # the same tokens as three prefix-growing samples, each training only its own completion
    split = [
        _sample("e1", prompt, c1, [1] * 5, 1.0),
        _sample("e1", prompt + c1 + tool1, c2, [1] * 4, 1.0),
        _sample("e1", prompt + c1 + tool1 + c2 + tool2, c3, [1] * 3, 1.0),
    ]
    # the first call sampled at T=0.7, the next two at T=1.2 (per-token temperatures, as the tracker records)
    merged.temperatures = [0.7] * 5 + [1.2] * 20
    split[0].temperatures, split[1].temperatures, split[2].temperatures = [0.7] * 5, [1.2] * 4, [1.2] * 3
    other = _sample("e2", prompt, c3 + c1, [1] * 8, adv=-0.5)
    # on-policy old logprobs (what the engine recorded): ratio 1, so no token is clipped away
    _on_policy(backbone, [merged, other] + split)
    assert merged.old_logprobs[-3:] == pytest.approx(split[2].old_logprobs, abs=1e-5)

    g_merged, st_merged = _grads(backbone, [merged, other])
    g_split, st_split = _grads(backbone, split + [copy.deepcopy(other)])
    assert g_merged.abs().sum() > 0 and st_merged["clip_frac"] == 0
    g_other, _ = _grads(backbone, [other])
    assert (g_merged - g_other / 2).abs().sum() > 0.1 * g_merged.abs().sum()   # e1 counts, not only e2
    torch.testing.assert_close(g_split, g_merged, rtol=1e-4, atol=1e-6)
    assert st_split["pg_loss"] == pytest.approx(st_merged["pg_loss"], rel=1e-5)


def test_every_episode_weighs_the_same_regardless_of_length(backbone):
    torch.manual_seed(1)
    prompt = torch.randint(3, 200, (6,)).tolist()
    short = _sample("a", prompt, torch.randint(3, 200, (2,)).tolist(), [1, 1], adv=1.0)
    long = _sample("b", prompt, torch.randint(3, 200, (20,)).tolist(), [1] * 20, adv=1.0)
    g_short, _ = _grads(backbone, [short])
    g_long, _ = _grads(backbone, [long])
    g_both, _ = _grads(backbone, [short, long])
    # mean over episodes of per-episode token means: the 2-token episode counts as much as the 20-token one
    torch.testing.assert_close(g_both, (g_short + g_long) / 2, rtol=1e-4, atol=1e-6)


def test_update_changes_weights_and_bumps_policy_version(backbone):
    before = {k: v.clone() for k, v in backbone.model.state_dict().items()}
    v0 = backbone.engine.policy_version
    s = _sample("a", [5, 6, 7], [8, 9, 10], [1, 1, 1], adv=1.0)
    flat = _sample("b", [5, 6, 7], [11, 12], [1, 1], adv=0.0)   # zero advantage: skipped, still counted
    stats = backbone.update([s, flat])
    assert backbone.engine.policy_version == v0 + 1 and stats["optimizer_steps"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in backbone.model.state_dict().items())
    assert backbone.update([flat])["grad_norm"] == 0.0


def test_per_token_logprobs_of_merged_and_per_call_samples_agree(backbone):
    """One forward over the merged sequence, each call's tokens at that call's temperature, equals a forward
    of each call's own sequence at its own temperature (what the engine computed when it sampled)."""
    from ajet.backbones.debug.backbone import token_logprobs

    torch.manual_seed(2)
    prompt, c1, tool, c2 = (torch.randint(3, 200, (n,)).tolist() for n in (10, 6, 5, 4))
    t1, t2 = 0.4, 1.3
    n1, n2 = len(prompt), len(prompt + c1 + tool)

    def lp(ids, temps):
        t = torch.tensor([ids])
        with torch.no_grad():
            return token_logprobs(backbone.model, t, torch.ones_like(t), torch.tensor([temps]))[0][0]

    merged = lp(prompt + c1 + tool + c2, [1.0] * n1 + [t1] * 6 + [1.0] * 5 + [t2] * 4)
    call1 = lp(prompt + c1, [t1] * (n1 + 6))
    call2 = lp(prompt + c1 + tool + c2, [t2] * (n2 + 4))
    torch.testing.assert_close(merged[n1:n1 + 6], call1[n1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(merged[n2:], call2[n2:], rtol=0, atol=1e-5)
    assert (call1[n1:] - lp(prompt + c1, [t2] * (n1 + 6))[n1:]).abs().max() > 1e-2   # temperature matters here


# ---- asynchronous training: the importance-sampling metrics and the pre-update pass --------------------------
# Per-token pi_prox / pi_behaviour of two equal-length episodes (so the loss-weighted mean is the token mean).
# Episode a: 1, 0.5, 1.5, 1.5 (nothing capped); episode b: 3, 2.5, 1.5, 2.5, capped at 2 -> 2, 2, 1.5, 2.
# Mean IS weight (4.5 + 7.5) / 8 = 1.5; capped tokens 3 of 8 = 0.375 (both by hand).
IS_RATIOS = {"a": [1.0, 0.5, 1.5, 1.5], "b": [3.0, 2.5, 1.5, 2.5]}


def _async_backbone(tiny_model_dir, **algorithm):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu"},
                     algorithm={"micro_batch_tokens": 64, **algorithm},
                     trainer={"async": {"max_staleness": 2, "is_cap": 2.0}})
    return DebugBackbone(cfg)


def _stale_by(bb, ratios):
    """One sample per episode whose behaviour logprobs are today's policy's minus log(ratio) per token, so
    that pi_prox / pi_behaviour of token t is exactly ratios[episode][t] when the update starts."""
    import math

    torch.manual_seed(3)
    prompt = torch.randint(3, 200, (6,)).tolist()
    samples = [_sample(ep, prompt, torch.randint(3, 200, (len(r),)).tolist(), [1] * len(r), adv)
               for (ep, r), adv in zip(ratios.items(), (1.0, -1.0))]
    _on_policy(bb, samples)
    for s in samples:
        s.old_logprobs = [lp - math.log(r) for lp, r in zip(s.old_logprobs, ratios[s.episode_id])]
    return samples


@pytest.mark.parametrize("steps", [{}, {"ppo_epochs": 2}, {"mini_batches": 2}],
                         ids=["one-step", "2-epochs", "2-mini-batches"])
def test_is_weight_mean_and_capped_frac_are_means_over_the_trained_tokens(tiny_model_dir, steps):
    """The figures of the update's IS weights are their (loss-weighted) mean and the capped share: 1.5 and
    0.375 by hand. With several optimizer steps per update (a large learning rate moves the weights between
    them), pi_prox is the pass before the first step, so every step uses the same weights and the figures
    do not move; a pi_prox taken from the weights of the current step would change them."""
    bb = _async_backbone(tiny_model_dir, lr=5e-2, **steps)
    try:
        out = bb.update(_stale_by(bb, IS_RATIOS))
    finally:
        bb.close()
    assert out["optimizer_steps"] == (1.0 if not steps else 2.0)
    assert out["is_weight_mean"] == pytest.approx(1.5, abs=1e-4)
    assert out["is_capped_frac"] == pytest.approx(0.375, abs=1e-6)


def test_an_update_frees_the_prefix_cache_it_makes_stale_and_only_such_an_update(backbone):
    import asyncio

    from ajet.llm_call import SamplingParams

    async def generate():
        return await backbone.engine.generate([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=3))

    asyncio.run(generate())
    cache = backbone.engine.prefix_cache
    assert len(cache) > 0 and cache.nbytes > 0
    held = len(cache)
    assert backbone.update([_sample("c", [5, 6], [7], [0], adv=1.0)]) == {"update_s": 0.0, "optimizer_steps": 0.0}
    assert len(cache) == held                       # no loss token: nothing trained, the entries stay valid
    v0 = backbone.engine.policy_version
    backbone.update([_sample("d", [5, 6, 7], [8, 9], [1, 1], adv=1.0)])
    assert backbone.engine.policy_version == v0 + 1
    assert len(cache) == 0 and cache.nbytes == 0    # every entry was the old weights': freed before training


def test_an_epochs_episodes_are_dealt_round_robin_into_mini_batches():
    """`algorithm.mini_batches` n: episode i goes to mini-batch i mod k, k = n capped by the episode count."""
    from ajet.algorithm.batching import split_mini_batches

    assert split_mini_batches(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    assert split_mini_batches(["a", "b"], 4) == [["a"], ["b"]]              # never an empty mini-batch
    assert split_mini_batches(["a", "b", "c"], 1) == [["a", "b", "c"]]
    assert split_mini_batches([], 3) == [[]]
