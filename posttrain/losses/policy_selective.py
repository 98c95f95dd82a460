"""Policy objectives that choose which tokens carry a gradient (§11), registered in
`POLICY_LOSSES` beside the others (losses/policy.py; the package init imports this module, so the
registry always holds them): Clip-Cov and KL-Cov (by the covariance of log-prob and advantage),
TOPR (by the sign of the advantage and the ratio), DPPO (by the divergence from the policy that
sampled).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.losses.common import _MAX_LOG_RATIO, masked, masked_mean
from posttrain.losses.policy import (POLICY_LOSSES, ObjectiveParams, PolicyInputs, PolicyObjective,
                                     PolicyTerm, _ratio, clip_fractions, clipped_term,
                                     clipped_surrogate_loss)


def centred_covariance(logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Per-token (log pi(y_t) - mean log pi) (A_t - mean A) over the masked tokens (no gradient):
    the token's share of Cov(log pi, A), whose sum drives the entropy change of a policy-gradient
    step (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").  §11."""
    with torch.no_grad():
        m = mask_B_T.float()
        lp, a = logp_B_T.detach().float(), adv_B_T.float()
        return (lp - masked_mean(lp, m)) * (a - masked_mean(a, m)) * m


def clip_cov_loss(x: PolicyInputs, p: ObjectiveParams) -> Tensor:
    """Clip-Cov (Cui et al. 2025), per token.  §11.

        C = { tokens with cov_low < cov_t < cov_high that PPO's clip left alone },
        pick max(1, floor(frac * n_tokens)) of C at random;   L_t = clipped_t * (t not picked)

    The picked tokens' gradients are removed: a few high-covariance tokens (confident and
    rewarded) drive the entropy collapse, and detaching them keeps entropy up at almost no cost.
    Reads x's log-probs, advantages, mask and `generator` (the random pick), and p's clip_low,
    clip_high, cov_low, cov_high and cov_frac (frac).
    """
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = x.logp_B_T, x.old_logp_B_T, x.adv_B_T, x.mask_B_T
    clipped = clipped_surrogate_loss(logp_B_T, old_logp_B_T, adv_B_T, clip_low=p.clip_low,
                                     clip_high=p.clip_high)
    # (the means, the count and the draw are over the micro-batch the loss sees, as verl's; so the
    # picked tokens depend on optim.micro_batch_size)
    with torch.no_grad():
        unclipped = -torch.exp(logp_B_T - old_logp_B_T) * adv_B_T
        cov = centred_covariance(logp_B_T, adv_B_T, mask_B_T)
        band = (cov > p.cov_low) & (cov < p.cov_high) & (mask_B_T > 0) & (clipped <= unclipped)
        idx = band.flatten().nonzero().squeeze(-1)
        n = max(1, int(p.cov_frac * float(mask_B_T.sum())))
        pick = idx[torch.randperm(len(idx), generator=x.generator)[:n]]
        keep = torch.ones(mask_B_T.numel(), dtype=clipped.dtype, device=clipped.device)
        keep[pick] = 0.0
    return clipped * keep.view_as(clipped)


@POLICY_LOSSES.register("clip_cov")
def clip_cov_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """Clip-Cov (`clip_cov_loss`) on the clipped surrogate.  §11."""
    loss = clip_cov_loss(x, p)
    return clipped_term(loss, _ratio(x), x, 1 - p.clip_low, 1 + p.clip_high)


def kl_cov_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor, *,
                frac: float, coef: float) -> Tensor:
    """KL-Cov (Cui et al. 2025), per token.  §11.

        K = the max(1, floor(frac * n_tokens)) tokens of largest cov_t,
        L_t = -rho_t A_t + coef * |log pi_theta(y_t) - log pi_old(y_t)| * (t in K)

    No clip; instead the few tokens of largest covariance are held near pi_old by a KL-like
    penalty (the paper's frac is 2e-3, coef 1). Like Clip-Cov, it picks within the micro-batch.
    """
    log_ratio = logp_B_T - old_logp_B_T
    loss = -torch.exp(log_ratio) * adv_B_T
    with torch.no_grad():
        cov = centred_covariance(logp_B_T, adv_B_T, mask_B_T).masked_fill(mask_B_T <= 0, -math.inf)
        n = min(max(1, int(frac * float(mask_B_T.sum()))), int((mask_B_T > 0).sum()))
        top = torch.zeros(cov.numel(), dtype=loss.dtype, device=loss.device)
        top[cov.flatten().topk(n).indices] = 1.0
    return loss + coef * log_ratio.abs() * top.view_as(loss)


@POLICY_LOSSES.register("kl_cov")
def kl_cov_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """KL-Cov (`kl_cov_loss`).  §11."""
    return PolicyTerm(kl_cov_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, x.mask_B_T,
                                  frac=p.cov_frac, coef=p.kl_cov_coef), {})

def topr_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE"), per token.  §11.

        L_t = -w_it A_t log pi_theta(y_t),
        w_it = 1                                    where A_t >= 0
             = sg[ min(1, prod_t' rho_it') ]        where A_t < 0   (rho = pi_theta / pi_old)

    Positive answers get plain REINFORCE (SFT-like, no importance weight, so no ratio can
    vanish them); negative ones get the sequence's importance ratio truncated at 1, so a wrong
    answer the policy has already moved away from pushes less. No clip drops any gradient.
    """
    log_seq_ratio = masked(logp_B_T - old_logp_B_T, mask_B_T).sum(-1, keepdim=True).detach()
    taper = torch.exp(log_seq_ratio.clamp(max=0.0))            # min(1, prod rho), no overflow
    w = torch.where(adv_B_T >= 0, torch.ones_like(logp_B_T), taper.expand_as(logp_B_T))
    return -w * adv_B_T * logp_B_T


@POLICY_LOSSES.register("topr")
def topr_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """TOPR (`topr_loss`); the metric is the share of negative tokens whose weight fell below 1.  §11."""
    loss = topr_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, x.mask_B_T)
    log_seq_ratio = masked(x.logp_B_T - x.old_logp_B_T, x.mask_B_T).sum(-1, keepdim=True).detach()
    tapered = ((x.adv_B_T < 0) & (log_seq_ratio < 0)).float()
    return PolicyTerm(loss, {"policy/topr_tapered_frac": masked_mean(tapered, x.mask_B_T.float())})


# ---------------------------------------------------------------------------------------------
# DPPO: a trust region on the divergence from the sampler, not on the ratio (§5, §3)
# ---------------------------------------------------------------------------------------------

def binary_tv(logp_B_T: Tensor, behaviour_logp_B_T: Tensor) -> Tensor:
    """Signed total-variation of the sampled token's binary split (itself / every other token).  §5.

        D_TV,t = pi(y_t) - mu(y_t)

    |D_TV,t| is the TV distance between Bernoulli(mu(y_t)) and Bernoulli(pi(y_t)); the sign says
    which way the update moved the token (DPPO, Qi et al. 2026)."""
    return logp_B_T.exp() - behaviour_logp_B_T.exp()


def binary_kl(logp_B_T: Tensor, behaviour_logp_B_T: Tensor, eps: float = 1e-8) -> Tensor:
    """KL between the sampled token's binary splits under mu and pi.  §5.

        D_KL,t = mu_t log(mu_t / pi_t) + (1 - mu_t) log((1 - mu_t) / (1 - pi_t))

    with mu_t = mu(y_t), pi_t = pi(y_t); eps keeps a token of probability 1 finite."""
    mu, pi = behaviour_logp_B_T.exp(), logp_B_T.exp()
    return mu * (behaviour_logp_B_T - logp_B_T) + (1 - mu) * torch.log((1 - mu + eps) / (1 - pi + eps))


def dppo_keep(divergence_B_T: Tensor, moved_up_B_T: Tensor, adv_B_T: Tensor, delta_low: float,
              delta_high: float, signed: bool) -> Tensor:
    """DPPO's mask (no gradient): 1 where the token's gradient is kept.  §5.

    A token is masked only when the update would carry it further out of the trust region:
    A > 0 (pushing pi(y_t) up) once pi has risen past delta_high above mu, A < 0 once it has
    fallen past delta_low below. `signed`: `divergence` is binary_tv (its sign is the move);
    else a divergence >= 0 (binary_kl) read with `moved_up` (pi(y_t) > mu(y_t))."""
    with torch.no_grad():
        if signed:
            up_ok, down_ok = divergence_B_T <= delta_high, divergence_B_T >= -delta_low
        else:
            up_ok = (divergence_B_T <= delta_high) | ~moved_up_B_T
            down_ok = (divergence_B_T <= delta_low) | moved_up_B_T
        return torch.where(adv_B_T > 0, up_ok, down_ok).float()


def dppo_loss(logp_B_T: Tensor, behaviour_logp_B_T: Tensor, adv_B_T: Tensor, keep_B_T: Tensor,
              ratio_cap: float | None) -> Tensor:
    """DPPO's per-token loss (Divergence PPO, Qi et al. 2026; prime-rl's objective for off-policy
    samples).  §3, §5.

        L_t = -A_t * sg(min(pi(y_t) / mu(y_t), C)) * log pi(y_t) * M_t

    mu is what sampled the token; the weight is the importance ratio, truncated at C, with no
    gradient through it, so grad L_t = -A_t min(rho_t, C) grad log pi: PPO's gradient wherever the
    mask M_t (`dppo_keep`) keeps the token. The trust region is a bound on the divergence of the
    token's probability, not on its ratio: a rare token (mu = 0.01) may move to 0.05 (ratio 5)
    while a likely one (0.9) may not fall to 0.6 (ratio 0.67)."""
    rho = (logp_B_T - behaviour_logp_B_T).detach().clamp(max=_MAX_LOG_RATIO).exp()
    if ratio_cap is not None:
        rho = rho.clamp(max=ratio_cap)
    return -adv_B_T * rho * logp_B_T * keep_B_T


def _dppo(kind: str) -> PolicyObjective:
    def objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
        mu = x.old_logp_B_T if x.behaviour_logp_B_T is None else x.behaviour_logp_B_T
        logp = x.logp_B_T.detach()
        divergence = binary_tv(logp, mu) if kind == "tv" else binary_kl(logp, mu)
        moved_up = logp > mu
        keep = dppo_keep(divergence, moved_up, x.adv_B_T, p.dppo_delta_low, p.dppo_delta_high,
                         signed=kind == "tv")
        loss = dppo_loss(x.logp_B_T, mu, x.adv_B_T, keep, p.dppo_ratio_cap)
        m = x.mask_B_T.float()
        out = (keep == 0) & (m > 0)
        sides = (out & (x.adv_B_T > 0)).to(torch.int8) - (out & (x.adv_B_T < 0)).to(torch.int8)
        metrics = {"policy/dppo_divergence": masked_mean(divergence.abs(), m),
                   "policy/dppo_masked_frac": masked_mean(1.0 - keep, m),
                   **clip_fractions(sides, m)}
        return PolicyTerm(loss, metrics, sides)
    objective.__doc__ = f"DPPO with the binary {kind.upper()} divergence (`dppo_loss`).  §3, §5."
    return objective


# DPPO reads mu, the sampler's own log-probs, and weights by pi / mu itself: no other correction
# is applied on top (rl/loss_terms.py::update_terms)
POLICY_LOSSES.register("dppo_tv", reads=frozenset({"behaviour_logp"}), corrects=True)(_dppo("tv"))
POLICY_LOSSES.register("dppo_kl", reads=frozenset({"behaviour_logp"}), corrects=True)(_dppo("kl"))
