"""Policy objectives (§2, §3, §5, §11): one `PolicyInputs` in, a `PolicyTerm` (per-token loss,
metrics, clip sides) out, registered in `POLICY_LOSSES` by the name `algorithm.policy_loss` reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses.common import masked, masked_mean
from posttrain.util.registry import Registry


# ---------------------------------------------------------------------------------------------
# Policy objectives (§2, §3, §5, §11): one inputs object in, a per-token loss and its metrics out
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyInputs:
    """What a policy objective may read for one micro-batch (rows = whole groups), (b, T) each.

    A sequence-level objective (GSPO, GMPO) computes one loss per row and writes it on each of the
    row's tokens; with the `seq_mean_token_mean` aggregation (weights 1 / (B |o_i|)) the sum over
    tokens is then exactly the mean over sequences, in value and gradient."""

    logp_B_T: Tensor                    # log pi_theta(y_t), with gradient
    old_logp_B_T: Tensor                # log pi_old(y_t): the trainer's, before this step's update
    adv_B_T: Tensor                     # advantages (one value per row for outcome rewards)
    mask_B_T: Tensor                    # 1 on tokens the policy wrote, 0 on padding / environment
    group_size: int                     # rows i*G .. i*G+G-1 answer the same prompt
    generator: torch.Generator | None = None   # randomness an objective may use (Clip-Cov)
    # log mu(y_t): what really sampled the token (the engine's recorded log-probs, several weight
    # versions old with rollout.max_staleness); None: the sampler was pi_old itself
    behaviour_logp_B_T: Tensor | None = None


@dataclass(frozen=True)
class ObjectiveParams:
    """The hyper-parameters objectives read (AlgorithmConfig.objective_params())."""

    clip_low: float = 0.2               # ratio may fall to 1 - clip_low (GMPO: log-ratio to -clip_low)
    clip_high: float = 0.2              # ratio may rise to 1 + clip_high (GMPO: log-ratio to +clip_high)
    dual_clip: float | None = None
    sapo_tau_pos: float = 1.0           # SAPO gate temperature for A > 0
    sapo_tau_neg: float = 1.05          # ... for A < 0
    cov_frac: float = 2e-4              # Clip-Cov: share of tokens detached; KL-Cov: 2e-3 typical
    cov_low: float = 1.0                # Clip-Cov: covariance band the detached tokens come from
    cov_high: float = 5.0
    kl_cov_coef: float = 1.0            # KL-Cov: coefficient of |log pi - log pi_old| on its tokens
    dppo_delta_low: float = 0.2         # DPPO: divergence a token with A < 0 may reach
    dppo_delta_high: float = 0.2        # DPPO: divergence a token with A > 0 may reach
    dppo_ratio_cap: float | None = 10.0  # DPPO: its importance weight min(pi / mu, cap) (None: uncapped)


@dataclass(frozen=True)
class PolicyTerm:
    """An objective's per-token loss (b, T), its own metrics (per-row means, tensors) and, for an
    objective that clips, which tokens' gradients its clip removed (`clip_sides`: -1 low side,
    +1 high side, 0 none; the per-token records show it)."""

    loss_B_T: Tensor
    metrics: dict[str, Tensor]
    clipped_B_T: Tensor | None = None


PolicyObjective = Callable[[PolicyInputs, ObjectiveParams], PolicyTerm]
# An objective declares the frozen inputs it reads beyond logp, advantages and the mask
# (`register(name, reads=...)`); undeclared, it reads pi_old (the ratio). The update runs no
# frozen pass that no term reads (rl/loss_terms.py::frozen_inputs).
POLICY_LOSSES: Registry[PolicyObjective] = Registry("policy loss")
READS_PI_OLD = frozenset({"old_logp"})


def objective_reads(name: str) -> frozenset[str]:
    """The frozen inputs policy objective `name` reads (its declaration, else pi_old)."""
    return frozenset(POLICY_LOSSES.meta(name).get("reads", READS_PI_OLD))


def vanilla_pg_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor) -> Tensor:
    """REINFORCE / vanilla policy gradient, per token.  §2.

        L_t = -A_t * logp_t        (grad L = -A grad log pi: "reward-weighted SFT")

    Needs on-policy samples; `old_logp` is ignored.
    """
    return -adv_B_T * logp_B_T


def importance_sampled_pg_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor) -> Tensor:
    """Importance-sampled policy gradient, per token.  §3.

        L_t = -rho_t * A_t,   rho_t = exp(logp_t - old_logp_t)

    grad L = -rho A grad log pi: unbiased for samples drawn from `pi_old`, but unbounded.
    """
    return -torch.exp(logp_B_T - old_logp_B_T) * adv_B_T


def clipped_surrogate_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, *,
                           clip_low: float = 0.2, clip_high: float = 0.2,
                           dual_clip: float | None = None) -> Tensor:
    """PPO clipped surrogate, per token.  §5 (PPO), §6 (GRPO), §7 (DAPO Clip-Higher).

        L_t = -min( rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t )

    `clip_high > clip_low` is DAPO's Clip-Higher. `dual_clip = c > 1` (Ye et al. 2020) also
    bounds the loss of a negative-advantage token at `-c A_t`, so a token whose ratio exploded
    cannot dominate: L_t = min(L_t, -c A_t) where A_t < 0.
    """
    ratio = torch.exp(logp_B_T - old_logp_B_T)
    unclipped = -ratio * adv_B_T
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_B_T
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv_B_T < 0, torch.minimum(loss, -dual_clip * adv_B_T), loss)
    return loss


def clip_sides(ratio_B_T: Tensor, adv_B_T: Tensor, low: float, high: float) -> Tensor:
    """(b, T) int8: -1 where a clip removed the token's gradient on the low side (A < 0 and the
    ratio below `low`), +1 on the high side (A > 0 and the ratio above `high`), else 0.  §5."""
    with torch.no_grad():
        return ((ratio_B_T > high) & (adv_B_T > 0)).to(torch.int8) - \
            ((ratio_B_T < low) & (adv_B_T < 0)).to(torch.int8)


def clip_fractions(sides_B_T: Tensor, mask_B_T: Tensor) -> dict[str, Tensor]:
    """Shares of tokens whose gradient a clip removed, per side (`clip_sides`).  §5."""
    m = mask_B_T.float()
    return {"policy/clip_frac_low": masked_mean((sides_B_T < 0).float(), m),
            "policy/clip_frac_high": masked_mean((sides_B_T > 0).float(), m)}


def clipped_term(loss_B_T: Tensor, ratio_B_T: Tensor, x: PolicyInputs, low: float,
                 high: float) -> PolicyTerm:
    """A clipping objective's term: its loss, clip fractions and per-token clip sides."""
    sides = clip_sides(ratio_B_T, x.adv_B_T, low, high)
    return PolicyTerm(loss_B_T, clip_fractions(sides, x.mask_B_T), sides)


def _ratio(x: PolicyInputs) -> Tensor:
    return torch.exp((x.logp_B_T - x.old_logp_B_T).detach())


@POLICY_LOSSES.register("vanilla", reads=frozenset())
def vanilla_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """REINFORCE (`vanilla_pg_loss`).  §2."""
    return PolicyTerm(vanilla_pg_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T), {})


@POLICY_LOSSES.register("importance_sampled")
def importance_sampled_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """Unclipped importance sampling (`importance_sampled_pg_loss`).  §3."""
    return PolicyTerm(importance_sampled_pg_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T), {})


@POLICY_LOSSES.register("clipped")
def clipped_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """PPO / GRPO / DAPO clipped surrogate (`clipped_surrogate_loss`).  §5-§7."""
    loss = clipped_surrogate_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, clip_low=p.clip_low,
                                  clip_high=p.clip_high, dual_clip=p.dual_clip)
    return clipped_term(loss, _ratio(x), x, 1 - p.clip_low, 1 + p.clip_high)


def sequence_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """(B,) mean of x over each row's masked tokens; 0 for a row with none."""
    return masked(x_B_T, mask_B_T).sum(-1) / mask_B_T.sum(-1).clamp(min=1)


def gspo_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor, *,
              clip_low: float, clip_high: float, token_level: bool = False) -> Tensor:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Qwen3), per token.  §11.

        s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp( 1/|y_i| sum_t log rho_it )
        L_i = -min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )

    A length-normalised sequence ratio, clipped per sequence (the paper's eps are ~3e-4 / 4e-4):
    one token's noisy ratio cannot clip or blow up its own gradient. L_i is written on each of
    row i's tokens (A_i = the row's mean advantage). GSPO-token (`token_level=True`) keeps
    per-token advantages with s_it = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)] (value s_i,
    gradient s_i grad log pi(y_t)):  L_it = -min(s_it A_it, clip(s_it) A_it); with one advantage
    per row it equals GSPO in value and gradient.
    """
    log_s = sequence_mean(logp_B_T - old_logp_B_T, mask_B_T)[:, None]
    if token_level:
        s, adv = torch.exp(log_s.detach() + logp_B_T - logp_B_T.detach()), adv_B_T
    else:
        s, adv = torch.exp(log_s).expand_as(logp_B_T), sequence_mean(adv_B_T, mask_B_T)[:, None]
    return torch.maximum(-s * adv, -s.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)


def _gspo(token_level: bool) -> PolicyObjective:
    def objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
        loss = gspo_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, x.mask_B_T, clip_low=p.clip_low,
                         clip_high=p.clip_high, token_level=token_level)
        s = torch.exp(sequence_mean((x.logp_B_T - x.old_logp_B_T).detach(), x.mask_B_T))[:, None]
        return clipped_term(loss, s.expand_as(x.logp_B_T), x, 1 - p.clip_low, 1 + p.clip_high)
    objective.__doc__ = f"GSPO{'-token' if token_level else ''} (`gspo_loss`).  §11."
    return objective


POLICY_LOSSES.register("gspo")(_gspo(token_level=False))
POLICY_LOSSES.register("gspo_token")(_gspo(token_level=True))


def cispo_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, *, clip_low: float,
               clip_high: float) -> Tensor:
    """CISPO (MiniMax-M1, Chen et al. 2025), per token.  §11.

        L_t = -sg[ clip(rho_t, 1 - eps_low, 1 + eps_high) ] * A_t * log pi_theta(y_t)

    The clipped importance weight is a constant: every token keeps a gradient (PPO's clip drops
    the gradient of the rare tokens whose ratio moved most, often the "forks" of a reasoning
    chain); only its weight is bounded. The paper sets no lower bound (eps_low = 1: the weight
    never falls below 0) and a large eps_high.
    """
    w = torch.exp(logp_B_T - old_logp_B_T).detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    return -w * adv_B_T * logp_B_T


@POLICY_LOSSES.register("cispo")
def cispo_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """CISPO (`cispo_loss`); the metrics count weights held at a bound.  §11."""
    loss = cispo_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, clip_low=p.clip_low, clip_high=p.clip_high)
    capped = (_ratio(x) > 1 + p.clip_high).to(torch.int8)   # (the weight held, the gradient kept)
    return PolicyTerm(loss, {"policy/is_weight_capped_frac": masked_mean(capped.float(), x.mask_B_T.float())},
                      capped)


def sapo_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, *, tau_pos: float,
              tau_neg: float) -> Tensor:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", Qwen), per token.  §11.

        f(rho) = 4 / tau * sigmoid( tau (rho - 1) ),   L_t = -f(rho_t) A_t,
        tau = tau_pos where A_t > 0, tau_neg where A_t < 0

    A soft gate instead of a hard clip: f'(rho) = 4 s (1 - s) rho-weighted, which is 1 at rho = 1
    (the plain policy gradient on-policy) and decays smoothly as rho leaves 1, faster for negative
    advantages (tau_neg > tau_pos), instead of dropping to zero at a clip edge.
    """
    ratio = torch.exp(logp_B_T - old_logp_B_T)
    tau = torch.where(adv_B_T > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv_B_T


@POLICY_LOSSES.register("sapo")
def sapo_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """SAPO (`sapo_loss`).  §11."""
    return PolicyTerm(sapo_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, tau_pos=p.sapo_tau_pos,
                                tau_neg=p.sapo_tau_neg), {})


def gmpo_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor, *,
              clip_low: float, clip_high: float) -> Tensor:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"), per token.  §11.

        L_i = -A_i * exp( 1/|y_i| sum_t  sgn(A_i) min( sgn(A_i) log rho_it,
                                                    sgn(A_i) clip(log rho_it, -eps_low, eps_high) ) )

    The geometric mean of the token ratios instead of their arithmetic mean (GRPO): an outlier
    ratio moves it less. The clip acts on each token's log-ratio, pessimistically (the smaller
    objective for A > 0, the larger ratio for A < 0), so a clipped token has no gradient; the
    paper's range is eps = 0.4. L_i is written on each of row i's tokens (A_i = its mean advantage).
    """
    adv_B = sequence_mean(adv_B_T, mask_B_T)[:, None]
    sign = torch.sign(adv_B)
    log_ratio = logp_B_T - old_logp_B_T
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-clip_low, clip_high))
    return -adv_B * torch.exp(sequence_mean(pessimistic, mask_B_T))[:, None].expand_as(logp_B_T)


@POLICY_LOSSES.register("gmpo")
def gmpo_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """GMPO (`gmpo_loss`); clip fractions on the token log-ratios.  §11."""
    loss = gmpo_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, x.mask_B_T, clip_low=p.clip_low,
                     clip_high=p.clip_high)
    return clipped_term(loss, _ratio(x), x, math.exp(-p.clip_low), math.exp(p.clip_high))


def dro_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, *, beta: float) -> Tensor:
    """DRO, direct reward optimisation (Richemond et al. 2024, "Offline Regularised Reinforcement
    Learning for Large Language Models Alignment"), per token, as Tinker's `dro` loss writes it.  §11.

        L_t = -( A_t * logp_t - beta/2 * (logp_t - old_logp_t)^2 )

    A policy-gradient term plus a squared log-ratio penalty that keeps pi near the policy that
    sampled: off-policy samples without a clipped ratio.
    """
    return -(adv_B_T * logp_B_T - 0.5 * beta * (logp_B_T - old_logp_B_T) ** 2)
