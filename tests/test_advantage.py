"""Advantage estimators on hand-computed examples (each expected value computed by hand, not by the code)."""

import pytest
import torch

from ajet.algorithm.advantage import ADV_ESTIMATORS, assign_advantages, compute_advantages, grpo_advantages


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


# ---- RLOO, REINFORCE++ and its baseline variant (verl's definitions; every expected number by hand) --------
def test_rloo_subtracts_the_mean_of_the_other_episodes_and_keeps_a_lone_reward():
    adv = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0]), ["g"] * 4 + ["h"])
    # A_0 = 1 - (0+0+1)/3, A_1 = 0 - (1+0+1)/3 ...; the lone episode of "h" keeps r (verl: no baseline)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0])


def test_reinforce_plus_plus_whitens_over_the_batch_tokens():
    # rewards 1, 0, 0 with 1, 1, 2 loss tokens: token values [1, 0, 0, 0]: mean 1/4,
    # unbiased var ((3/4)^2 + 3 (1/4)^2) / 3 = 1/4, std 1/2
    adv = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0, 0.0]), ["a", "b", "c"],
                             torch.tensor([1.0, 1.0, 2.0]))
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5], abs=1e-6)
    # groups play no part: the same rewards in one group give the same advantages
    same = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3,
                              torch.tensor([1.0, 1.0, 2.0]))
    assert same.tolist() == pytest.approx(adv.tolist())


def test_reinforce_plus_plus_baseline_centres_each_group_then_whitens_the_batch():
    # g: [1, 0] -> [0.5, -0.5]; h: [2, 2] -> [0, 0]; one token each: mean 0, var (0.25 + 0.25) / 3 = 1/6
    adv = compute_advantages("reinforce_plus_plus_baseline", torch.tensor([1.0, 0.0, 2.0, 2.0]),
                             ["g", "g", "h", "h"], torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert adv.tolist() == pytest.approx([0.5 * 6 ** 0.5, -0.5 * 6 ** 0.5, 0.0, 0.0], abs=1e-6)
    # a lone episode has baseline 0: [1, 0] -> [0.5, -0.5], lone 4 stays 4; mean 4/3,
    # var ((5/6)^2 + (11/6)^2 + (8/3)^2) / 2 = 201/36
    adv = compute_advantages("reinforce_plus_plus_baseline", torch.tensor([1.0, 0.0, 4.0]), ["a", "a", "s"],
                             torch.tensor([1.0, 1.0, 1.0]))
    std = (201 / 36) ** 0.5
    assert adv.tolist() == pytest.approx([(0.5 - 4 / 3) / std, (-0.5 - 4 / 3) / std, (4 - 4 / 3) / std], abs=1e-6)


def test_estimators_reject_unknown_names_and_mismatched_lengths():
    with pytest.raises(ValueError, match="adv_estimator 'ppo' is not one of"):
        compute_advantages("ppo", torch.tensor([1.0]), ["g"])
    for name in ADV_ESTIMATORS:
        with pytest.raises(ValueError, match="must be"):
            compute_advantages(name, torch.tensor([1.0, 2.0]), ["a"])


def test_assign_advantages_counts_each_episode_with_its_loss_tokens():
    from ajet.tracker.sample import Sample

    def sample(ep, n):
        return Sample(episode_id=ep, group_id=ep, agent_tag="default", call_ids=["c"], prompt_ids=[1],
                      response_ids=[2] * n, loss_mask=[1] * n, old_logprobs=[-1.0] * n, policy_versions=[0] * n)

    # e1 forked into two samples of 1 token each (2 tokens), e2 has 1, e3 has 1: rewards 1, 0, 0
    samples = [sample("e1", 1), sample("e1", 1), sample("e2", 1), sample("e3", 1)]
    assign_advantages(samples, {"e1": 1.0, "e2": 0.0, "e3": 0.0}, adv_estimator="reinforce_plus_plus")
    # tokens [1, 1, 0, 0]: mean 1/2, var (4 * 1/4) / 3 = 1/3
    a = 0.5 * 3 ** 0.5
    assert [s.advantage for s in samples] == pytest.approx([a, a, -a, -a], abs=1e-6)


def test_whitening_over_one_token_gives_zero_not_nan():
    """REINFORCE++ whitens over the step's loss tokens with the unbiased variance (N - 1 in the denominator): one
    token has no batch statistic (0/0, where verl raises). The advantage is then 0, finite, whatever the reward;
    an episode without loss tokens does not count as a second token."""
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = compute_advantages(estimator, torch.tensor([3.0]), ["a"], torch.tensor([1.0]))
        assert adv.tolist() == [0.0]
        adv = compute_advantages(estimator, torch.tensor([3.0, -2.0]), ["a", "b"], torch.tensor([1.0, 0.0]))
        assert adv.tolist() == [0.0, 0.0]
    # two tokens are enough: rewards 1, 0 -> mean 1/2, unbiased var 1/2, A = +-(1/2) / sqrt(1/2) = +-0.7071
    adv = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), ["a", "b"], torch.tensor([1.0, 1.0]))
    assert adv.tolist() == pytest.approx([0.5 ** 0.5, -(0.5 ** 0.5)], abs=1e-6)


def test_a_step_with_one_trained_token_gets_advantage_zero_under_reinforce_plus_plus():
    from ajet.tracker.sample import Sample

    (s,) = [Sample(episode_id="e", group_id="e", agent_tag="default", call_ids=["c"], prompt_ids=[1],
                   response_ids=[2, 3], loss_mask=[0, 1], old_logprobs=[0.0, -1.0], policy_versions=[-1, 0])]
    assign_advantages([s], {"e": 1.0}, adv_estimator="reinforce_plus_plus")
    assert s.reward == 1.0 and s.advantage == 0.0
