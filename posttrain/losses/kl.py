"""KL to the reference policy: the estimators (`KL_ESTIMATORS`), the exact KL from logits, the KL in
the loss or in the reward, and the entropy bonus.  §4, §5, §6, §11.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.losses.common import _MAX_LOG_RATIO, masked
from posttrain.util.registry import Registry


# ---------------------------------------------------------------------------------------------
# KL to the reference policy (§4, §5, §6)
# ---------------------------------------------------------------------------------------------

KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator")

K3_CAP = 10.0   # the k3 estimator's per-token cap (see kl_k3)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log(pi / pi_ref).  §6.  Unbiased for KL(pi || pi_ref) under y ~ pi; can be negative.

    As a reward (PPO's kl_in='reward') it is the right penalty. In the loss its gradient is
    grad log pi, whose expectation under y ~ pi is 0: it pulls nowhere, so kl_in='loss' refuses it
    (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL")."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 (log(pi / pi_ref))^2.  §6.  Biased as a value, >= 0, low variance.

    In the loss its gradient is log(pi / pi_ref) grad log pi, whose expectation under y ~ pi is
    grad KL(pi || pi_ref) at each position given its prefix: the reverse KL the penalty is meant
    to be (per token; how a token changes the later tokens' KL is not in it, Tang & Munos's
    second pitfall, for every per-token estimator alike)."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor, cap: float | None = K3_CAP) -> Tensor:
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1.  §6 (GRPO's choice).  Unbiased under y ~ pi, and
    never negative since x - log x - 1 >= 0.

    Capped at `cap` = K3_CAP = 10 per token, as verl's `low_var_kl` (its core_algos.kl_penalty)
    caps it: one token that drifted far from pi_ref (log-ratio 20 gives e^20 ~ 5e8) would
    otherwise carry the whole KL term of a step; past the cap that token's KL gradient is 0, and
    the estimate is biased low there (unbiased wherever every value is below the cap; `cap=None`
    is the plain estimator). The log-ratio is also clamped at +-20 before exp() (float32
    overflows near 88).

    In the loss (GRPO) its gradient is (1 - pi_ref/pi) grad log pi, whose expectation under
    y ~ pi is grad KL(pi_ref || pi): the *forward* KL, not the reverse KL its value estimates
    (Tang & Munos 2025). `k3_st` keeps k3's value with the reverse KL's gradient."""
    log_r = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.exp(log_r) - log_r - 1.0
    return k3 if cap is None else k3.clamp(max=cap)


@KL_ESTIMATORS.register("k3_st")
def kl_k3_straight_through(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Straight-through k3: the value of k3 (unbiased for KL(pi || pi_ref), >= 0, capped), the
    gradient of k2, so the penalty in the loss follows grad KL(pi || pi_ref) (per position).  §6.

        value k3,   gradient log(pi / pi_ref) grad log pi   (0 where k3 passes its cap, as k3's)
    """
    k2 = kl_k2(logp, ref_logp)
    under_cap = (kl_k3(logp.detach(), ref_logp, cap=None) <= K3_CAP).to(k2.dtype)
    return kl_k3(logp, ref_logp).detach() + (k2 - k2.detach()) * under_cap


# where each estimator's gradient in the loss points (docs/algorithms.md §6); None: nowhere
KL_GRADIENT_OF = {"k1": None, "k2": "KL(pi || pi_ref)", "k3": "KL(pi_ref || pi)",
                  "k3_st": "KL(pi || pi_ref)"}


def entropy_bonus_loss(entropy_B_T: Tensor, coef: float) -> Tensor:
    """Entropy regularisation, per token.  §11.

        L_t = -coef * H(pi_theta(. | x, y_<t))

    With the entropy's own gradient (the full distribution at each position): coef > 0 pushes
    the policy to keep its options open, the classic remedy for entropy collapse."""
    return -coef * entropy_B_T


def exact_kl_from_logits(p_logits_N_V: Tensor, q_logits_N_V: Tensor,
                         temperature: float = 1.0) -> Tensor:
    """Exact full-vocabulary KL(p || q) at each position.  §6, §8.

        KL(p || q) = sum_v p_v (log p_v - log q_v),   p = softmax(z_p / tau), q = softmax(z_q / tau)

    Reverse KL of distillation is `exact_kl_from_logits(student, teacher)`; the forward KL is
    the same call with the arguments swapped. (..., V) x (..., V) -> (...) float32.
    """
    if p_logits_N_V.dtype != torch.float64:
        p_logits_N_V, q_logits_N_V = p_logits_N_V.float(), q_logits_N_V.float()
    p_logits_N_V, q_logits_N_V = p_logits_N_V / temperature, q_logits_N_V / temperature
    logp = torch.log_softmax(p_logits_N_V, dim=-1)
    logq = torch.log_softmax(q_logits_N_V, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def kl_penalty_in_loss(loss_B_T: Tensor, kl_B_T: Tensor, kl_coef: float) -> Tensor:
    """GRPO puts the KL in the loss, per token.  §6.   L_t <- L_t + beta * KL_t."""
    return loss_B_T + kl_coef * kl_B_T


def kl_penalized_rewards(scores_B: Tensor, kl_B_T: Tensor, mask_B_T: Tensor,
                         kl_coef: float) -> Tensor:
    """PPO folds the KL into a dense per-token reward.  §5.

        r_t = -beta * kl_t  for every response token,   r_T += R(x, y)  on the last one

    Shapes: scores (B,), kl (B, T), mask (B, T) -> (B, T). A response with no tokens gets no
    reward (there is no token to put it on).
    """
    rewards_B_T = -kl_coef * masked(kl_B_T, mask_B_T)
    positions = torch.arange(mask_B_T.shape[1], device=mask_B_T.device)
    last_B = (positions * (mask_B_T > 0)).amax(-1)
    has_tokens = mask_B_T.sum(-1) > 0
    add_B = torch.where(has_tokens, scores_B.to(rewards_B_T.dtype), torch.zeros_like(scores_B,
                        dtype=rewards_B_T.dtype))
    return rewards_B_T.scatter_add(1, last_B.unsqueeze(1), add_B.unsqueeze(1))
