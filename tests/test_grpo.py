"""GRPO advantages, per-episode weighting and the PPO-clip loss on hand-computed examples."""

import math

import pytest
import torch

from ajet.grpo import episode_token_weights, grpo_advantages, ppo_clip_loss


def test_advantages_normalised_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 7.0])
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # group a: mean 0.25, unbiased std 0.5 -> (1-.25)/.5 = 1.5, (0-.25)/.5 = -0.5
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert adv[4:6].tolist() == [0.0, 0.0]          # uniform rewards: no signal, and no 0/0
    assert adv[6].item() == 0.0                       # a group of one has no baseline


def test_uniform_group_gives_zero_not_nan_and_dr_grpo_skips_std():
    adv = grpo_advantages(torch.tensor([2.0, 2.0]), ["g", "g"], eps=1e-6)
    assert torch.isfinite(adv).all() and adv.abs().max() == 0
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), ["g"] * 4, norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_advantages_reject_shape_mismatch():
    with pytest.raises(ValueError, match="num_episodes"):
        grpo_advantages(torch.tensor([1.0, 2.0]), ["a"])


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
