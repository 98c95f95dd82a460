"""Properties of the estimators by exact enumeration on a tiny tabular policy (no sampling).

Vocabulary 3, responses of length 2: all 9 responses y = (y1, y2) are enumerated with their exact
probabilities, so every expectation below is a finite sum and every equality is exact up to float.
docs/algorithms.md §2 (policy gradient, baselines), §3 (importance sampling), §6 (KL estimators),
§8 (sampled reverse KL).
"""

import itertools

import torch

from posttrain.losses.aggregation import AGGREGATIONS, aggregate
from posttrain.losses.common import token_logprobs
from posttrain.losses.distill import sampled_reverse_kl
from posttrain.losses.kl import K3_CAP, KL_ESTIMATORS, kl_k3, exact_kl_from_logits
from posttrain.losses.policy import importance_sampled_pg_loss, vanilla_pg_loss

V = 3
RESPONSES = torch.tensor(list(itertools.product(range(V), repeat=2)))  # (9, 2)
REWARD = torch.tensor([[1.0, 0.0, 3.0], [0.5, 2.0, 0.0], [0.0, 1.0, 4.0]], dtype=torch.float64)
R_9 = REWARD[RESPONSES[:, 0], RESPONSES[:, 1]]


def make_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"first": torch.randn(V, generator=g, dtype=torch.float64),          # logits of y1
            "second": torch.randn(V, V, generator=g, dtype=torch.float64)}      # logits of y2 | y1


def logits_9_2_V(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-position logits of each enumerated response: (9, 2, V)."""
    first = params["first"].expand(len(RESPONSES), V)
    second = params["second"][RESPONSES[:, 0]]
    return torch.stack([first, second], dim=1)


def token_logp(params) -> torch.Tensor:
    return token_logprobs(logits_9_2_V(params), RESPONSES)  # (9, 2)


def seq_prob(params) -> torch.Tensor:
    return token_logp(params).sum(-1).exp()  # (9,)


def true_gradient(params) -> torch.Tensor:
    theta = {k: v.clone().requires_grad_() for k, v in params.items()}
    J = (seq_prob(theta) * R_9).sum()
    J.backward()
    return torch.cat([theta["first"].grad.flatten(), theta["second"].grad.flatten()])


def per_response_grads(params, adv_9: torch.Tensor) -> torch.Tensor:
    """Gradient of -loss for each response y alone, through the library's REINFORCE loss: (9, D)."""
    grads = []
    mask = torch.ones(1, 2, dtype=torch.float64)
    for i in range(len(RESPONSES)):
        theta = {k: v.clone().requires_grad_() for k, v in params.items()}
        logp_1_2 = token_logp(theta)[i:i + 1]
        loss_1_2 = vanilla_pg_loss(logp_1_2, logp_1_2.detach(), adv_9[i].expand(1, 2))
        # REINFORCE aggregation: sum over the response's tokens = -A * log pi(y|x)
        loss = aggregate(loss_1_2, AGGREGATIONS["seq_mean_token_sum"](mask, 2.0))
        (-loss).backward()
        grads.append(torch.cat([theta["first"].grad.flatten(), theta["second"].grad.flatten()]))
    return torch.stack(grads)


def test_reinforce_expectation_equals_true_gradient():
    params = make_params(0)
    pi_9 = seq_prob(params).detach()
    expected = (pi_9[:, None] * per_response_grads(params, R_9)).sum(0)
    torch.testing.assert_close(expected, true_gradient(params))


def test_constant_baseline_keeps_expectation_and_mean_baseline_lowers_variance():
    params = make_params(1)
    pi_9 = seq_prob(params).detach()
    shifted_reward = R_9 + 10.0     # a large offset makes the no-baseline estimator noisy
    true_g = (pi_9[:, None] * per_response_grads(params, shifted_reward)).sum(0)

    def stats(b: float):
        g_9_D = per_response_grads(params, shifted_reward - b)
        mean = (pi_9[:, None] * g_9_D).sum(0)
        var = (pi_9 * ((g_9_D - mean) ** 2).sum(-1)).sum()
        return mean, var

    for b in (0.0, -3.0, 7.5, (pi_9 * shifted_reward).sum().item()):
        mean, _ = stats(b)
        torch.testing.assert_close(mean, true_g)
    _, var_none = stats(0.0)
    _, var_mean = stats((pi_9 * shifted_reward).sum().item())
    assert var_mean < 0.1 * var_none


def test_importance_sampled_estimator_under_other_policy_has_same_expectation():
    """§3: E_{pi_old}[ (pi/pi_old)(y) A(y) grad log pi(y) ] = E_pi[ A grad log pi ] (sequence ratio)."""
    params, old_params = make_params(2), make_params(3)
    old_logp_9 = token_logp(old_params).sum(-1)
    pi_old_9 = old_logp_9.exp()
    grads = []
    for i in range(len(RESPONSES)):
        theta = {k: v.clone().requires_grad_() for k, v in params.items()}
        seq_logp_1_1 = token_logp(theta)[i].sum().reshape(1, 1)
        loss = importance_sampled_pg_loss(seq_logp_1_1, old_logp_9[i].reshape(1, 1),
                                          R_9[i].reshape(1, 1)).sum()
        (-loss).backward()
        grads.append(torch.cat([theta["first"].grad.flatten(), theta["second"].grad.flatten()]))
    is_expectation = (pi_old_9[:, None] * torch.stack(grads)).sum(0)
    torch.testing.assert_close(is_expectation, true_gradient(params))


def test_k1_and_k3_are_unbiased_for_sequence_kl_and_k3_nonnegative():
    logp_9 = token_logp(make_params(4)).sum(-1)
    ref_logp_9 = token_logp(make_params(5)).sum(-1)
    pi_9 = logp_9.exp()
    exact = (pi_9 * (logp_9 - ref_logp_9)).sum()
    torch.testing.assert_close((pi_9 * KL_ESTIMATORS["k1"](logp_9, ref_logp_9)).sum(), exact)
    plain = kl_k3(logp_9, ref_logp_9, cap=None)
    torch.testing.assert_close((pi_9 * plain).sum(), exact)
    # the registry's k3 is capped at K3_CAP: unbiased where every value is below it, biased low
    # on this pair, whose rarest sequences have pi_ref / pi far above 10
    capped = KL_ESTIMATORS["k3"](logp_9, ref_logp_9)
    assert plain.max() > K3_CAP and (pi_9 * capped).sum() < exact
    below = plain < K3_CAP
    assert torch.equal(capped[below], plain[below])
    assert (KL_ESTIMATORS["k3"](logp_9, ref_logp_9) >= 0).all()
    assert (KL_ESTIMATORS["k1"](logp_9, ref_logp_9) < 0).any()  # k1 is unbiased but not >= 0
    # k2 is biased: its expectation differs from the KL on this pair
    assert not torch.isclose((pi_9 * KL_ESTIMATORS["k2"](logp_9, ref_logp_9)).sum(), exact)


def test_sampled_reverse_kl_is_unbiased_for_exact_reverse_kl():
    """§8: E_{y~student}[ sum_t log pi_S(y_t) - log pi_T(y_t) ] = E_{y~student}[ sum_t KL_t(S||T) ]."""
    student, teacher = make_params(6), make_params(7)
    s_logits, t_logits = logits_9_2_V(student), logits_9_2_V(teacher)
    s_logp, t_logp = token_logp(student), token_logp(teacher)
    pi_9 = s_logp.sum(-1).exp()
    sampled = (pi_9 * sampled_reverse_kl(s_logp, t_logp).sum(-1)).sum()
    exact_per_position = exact_kl_from_logits(s_logits, t_logits)  # (9, 2)
    exact = (pi_9 * exact_per_position.sum(-1)).sum()
    torch.testing.assert_close(sampled, exact)
    # and equals the KL between the two sequence distributions (chain rule of KL)
    torch.testing.assert_close(exact, (pi_9 * (s_logp.sum(-1) - t_logp.sum(-1))).sum())
