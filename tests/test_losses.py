"""Exact values of every loss, estimator and aggregation on hand-checkable inputs."""

import math

import pytest
import torch

from posttrain.losses.aggregation import AGGREGATIONS, aggregate
from posttrain.losses.common import entropy_from_logits, sequence_logprob, token_logprobs
from posttrain.losses.correction import ratio_stats
from posttrain.losses.distill import (distillation_advantage, forward_kl_from_logits,
                                      reverse_kl_from_logits, sampled_reverse_kl)
from posttrain.losses.kl import (KL_ESTIMATORS, exact_kl_from_logits, kl_penalized_rewards,
                                 kl_penalty_in_loss)
from posttrain.losses.policy import (POLICY_LOSSES, clip_fractions, clip_sides,
                                     clipped_surrogate_loss, importance_sampled_pg_loss,
                                     vanilla_pg_loss)
from posttrain.losses.preference import bradley_terry_loss, dpo_loss, pairwise_accuracy, sft_loss
from posttrain.losses.value import explained_variance, value_loss

close = torch.testing.assert_close


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ----- log-probs and entropy -------------------------------------------------------------------

def test_token_logprobs_exact_and_matches_log_softmax():
    logits = torch.log(t([0.5, 0.25, 0.25]))  # probabilities 1/2, 1/4, 1/4
    close(token_logprobs(logits, torch.tensor([1])), t(math.log(0.25)))
    torch.manual_seed(0)
    z = torch.randn(2, 5, 11)
    tok = torch.randint(0, 11, (2, 5))
    ref = torch.log_softmax(z, -1).gather(-1, tok[..., None]).squeeze(-1)
    close(token_logprobs(z, tok), ref)
    close(token_logprobs(z, tok, temperature=0.7),
          torch.log_softmax(z / 0.7, -1).gather(-1, tok[..., None]).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_logprobs_half_precision_inputs_are_chunked_in_float32(dtype, monkeypatch):
    import posttrain.losses.common as L
    monkeypatch.setattr(L, "_CHUNK", 3)  # force several chunks
    torch.manual_seed(1)
    z = torch.randn(2, 5, 7).to(dtype)
    tok = torch.randint(0, 7, (2, 5))
    out = token_logprobs(z, tok)
    assert out.dtype == torch.float32
    close(out, torch.log_softmax(z.float(), -1).gather(-1, tok[..., None]).squeeze(-1))
    close(entropy_from_logits(z), -(torch.softmax(z.float(), -1) * torch.log_softmax(z.float(), -1)).sum(-1))


def test_entropy_uniform_and_one_hot():
    close(entropy_from_logits(torch.zeros(4)), torch.tensor(math.log(4)))
    assert entropy_from_logits(t([100.0, 0.0, 0.0])).item() < 1e-6


def test_sequence_logprob_sums_response_tokens_only():
    close(sequence_logprob(t([-1.0, -2.0, -5.0]), t([1.0, 1.0, 0.0])), t(-3.0))


# ----- policy losses ---------------------------------------------------------------------------

def test_vanilla_and_importance_sampled_values():
    logp, old, adv = t(math.log(0.5)), t(math.log(0.25)), t(2.0)
    close(vanilla_pg_loss(logp, old, adv), -2.0 * logp)
    close(importance_sampled_pg_loss(logp, old, adv), t(-4.0))  # rho = 2


def test_clipped_surrogate_exact_values_symmetric_and_asymmetric():
    old = torch.zeros(4)
    ratio = t(0.5, 0.9, 1.1, 1.5)
    logp = ratio.log()
    pos, neg = torch.ones(4), -torch.ones(4)
    # A > 0: min(rho A, clip(rho) A) -> clip only bites above 1+eps
    close(clipped_surrogate_loss(logp, old, pos, clip_low=0.2, clip_high=0.2), -t(0.5, 0.9, 1.1, 1.2))
    # A < 0: clip only bites below 1-eps
    close(clipped_surrogate_loss(logp, old, neg, clip_low=0.2, clip_high=0.2), t(0.8, 0.9, 1.1, 1.5))
    # Clip-Higher: the high side allows 1.28
    close(clipped_surrogate_loss(logp, old, pos, clip_low=0.2, clip_high=0.28), -t(0.5, 0.9, 1.1, 1.28))


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old, adv = t(math.log(5.0)), t(0.0), t(-1.0)
    close(clipped_surrogate_loss(logp, old, adv), t(5.0))
    close(clipped_surrogate_loss(logp, old, adv, dual_clip=3.0), t(3.0))
    close(clipped_surrogate_loss(logp, old, -adv, dual_clip=3.0), t(-1.2))  # A > 0 untouched


def test_clip_zero_gradient_outside_range_in_direction_of_advantage():
    """§5: once rho left [1-eps_low, 1+eps_high] in the direction A pushes, the gradient is 0."""
    def grad(ratio, adv, lo=0.2, hi=0.28):
        logp = torch.tensor(math.log(ratio), requires_grad=True)
        clipped_surrogate_loss(logp, torch.tensor(0.0), torch.tensor(adv),
                               clip_low=lo, clip_high=hi).backward()
        return logp.grad.item()
    assert grad(1.3, +1.0) == 0.0          # A > 0, above 1 + 0.28
    assert grad(1.25, +1.0) != 0.0         # A > 0, inside the higher range
    assert grad(0.7, -1.0) == 0.0          # A < 0, below 1 - 0.2
    assert grad(0.7, +1.0) != 0.0          # A > 0 below the range: still pushed up
    assert grad(1.3, -1.0) != 0.0          # A < 0 above the range: still pushed down
    # asymmetric: 1.25 is clipped with symmetric 0.2 but not with clip_high 0.28
    assert grad(1.25, +1.0, hi=0.2) == 0.0
    # and the low side is not widened: 0.75 is clipped with clip_low 0.2 whatever clip_high is
    assert grad(0.75, -1.0, hi=0.28) == 0.0


def test_ratio_stats_counts_clipped_tokens_and_kl():
    old = torch.zeros(1, 4)
    logp = t([0.5, 1.0, 1.5, 1.0]).log()
    adv = t([-1.0, 1.0, 1.0, 1.0])
    mask = t([1.0, 1.0, 1.0, 0.0])
    s = ratio_stats(logp, old, mask)
    sides = clip_sides(torch.exp(logp - old), adv, 0.8, 1.2)
    assert sides.tolist() == [[-1, 0, 1, 0]]   # (the masked 4th token: ratio 1, inside the band)
    fr = clip_fractions(sides, mask)
    close(fr["policy/clip_frac_low"], torch.tensor(1 / 3))
    close(fr["policy/clip_frac_high"], torch.tensor(1 / 3))
    close(s.approx_kl_old, torch.tensor(((0.5 - 1 - math.log(0.5)) + (1.5 - 1 - math.log(1.5))) / 3))
    close(s.ratio_max, torch.tensor(1.5))
    close(s.ratio_min, torch.tensor(0.5))


def test_one_update_clipped_equals_vanilla_gradient_at_ratio_one():
    torch.manual_seed(0)
    logp = torch.randn(3, 4, requires_grad=True)
    adv = torch.randn(3, 4)
    g1, = torch.autograd.grad(clipped_surrogate_loss(logp, logp.detach(), adv).sum(), logp)
    g2, = torch.autograd.grad(vanilla_pg_loss(logp, logp.detach(), adv).sum(), logp)
    close(g1, g2)
    close(g1, -adv)   # d(-rho A)/d logp = -rho A, and rho = 1


def test_clipped_gradient_away_from_ratio_one_by_hand():
    """rho = 1.1 (inside [0.8, 1.2]): d/dlogp = -rho A, the importance-sampled gradient, not
    vanilla's -A. rho = 1.3 with A > 0 and rho = 0.7 with A < 0: clipped, no gradient. rho = 1.3
    with A < 0 and rho = 0.7 with A > 0: the pessimistic branch keeps -rho A."""
    ratio, adv = t(1.1, 1.3, 0.7, 1.3, 0.7), t(2.0, 2.0, -2.0, -2.0, 2.0)
    old = torch.zeros(5)
    logp = ratio.log().requires_grad_()
    g, = torch.autograd.grad(clipped_surrogate_loss(logp, old, adv).sum(), logp)
    close(g, t(-2.2, 0.0, 0.0, 2.6, -1.4))
    g_vanilla, = torch.autograd.grad(vanilla_pg_loss(logp, old, adv).sum(), logp)
    close(g_vanilla, -adv)


# ----- aggregation -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(AGGREGATIONS.names()))
def test_an_unscored_response_weighs_as_if_it_had_never_been_sampled(name):
    """docs/algorithms.md: a response nobody could score is out of the loss as if never sampled.
    Its row's loss mask is all 0 (sampling/collect.py::loss_mask); every aggregation then gives the
    other rows the weights it gives the batch of the scored rows alone (Dr. GRPO's 1/(B L_max)
    and REINFORCE's 1/B counted every row, the unscored ones too)."""
    mask = t([1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0])
    scored = torch.tensor([True, False, True, True])
    with_row = AGGREGATIONS[name](mask * scored[:, None], 8.0)
    alone = AGGREGATIONS[name](mask[scored], 8.0)
    close(with_row[scored], alone)
    assert with_row[~scored].abs().sum() == 0


def test_aggregation_weights_match_length_bias_analysis():
    """§7: one long (4 tokens) and one short (1 token) response, both with advantage A."""
    mask = t([1, 1, 1, 1], [1, 0, 0, 0])
    w = {name: AGGREGATIONS[name](mask, 8.0) for name in AGGREGATIONS}
    # GRPO: 1/G * 1/|o_i| -> a long response's token weighs 1/8, the short one's 1/2
    close(w["seq_mean_token_mean"], t([1 / 8] * 4, [1 / 2, 0, 0, 0]))
    # DAPO: every token 1/5
    close(w["token_mean"], mask / 5)
    # Dr. GRPO: 1/(G L_max) = 1/16 for every token
    close(w["seq_mean_token_sum_norm"], mask / 16)
    # REINFORCE: 1/G per token
    close(w["seq_mean_token_sum"], mask / 2)
    # The length bias: under GRPO both responses carry the same total weight (1/2), so per token a
    # long wrong answer is punished 4x less than a short one; DAPO and Dr. GRPO weigh tokens equally.
    close(w["seq_mean_token_mean"].sum(-1), t(0.5, 0.5))
    assert (w["token_mean"].sum(-1) == t(0.8, 0.2)).all()
    # a loss of 1 on every token aggregates to the total weight: 4/8 + 1/2, 5/5, 5/16 and 5/2
    totals = {name: aggregate(torch.ones(2, 4), w[name]).item() for name in AGGREGATIONS}
    assert totals == pytest.approx({"seq_mean_token_mean": 1.0, "token_mean": 1.0,
                                    "seq_mean_token_sum_norm": 5 / 16, "seq_mean_token_sum": 2.5})


def test_aggregation_split_into_microbatches_sums_to_full_batch():
    torch.manual_seed(0)
    mask = (torch.rand(6, 5) > 0.3).float()
    loss = torch.randn(6, 5)
    for name in AGGREGATIONS:
        w = AGGREGATIONS[name](mask, 5.0)
        whole = aggregate(loss, w)
        parts = aggregate(loss[:2], w[:2]) + aggregate(loss[2:], w[2:])
        close(whole, parts)


def test_token_mean_is_invariant_to_padding():
    loss = t([2.0, 4.0])
    mask = t([1.0, 1.0])
    padded_loss, padded_mask = t([2.0, 4.0, 99.0, 99.0]), t([1.0, 1.0, 0.0, 0.0])
    close(aggregate(loss, AGGREGATIONS["token_mean"](mask, 4.0)),
          aggregate(padded_loss, AGGREGATIONS["token_mean"](padded_mask, 4.0)))


# ----- KL --------------------------------------------------------------------------------------

def test_kl_estimators_hand_values():
    logp, ref = t(math.log(0.5)), t(math.log(0.25))
    close(KL_ESTIMATORS["k1"](logp, ref), t(math.log(2)))
    close(KL_ESTIMATORS["k2"](logp, ref), t(0.5 * math.log(2) ** 2))
    close(KL_ESTIMATORS["k3"](logp, ref), t(0.5 + math.log(2) - 1))
    close(KL_ESTIMATORS["k3"](logp, logp), t(0.0))


def test_k3_is_capped_so_one_drifted_token_cannot_carry_a_step():
    from posttrain.losses.kl import K3_CAP
    logp, ref = t(0.0, -30.0, -1.0), t(-1.0, 0.0, -1.0)   # pi_ref / pi = e^-1, e^30, 1
    k3 = KL_ESTIMATORS["k3"](logp, ref)
    close(k3, t(math.exp(-1) + 1 - 1, K3_CAP, 0.0))
    logp.requires_grad_(True)
    KL_ESTIMATORS["k3"](logp, ref).sum().backward()
    assert logp.grad[1] == 0 and torch.isfinite(logp.grad).all()   # past the cap: no gradient


def test_a_non_finite_value_where_the_weight_is_zero_cannot_poison_the_loss():
    loss, w = t(2.0, 4.0, float("nan"), float("inf")), t(0.5, 0.5, 0.0, 0.0)
    close(aggregate(loss, w), torch.tensor(3.0))
    x = t(1.0, 3.0, float("nan")).requires_grad_(True)
    from posttrain.losses.common import masked_mean
    m = masked_mean(x, t(1.0, 1.0, 0.0))
    m.backward()
    close(m, torch.tensor(2.0))
    close(x.grad, t(0.5, 0.5, 0.0))


def test_k3_expectation_is_exact_kl_over_vocabulary():
    torch.manual_seed(0)
    logp_V = torch.randn(7).log_softmax(-1)
    ref_logp_V = torch.randn(7).log_softmax(-1)
    k3_V = KL_ESTIMATORS["k3"](logp_V, ref_logp_V)
    exact_kl = (logp_V.exp() * (logp_V - ref_logp_V)).sum()
    close((logp_V.exp() * k3_V).sum(), exact_kl)
    close(exact_kl_from_logits(logp_V, ref_logp_V), exact_kl)


def test_exact_kl_both_directions_hand_value():
    p, q = torch.log(t(0.5, 0.5)), torch.log(t(0.25, 0.75))
    close(exact_kl_from_logits(p, q), torch.tensor(0.5 * math.log(2) + 0.5 * math.log(2 / 3)))
    close(exact_kl_from_logits(q, p), torch.tensor(0.25 * math.log(0.5) + 0.75 * math.log(1.5)))
    close(reverse_kl_from_logits(p, q), torch.tensor(0.5 * math.log(2) + 0.5 * math.log(2 / 3)))
    bf = exact_kl_from_logits(p.bfloat16(), q.bfloat16())
    assert bf.dtype == torch.float32
    assert bf.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-2)
    # distillation, student p and teacher q: forward KL(q || p)
    close(forward_kl_from_logits(p, q), torch.tensor(0.25 * math.log(0.5) + 0.75 * math.log(1.5)))


def test_forward_kl_keeps_its_gradient_where_the_student_is_confidently_wrong():
    """Student 99.9% on token 0, teacher 99.9% on token 1: the reverse KL is large but its
    gradient vanishes; the forward KL's gradient is softmax(student) - softmax(teacher)."""
    student = torch.log(t(0.999, 0.0005, 0.0005)).requires_grad_()
    teacher = torch.log(t(0.0005, 0.999, 0.0005))
    reverse = reverse_kl_from_logits(student, teacher)
    (g_rev,) = torch.autograd.grad(reverse, student)
    forward = forward_kl_from_logits(student, teacher)
    (g_fwd,) = torch.autograd.grad(forward, student)
    assert reverse.item() > 7.0 and g_rev.abs().max().item() < 0.02
    close(g_fwd, t(0.999 - 0.0005, 0.0005 - 0.999, 0.0))
    close(forward, torch.tensor(0.999 * math.log(0.999 / 0.0005) + 0.0005 * math.log(0.0005 / 0.999)))


def test_kl_in_loss_and_in_reward():
    close(kl_penalty_in_loss(t(1.0, 2.0), t(0.5, 1.0), 0.1), t(1.05, 2.1))
    kl = t([0.1, 0.2, 0.3, 9.0], [0.5, 0.5, 0.0, 0.0])
    mask = t([1, 1, 1, 0], [1, 1, 0, 0])
    r = kl_penalized_rewards(t(1.0, -1.0), kl, mask, kl_coef=0.5)
    close(r, t([-0.05, -0.1, -0.15 + 1.0, 0.0], [-0.25, -0.25 - 1.0, 0.0, 0.0]))
    empty = kl_penalized_rewards(t(1.0), t([0.0, 0.0]), t([0.0, 0.0]), 0.5)
    close(empty, t([0.0, 0.0]))


# ----- value, distillation, preferences, SFT ----------------------------------------------------

def test_value_loss_plain_and_clipped():
    v, old, ret = t(1.0, 0.0), t(0.0, 0.0), t(2.0, 1.0)
    loss, clipped = value_loss(v, old, ret)
    close(loss, t(0.5, 0.5))
    assert not clipped.any()
    # clip 0.2 around old: first prediction becomes 0.2, error 1.8 > 1.0 -> clipped branch taken
    loss, clipped = value_loss(v, old, ret, clip_range=0.2)
    close(loss, t(0.5 * 1.8 ** 2, 0.5))
    assert clipped.tolist() == [True, False]


def test_explained_variance():
    ret, mask = t([1.0, 2.0, 3.0, 4.0]), torch.ones(1, 4)
    close(explained_variance(ret, ret, mask), torch.tensor(1.0))
    close(explained_variance(torch.zeros(1, 4) + 2.5, ret, mask), torch.tensor(0.0))


def test_distillation_terms():
    logp, tlogp, mask = t([-1.0, -2.0]), t([-0.5, -3.0]), t([1.0, 0.0])
    close(sampled_reverse_kl(logp, tlogp), t([-0.5, 1.0]))
    close(distillation_advantage(logp, tlogp, mask, coef=2.0), t([1.0, 0.0]))


def test_bradley_terry_and_accuracy():
    close(bradley_terry_loss(t(0.0), t(0.0)), t(math.log(2)))
    close(bradley_terry_loss(t(2.0), t(1.0)), t(-math.log(torch.sigmoid(torch.tensor(1.0)).item())))
    # -log sigmoid(d) without overflow at the extremes: ~0 when d = 2000, exactly 2000 when d = -2000
    close(bradley_terry_loss(t(1000.0), t(-1000.0)), t(0.0))
    close(bradley_terry_loss(t(-1000.0), t(1000.0)), t(2000.0))
    close(pairwise_accuracy(t(1.0, 0.0, 3.0), t(0.0, 1.0, 2.0)), torch.tensor(2 / 3))


def test_dpo_loss_and_implicit_rewards():
    out = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5)
    close(out.chosen_rewards, t(0.5))
    close(out.rejected_rewards, t(-0.5))
    close(out.loss, t(-math.log(torch.sigmoid(torch.tensor(1.0)).item())))
    same = dpo_loss(t(-1.0), t(-1.0), t(-1.0), t(-1.0), beta=0.1)
    close(same.loss, t(math.log(2)))


def test_sft_loss_ignores_masked_tokens():
    close(sft_loss(t([-1.0, -3.0, -100.0]), t([1.0, 1.0, 0.0])), torch.tensor(2.0))


def test_distillation_losses_are_a_registry_of_how_the_teacher_enters():
    """§8: 'sampled' is an advantage (no token loss); 'exact' adds the reverse KL with its
    gradient; 'forward' adds KL(teacher || student) and logs the reverse KL without a gradient."""
    from posttrain.losses.distill import DISTILL_LOSSES
    from posttrain.losses.kl import exact_kl_from_logits
    assert DISTILL_LOSSES.names() == ["exact", "forward", "sampled"]
    assert DISTILL_LOSSES["sampled"].in_advantage and DISTILL_LOSSES["sampled"].token_loss is None
    torch.manual_seed(0)
    z_s, z_t = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 3, 5)
    reverse, forward = exact_kl_from_logits(z_s, z_t, 0.7), exact_kl_from_logits(z_t, z_s, 0.7)
    loss, logged = DISTILL_LOSSES["exact"].token_loss(z_s, z_t, 0.7)
    torch.testing.assert_close(loss, reverse)
    torch.testing.assert_close(logged, reverse.detach())
    assert loss.requires_grad and not logged.requires_grad
    loss, logged = DISTILL_LOSSES["forward"].token_loss(z_s, z_t, 0.7)
    torch.testing.assert_close(loss, forward)
    torch.testing.assert_close(logged, reverse.detach())
    assert loss.requires_grad and not logged.requires_grad
    with pytest.raises(KeyError, match="unknown distillation loss 'kl'; known: \\['exact'"):
        DISTILL_LOSSES["kl"]


def test_seq_mean_token_mean_counts_only_responses_with_a_token():
    """An empty response (an all-zero mask row) is not a response of the mean: the weights of
    the other two sum to 1, not 2/3."""
    mask = t([1, 1, 0], [1, 0, 0], [0, 0, 0])
    w = AGGREGATIONS["seq_mean_token_mean"](mask, 3.0)
    close(w, t([1 / 4, 1 / 4, 0], [1 / 2, 0, 0], [0, 0, 0]))
    close(w.sum(), torch.tensor(1.0))
