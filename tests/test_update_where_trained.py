"""Update only where trained: the LM head, the processed log-softmax and the entropy run only at the loss
tokens, and give the same loss, gradients and metrics as the full computation at every position."""

import pytest
import torch

from ajet.backbones.debug import backbone as backbone_module
from ajet.backbones.debug.backbone import DebugBackbone, _collate, token_logprobs
from ajet.config import AjetConfig
from ajet.tracker.sample import Sample
from tests.full_token_logprobs import full_token_logprobs


def _backbone(model_dir, **algorithm):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": model_dir, "device": "cpu"},
                     algorithm={"micro_batch_tokens": 96, **algorithm})
    return DebugBackbone(cfg)


def _episodes(bb, nucleus=True):
    """GRPO groups of episodes with tool-result gaps (loss mask 0 inside the response), per-call
    temperatures and nuclei (one call greedy, trained at T = 1), and old logprobs near the current
    policy's (so some ratios clip and some do not). nucleus=False: top_p 1 everywhere (with a KL term a
    token outside the nucleus of both the policy and the reference is a NaN in `ppo_clip_loss`'s k3)."""
    g = torch.Generator().manual_seed(0)
    V = bb.model.config.vocab_size
    ints = lambda n: torch.randint(3, V, (n,), generator=g).tolist()   # noqa: E731
    samples = []
    for task, plen in (("t0", 17), ("t1", 9), ("t2", 23)):
        prompt = ints(plen)
        for k in range(3):
            c1, tool, c2 = ints(4 + k), ints(5 + 2 * k), ints(3 + (k * 2) % 5)
            (t1, p1), (t2, p2) = [((0.6, 1.0), (1.0, 0.8)), ((1.3, 0.9), (0.0, 1.0)), ((0.8, 0.7), (1.5, 1.0))][k]
            s = Sample(episode_id=f"{task}-{k}", group_id=task, agent_tag="default", call_ids=["a", "b"],
                       prompt_ids=prompt, response_ids=c1 + tool + c2,
                       loss_mask=[1] * len(c1) + [0] * len(tool) + [1] * len(c2),
                       old_logprobs=[0.0] * (len(c1) + len(tool) + len(c2)),
                       policy_versions=[0] * (len(c1) + len(tool) + len(c2)), advantage=[1.0, -0.7, 0.4][k])
            s.temperatures = [t1] * len(c1) + [1.0] * len(tool) + [t2] * len(c2)
            s.top_ps = [p1] * len(c1) + [1.0] * len(tool) + [p2] * len(c2) if nucleus else [1.0] * len(s.loss_mask)
            samples.append(s)
    batch = _collate(samples, [1.0] * len(samples), bb.tokenizer.pad_token_id, bb.device)
    with torch.no_grad():
        lp, _ = full_token_logprobs(bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"],
                                    batch["top_ps"])
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        noise = 0.3 * torch.randn(R, generator=g)
        # a token outside its nucleus (-inf now) was sampled under other weights: finite old logprob
        s.old_logprobs = [(float(x) if x > -1e9 else -5.0) + float(e) if m else 0.0
                          for x, e, m in zip(lp[i, P:P + R], noise, s.loss_mask)]
    return samples


def _grads_and_stats(bb, samples):
    bb.model.zero_grad(set_to_none=True)
    stats = bb.accumulate_gradients(samples)
    grads = {n: p.grad.clone() for n, p in bb.model.named_parameters() if p.grad is not None}
    bb.model.zero_grad(set_to_none=True)
    return grads, stats


@pytest.mark.parametrize("algorithm", [{}, {"kl_coef": 0.1, "loss_agg_mode": "token-mean"}],
                         ids=["seq-mean-token-mean", "token-mean+kl"])
def test_loss_gradients_and_metrics_equal_the_full_vocabulary_computation(tiny_model_dir, monkeypatch, algorithm):
    bb = _backbone(tiny_model_dir, **algorithm)
    bb.share_prefixes = False      # the rows the full computation runs (packing: tests/test_shared_prefix.py)
    try:
        samples = _episodes(bb, nucleus="kl_coef" not in algorithm)
        if bb.ref_model is not None:       # a reference policy that differs from the current one: KL > 0
            with torch.no_grad():
                for p in bb.ref_model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        g_new, st_new = _grads_and_stats(bb, samples)
        m_new = bb.measure(samples)
        with monkeypatch.context() as mp:
            mp.setattr(backbone_module, "token_logprobs", full_token_logprobs)
            g_old, st_old = _grads_and_stats(bb, samples)
            m_old = bb.measure(samples)
    finally:
        bb.close()
    # the case is not trivial: several micro-batches, clipped tokens, tokens outside their nucleus
    assert st_old["_tokens"] == sum(s.num_loss_tokens for s in samples) and 0 < st_old["clip_frac"]
    assert st_old["clip_frac"] < st_old["weight_sum"]
    assert algorithm.get("kl_coef", 0) == 0 or st_old["kl"] > 0
    assert set(g_new) == set(g_old) and len(g_old) == len(list(bb.model.parameters()))
    for name in g_old:
        torch.testing.assert_close(g_new[name], g_old[name], rtol=1e-4, atol=1e-7, msg=name)
    for k, v in st_old.items():
        assert st_new[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for k in ("entropy", "logprob_diff"):
        assert m_new[k] == pytest.approx(m_old[k], rel=1e-5, abs=1e-6), k


def test_scored_logprobs_and_entropy_equal_the_full_computation_at_loss_tokens_and_are_0_elsewhere(tiny_model_dir):
    bb = _backbone(tiny_model_dir)
    try:
        samples = _episodes(bb)
        batch = _collate(samples, [1.0] * len(samples), bb.tokenizer.pad_token_id, bb.device)
        args = (bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"], batch["top_ps"])
        with torch.no_grad():
            lp_full, ent_full = full_token_logprobs(*args, with_entropy=True)
            lp, ent = token_logprobs(*args, with_entropy=True, score_mask=batch["loss_mask"])
            lp_all, ent_all = token_logprobs(*args, with_entropy=True)             # no mask: every token
    finally:
        bb.close()
    m = batch["loss_mask"].bool()
    assert m.sum() > 0 and bool(torch.isinf(lp_full[m]).any()) and bool(torch.isfinite(lp_full[m]).any())
    torch.testing.assert_close(lp[m], lp_full[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[m], ent_full[m], rtol=1e-5, atol=1e-5)
    assert bool((lp[~m] == 0).all()) and bool((ent[~m] == 0).all())
    torch.testing.assert_close(lp_all, lp_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_all, ent_full, rtol=1e-5, atol=1e-5)
