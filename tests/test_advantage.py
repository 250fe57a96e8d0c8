"""Advantage estimators on hand-computed examples (each expected value computed by hand, not by the code)."""

import pytest
import torch

from ajet.algorithm.advantage import grpo_advantages


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
