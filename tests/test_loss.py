"""Per-episode weighting, loss aggregation and the PPO-clip loss on hand-computed examples."""

import math

import pytest
import torch

from ajet.algorithm.loss import (LOSS_AGG_MODES, agg_loss, distill_loss, episode_token_weights, loss_token_weights,
                                 ppo_clip_loss)


def test_episode_weights_make_every_episode_count_once():
    # episode x: 2 samples with 3 + 1 loss tokens; episode y: one sample with 10 tokens
    w = episode_token_weights(["x", "x", "y"], [3, 1, 10])
    assert w == pytest.approx([1 / 8, 1 / 8, 1 / 20])
    total_per_episode = {"x": 3 * w[0] + 1 * w[1], "y": 10 * w[2]}
    assert total_per_episode == pytest.approx({"x": 0.5, "y": 0.5})
    assert episode_token_weights(["x"], [0]) == [0.0]


def test_ppo_clip_loss_hand_computed():
    logp = torch.log(torch.tensor([[0.5, 0.6]]))
    old = torch.log(torch.tensor([[0.5, 0.4]]))      # ratios 1.0 and 1.5
    w = torch.tensor([[0.5, 0.5]])
    # A = +1: -min(r, clip(r)) per token -> [-1, -1.2]; weighted sum -1.1
    loss, stats = ppo_clip_loss(logp, old, torch.ones(1, 2), w, 0.2, 0.2)
    assert float(loss) == pytest.approx(-1.1)
    assert stats["clip_frac"] == pytest.approx(0.5)
    # A = -1: the pessimistic bound keeps the unclipped 1.5 -> [1, 1.5]; weighted sum 1.25
    loss, stats = ppo_clip_loss(logp, old, -torch.ones(1, 2), w, 0.2, 0.2)
    assert float(loss) == pytest.approx(1.25)
    assert stats["clip_frac"] == pytest.approx(0.0)
    # clip-higher: with clip_high 0.6 the 1.5 ratio is inside the range for A = +1 -> [-1, -1.5]
    loss, _ = ppo_clip_loss(logp, old, torch.ones(1, 2), w, 0.2, 0.6)
    assert float(loss) == pytest.approx(-1.25)


def test_ppo_loss_gradient_and_kl():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    old = logp.detach().clone()
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    w = torch.tensor([[1.0, 0.0]])                   # second token is masked out
    loss, stats = ppo_clip_loss(logp, old, torch.full((1, 2), 2.0), w, 0.2, 0.2, ref, kl_coef=0.1)
    # kl k3 on token 0: d = log(.25/.5) -> exp(d) - d - 1 = 0.5 + ln2 - 1
    assert stats["kl"] == pytest.approx(0.5 + math.log(2) - 1, rel=1e-5)
    loss.backward()
    # d/dlogp of -A*ratio at ratio 1 is -A = -2; KL grad: 0.1 * (1 - exp(d)) = 0.1 * 0.5
    assert logp.grad[0, 0].item() == pytest.approx(-2 + 0.05, rel=1e-5)
    assert logp.grad[0, 1].item() == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_clip_loss(logp, old, torch.ones(1, 2), w, kl_coef=0.1)


# ---- loss aggregation (verl's agg_loss names and definitions) -------------------------------------------
def test_agg_loss_leaves_fully_masked_rows_out_of_the_sequence_count():
    """By hand: rows [1, 2] (both counted), a fully masked row, [3, x] (x masked). verl 0.9.1's agg_loss counts
    only the rows with a loss token in the seq-mean modes (tests/test_backbone_conformance.py runs verl's own)."""
    loss_mat = torch.tensor([[1.0, 2.0], [7.0, 9.0], [3.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    want = {"token-mean": 6 / 3,                         # (1 + 2 + 3) / 3 tokens
            "seq-mean-token-mean": (1.5 + 3) / 2,        # 2 rows with tokens, not 3
            "seq-mean-token-sum": (3 + 3) / 2,
            "seq-mean-token-sum-norm": (3 + 3) / 2 / 2}  # C = the padded width, 2
    for mode in LOSS_AGG_MODES:
        assert float(agg_loss(loss_mat, mask, mode)) == pytest.approx(want[mode]), mode
    assert float(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", 4.0)) == pytest.approx(6 / 2 / 4)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_positions_never_leak_into_agg_loss(mode):
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(5, 9, generator=g)
    mask = (torch.rand(5, 9, generator=g) > 0.4).float()
    mask[2] = 0                                        # a fully masked row
    poisoned = loss_mat.masked_fill(mask == 0, float("inf"))
    poisoned[2, 3] = float("nan")
    assert float(agg_loss(poisoned, mask, mode)) == pytest.approx(float(agg_loss(loss_mat, mask, mode)), abs=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_token_weights_give_agg_loss_whatever_the_micro_batches(mode):
    g = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    # per-row sequences: the weights reproduce verl's agg_loss as a plain weighted sum
    w = loss_token_weights(list(range(4)), mask.sum(-1).int().tolist(), mode, max_response_len=7)
    weighted = sum(float((loss_mat[i] * mask[i]).sum()) * w[i] for i in range(4))
    assert weighted == pytest.approx(float(agg_loss(loss_mat, mask, mode)), abs=1e-6)
    # one episode split into two samples (rows 0 and 1) weighs as that episode concatenated into one row
    w_ep = loss_token_weights(["a", "a", "b", "c"], mask.sum(-1).int().tolist(), mode, 7.0)
    merged_mat = torch.stack([torch.cat([loss_mat[0], loss_mat[1]]), torch.cat([loss_mat[2], torch.zeros(7)]),
                              torch.cat([loss_mat[3], torch.zeros(7)])])
    merged_mask = torch.stack([torch.cat([mask[0], mask[1]]), torch.cat([mask[2], torch.zeros(7)]),
                               torch.cat([mask[3], torch.zeros(7)])])
    weighted_ep = sum(float((loss_mat[i] * mask[i]).sum()) * w_ep[i] for i in range(4))
    assert weighted_ep == pytest.approx(float(agg_loss(merged_mat, merged_mask, mode, 7.0)), abs=1e-6)


def test_loss_agg_mode_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="not one of"):
        loss_token_weights(["a"], [3], "seq-mean")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        loss_token_weights(["a"], [3], "seq-mean-token-sum-norm")


# ---- numerical guards ------------------------------------------------------------------------------------
def test_weight_zero_positions_never_give_nan():
    logp = torch.tensor([[-0.5, float("-inf"), float("nan")]], requires_grad=True)   # -inf: outside the nucleus
    old = torch.tensor([[-0.5, -1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.4, -1.0, float("nan")]])
    loss, stats = ppo_clip_loss(logp, old, torch.ones(1, 3), w, ref_logprobs=ref, kl_coef=0.1, clip_ratio_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1:].abs().sum() == 0


def test_a_trained_token_outside_both_nuclei_gives_a_finite_kl():
    """With top_p < 1 the current and the reference policy can both give a sampled token -inf (it fell out
    of both nuclei after an update): -inf - (-inf) is NaN, which must not reach the loss or the gradient.
    Both policies giving it no mass is no divergence (k3 = 0); one giving it none is the clamped bound."""
    logp = torch.tensor([[float("-inf"), float("-inf"), -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -0.5]])
    ref = torch.tensor([[float("-inf"), -0.5, float("-inf")]])
    w = torch.full((1, 3), 1 / 3)
    loss, stats = ppo_clip_loss(logp, old, torch.ones(1, 3), w, ref_logprobs=ref, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
    assert torch.isfinite(logp.grad).all()
    # k3: token 0 both -inf -> 0; token 1 d = +20 clamped -> 10; token 2 d = -20 -> e^-20 + 19 -> 10
    assert stats["kl"] == pytest.approx((0.0 + 10.0 + 10.0) / 3)


def test_log_ratio_and_kl_are_clamped_as_in_verl():
    logp = torch.tensor([[50.0, -100.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    w = torch.tensor([[0.5, 0.5]])
    # A = +1, ratio exp(50) -> clamped exp(20), then PPO-clipped to 1.2; ratio exp(-100) -> exp(-20)
    _, stats = ppo_clip_loss(logp, old, torch.ones(1, 2), w)
    assert stats["ratio_mean"] == pytest.approx(0.5 * math.exp(20) + 0.5 * math.exp(-20))
    # k3 with log(ref / pi) = -50 - ... is clamped to 10 per token
    ref = torch.tensor([[0.0, 0.0]])
    _, stats = ppo_clip_loss(logp, old, torch.zeros(1, 2), w, ref_logprobs=ref, kl_coef=1.0)
    assert stats["kl"] == pytest.approx(10.0)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp = torch.log(torch.tensor([[5.0, 5.0]]))
    old = torch.zeros(1, 2)                          # ratio 5 on both tokens
    w = torch.tensor([[0.5, 0.5]])
    adv = torch.tensor([[-1.0, 1.0]])
    # A = -1: PPO-clip keeps 5 (pessimistic), dual-clip caps it at 3; A = +1: clipped to 1.2, untouched
    loss, stats = ppo_clip_loss(logp, old, adv, w, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx(0.5 * 3.0 - 0.5 * 1.2)
    assert stats["dual_clip_frac"] == pytest.approx(0.5)
    loss, _ = ppo_clip_loss(logp, old, adv, w, clip_ratio_c=None)
    assert float(loss) == pytest.approx(0.5 * 5.0 - 0.5 * 1.2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(logp, old, adv, w, clip_ratio_c=0.5)


# ---- on-policy distillation ------------------------------------------------------------------------------
def test_distill_loss_is_the_sampled_token_reverse_kl_as_a_policy_gradient():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, float("-inf")]])      # token 2: outside the teacher's nucleus
    logp = old.clone().requires_grad_(True)                    # fresh data: ratio 1
    w = torch.tensor([[0.5, 0.25, 0.25]])
    loss, kl = distill_loss(logp, old, teacher, w)
    # kl_t = old - teacher = [0.5, -1.0, (no term)]; loss = 0.5 * 0.5 + 0.25 * -1.0 = 0
    assert kl == pytest.approx(0.5 * 0.5 - 0.25 * 1.0) and float(loss) == pytest.approx(0.0)
    loss.backward()
    # d loss / d log pi_theta = w_t kl_t (r_t = 1): push down where the teacher finds the token less likely
    assert logp.grad[0].tolist() == pytest.approx([0.25, -0.25, 0.0])


def test_distill_config_is_refused_by_a_backbone_that_cannot_run_it():
    from ajet.backbones.capabilities import check_supported
    from ajet.config import AjetConfig
    from ajet.errors import ConfigError

    base = dict(workflow="x:y", data={"train_path": "x"}, model={"path": "m"}, algorithm={"distill": {"teacher": "t"}})
    assert AjetConfig(**base).algorithm.distill.mode == "add"
    check_supported(AjetConfig(**base))
    with pytest.raises(ConfigError, match=r"^algorithm\.distill=.*the verl backbone honours it only when unset: "
                                          r"on-policy distillation .*; honoured by debug"):
        check_supported(AjetConfig(**base, backbone="verl"))
