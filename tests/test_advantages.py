"""Advantage estimators: hand values, invariances, and the GAE limits of docs/algorithms.md §5."""

import pytest
import torch

from posttrain.losses.advantages import (ADVANTAGES, AdvantageInputs, AdvantageParams,
                                  batch_mean_baseline_advantage, discounted_returns, gae,
                                  grpo_advantage, group_mean_baseline_advantage,
                                  reinforce_advantage, rloo_advantage, whiten)

close = torch.testing.assert_close
REWARDS_P_G = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # 2 prompts x 3 answers


def test_reinforce_and_baselines_hand_values():
    close(reinforce_advantage(REWARDS_P_G), REWARDS_P_G)
    close(batch_mean_baseline_advantage(REWARDS_P_G), REWARDS_P_G - 4 / 6)
    close(group_mean_baseline_advantage(REWARDS_P_G),
          torch.tensor([[2 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0]]))


def test_rloo_leave_one_out_hand_values():
    # answer 0: 1 - mean(0, 0) = 1; answers 1, 2: 0 - mean(1, 0) = -0.5
    close(rloo_advantage(REWARDS_P_G), torch.tensor([[1.0, -0.5, -0.5], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantage(torch.ones(3, 1))


def test_grpo_hand_values_zero_mean_and_all_equal_group():
    adv = grpo_advantage(REWARDS_P_G, eps=0.0 + 1e-6)
    std = torch.tensor([1.0, 0.0, 0.0]).std()  # unbiased: sqrt(1/3)
    close(adv[0], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (std + 1e-6))
    close(adv.mean(dim=1), torch.zeros(2))
    assert (adv[1] == 0).all() and not adv.isnan().any()
    bf = grpo_advantage(REWARDS_P_G.bfloat16())
    assert bf.dtype == torch.bfloat16 and not bf.isnan().any()


def test_dr_grpo_is_mean_centred_without_std():
    close(grpo_advantage(REWARDS_P_G, scale_by_std=False), group_mean_baseline_advantage(REWARDS_P_G))


def test_gae_hand_example_four_tokens():
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.4, 0.6, 0.8]])
    m = torch.ones(1, 4)
    gamma, lam = 0.9, 0.5
    # deltas: t3: 1 - 0.8 = 0.2; t2: 0 + .9*.8 - .6 = 0.12; t1: .9*.6 - .4 = 0.14; t0: .9*.4 - .5 = -0.14
    a3 = 0.2
    a2 = 0.12 + 0.45 * a3
    a1 = 0.14 + 0.45 * a2
    a0 = -0.14 + 0.45 * a1
    adv, ret = gae(r, v, m, gamma, lam)
    close(adv, torch.tensor([[a0, a1, a2, a3]]))
    close(ret, adv + v)


def test_gae_lambda_one_is_monte_carlo_minus_values_and_lambda_zero_is_td():
    torch.manual_seed(0)
    r, v = torch.randn(3, 6), torch.randn(3, 6)
    m = torch.ones(3, 6)
    gamma = 0.97
    mc = torch.zeros(3, 6)
    running = torch.zeros(3)
    for t in reversed(range(6)):
        running = r[:, t] + gamma * running
        mc[:, t] = running
    adv1, ret1 = gae(r, v, m, gamma, 1.0)
    close(adv1, mc - v)
    close(ret1, mc)
    close(discounted_returns(r, m, gamma), mc)
    next_v = torch.cat([v[:, 1:], torch.zeros(3, 1)], dim=1)
    adv0, _ = gae(r, v, m, gamma, 0.0)
    close(adv0, r + gamma * next_v - v)


def test_gae_masked_values_do_not_matter_and_padding_is_skipped():
    torch.manual_seed(1)
    r, v = torch.randn(2, 5), torch.randn(2, 5)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(r * m, v, m, 0.9, 0.8)
    v2 = v + (1 - m) * 100.0
    adv2, ret2 = gae(r * m, v2, m, 0.9, 0.8)
    close(adv, adv2)
    close(ret, ret2)
    assert (adv[m == 0] == 0).all()
    # right padding equals the unpadded sequence
    adv_short, _ = gae(r[:1, :3], v[:1, :3], torch.ones(1, 3), 0.9, 0.8)
    close(adv[:1, :3], adv_short)
    # a masked hole is skipped: row 1 equals the compacted sequence of its 3 unmasked tokens
    keep = m[1] > 0
    adv_c, _ = gae(r[1:, keep], v[1:, keep], torch.ones(1, 3), 0.9, 0.8)
    close(adv[1, keep], adv_c[0])


def test_whiten_is_bessel_corrected_and_ignores_what_the_mask_hides():
    x, m = torch.tensor([[1.0, 2.0, 3.0, 50.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = whiten(x, m)
    close((w * m).sum(), torch.tensor(0.0))
    # var = ((-1)^2 + 0 + 1^2) / (3 - 1) = 1: the unbiased variance, as torch.std computes it
    close(w[0, :3], torch.tensor([-1.0, 0.0, 1.0]), rtol=1e-4, atol=1e-4)
    close(w[0, :3], (x[0, :3] - x[0, :3].mean()) / x[0, :3].std(), rtol=1e-4, atol=1e-4)
    assert w[0, 3] == 0
    for hidden in (float("nan"), float("inf"), -1e30):   # a masked position cannot leak in
        x_bad = x.clone()
        x_bad[0, 3] = hidden
        assert torch.equal(whiten(x_bad, m), w)
    one = whiten(torch.tensor([[4.0, 0.0]]), torch.tensor([[1.0, 0.0]]))   # n = 1: no 0 / 0
    assert torch.isfinite(one).all()


def test_registry_dispatch_broadcasts_to_tokens_and_names_unknown_keys():
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 6)
    out = ADVANTAGES["group"](AdvantageInputs(REWARDS_P_G, mask), AdvantageParams())
    close(out.adv_B_T[:, 0], grpo_advantage(REWARDS_P_G).reshape(-1))
    assert (out.adv_B_T[:, 2] == 0).all()
    dr = ADVANTAGES["group"](AdvantageInputs(REWARDS_P_G, mask), AdvantageParams(scale_by_std=False))
    close(dr.adv_B_T[:, 1], group_mean_baseline_advantage(REWARDS_P_G).reshape(-1))
    with pytest.raises(KeyError, match="known: \\['batch_mean'"):
        ADVANTAGES["nope"]
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGES.register("group")(lambda i, p: None)
    with pytest.raises(ValueError, match="needs values"):
        ADVANTAGES["gae"](AdvantageInputs(REWARDS_P_G, mask), AdvantageParams())
