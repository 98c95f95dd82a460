"""Every per-token quantity the lecture trains on, as small pure functions on tensors.

Shape suffixes: `_B` responses (B = P * G), `_T` response tokens, `_V` vocabulary, `_N` any
flattened positions. `mask_B_T` is 1 on response tokens and 0 on padding. Nothing here calls
`.item()`: metrics come back as tensors and the trainer syncs once per step.

Sections refer to docs/algorithms.md (`§N`), which states each formula and names the lecture section.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.registry import Registry

# Rows of logits converted to float32 at a time when the input is half precision: bounds the
# temporary copy to CHUNK x V floats instead of a full-batch float32 copy of the logits.
_CHUNK = 1024


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x * mask, with masked positions set to 0 *before* multiplying: 0 x NaN is NaN, so a
    non-finite value where the mask is 0 (padding, an engine's filler) would otherwise poison
    the whole sum. Every masked sum and mean of the package goes through here."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * m) / max(sum(m), 1) over the unmasked positions, a tensor (no host sync)."""
    return masked(x, mask).sum() / mask.sum().clamp(min=1)


def _rowwise_float(fn: Callable[[Tensor], Tensor], logits_N_V: Tensor) -> Tensor:
    """Apply `fn` to float32 rows of `logits_N_V`, in chunks when the input is not float32."""
    if logits_N_V.dtype in (torch.float32, torch.float64):
        return fn(logits_N_V)
    flat = logits_N_V.reshape(-1, logits_N_V.shape[-1])
    out = torch.cat([fn(chunk.float()) for chunk in flat.split(_CHUNK)])
    return out.reshape(logits_N_V.shape[:-1] + out.shape[1:])


# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy (§2, notation)
# ---------------------------------------------------------------------------------------------

def token_logprobs(logits_N_V: Tensor, tokens_N: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of the chosen tokens.  docs/algorithms.md notation, §2.

        logp_t = z_t[y_t] / tau - logsumexp_v(z_t[v] / tau)

    Shapes: logits (..., V), tokens (...) -> (...) float32. Uses gather + logsumexp, so no
    full-vocabulary log-softmax copy is kept per position (only the (...,) results are). The
    temperature must match the one used for sampling, or `pi_old` and `pi_theta` disagree.
    """
    def rows(z: Tensor, tok: Tensor) -> Tensor:
        if z.dtype != torch.float64:
            z = z.float()  # no-op for float32; a bounded chunk copy for half precision
        if temperature != 1.0:
            z = z / temperature
        return z.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)

    tokens_N = tokens_N.long()
    if logits_N_V.dtype in (torch.float32, torch.float64):
        return rows(logits_N_V, tokens_N)
    flat = logits_N_V.reshape(-1, logits_N_V.shape[-1])
    flat_tok = tokens_N.reshape(-1)
    out = [rows(flat[i:i + _CHUNK], flat_tok[i:i + _CHUNK]) for i in range(0, len(flat), _CHUNK)]
    return torch.cat(out).reshape(tokens_N.shape)


def entropy_from_logits(logits_N_V: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the next-token distribution.  §7 (Clip-Higher keeps it from collapsing).

        H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v,   p = softmax(z / tau)

    Shapes: (..., V) -> (...) float32.
    """
    def rows(z: Tensor) -> Tensor:
        if temperature != 1.0:
            z = z / temperature
        p = torch.softmax(z, dim=-1)
        return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return _rowwise_float(rows, logits_N_V)


def sequence_logprob(logp_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """log pi(y|x) = sum_t logp_t over response tokens.  §2.  (B, T) -> (B,)."""
    return masked(logp_B_T, mask_B_T).sum(-1)


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
# frozen pass that no term reads (update.frozen_inputs).
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


def centred_covariance(logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Per-token (log pi(y_t) - mean log pi) (A_t - mean A) over the masked tokens (no gradient):
    the token's share of Cov(log pi, A), whose sum drives the entropy change of a policy-gradient
    step (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").  §11."""
    with torch.no_grad():
        m = mask_B_T.float()
        lp, a = logp_B_T.detach().float(), adv_B_T.float()
        return (lp - masked_mean(lp, m)) * (a - masked_mean(a, m)) * m


def clip_cov_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
                  generator: torch.Generator | None, *, clip_low: float, clip_high: float,
                  frac: float, cov_low: float, cov_high: float) -> Tensor:
    """Clip-Cov (Cui et al. 2025), per token.  §11.

        C = { tokens with cov_low < cov_t < cov_high that PPO's clip left alone },
        pick max(1, floor(frac * n_tokens)) of C at random;   L_t = clipped_t * (t not picked)

    The picked tokens' gradients are removed: a few high-covariance tokens (confident and
    rewarded) drive the entropy collapse, and detaching them keeps entropy up at almost no cost.
    """
    clipped = clipped_surrogate_loss(logp_B_T, old_logp_B_T, adv_B_T, clip_low=clip_low,
                                     clip_high=clip_high)
    # (the means, the count and the draw are over the micro-batch the loss sees, as verl's; so the
    # picked tokens depend on optim.micro_batch_size)
    with torch.no_grad():
        unclipped = -torch.exp(logp_B_T - old_logp_B_T) * adv_B_T
        cov = centred_covariance(logp_B_T, adv_B_T, mask_B_T)
        band = (cov > cov_low) & (cov < cov_high) & (mask_B_T > 0) & (clipped <= unclipped)
        idx = band.flatten().nonzero().squeeze(-1)
        n = max(1, int(frac * float(mask_B_T.sum())))
        pick = idx[torch.randperm(len(idx), generator=generator)[:n]]
        keep = torch.ones(mask_B_T.numel(), dtype=clipped.dtype, device=clipped.device)
        keep[pick] = 0.0
    return clipped * keep.view_as(clipped)


@POLICY_LOSSES.register("clip_cov")
def clip_cov_objective(x: PolicyInputs, p: ObjectiveParams) -> PolicyTerm:
    """Clip-Cov (`clip_cov_loss`) on the clipped surrogate.  §11."""
    loss = clip_cov_loss(x.logp_B_T, x.old_logp_B_T, x.adv_B_T, x.mask_B_T, x.generator,
                         clip_low=p.clip_low, clip_high=p.clip_high, frac=p.cov_frac,
                         cov_low=p.cov_low, cov_high=p.cov_high)
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


@dataclass(frozen=True)
class RatioStats:
    """Drift of the update from `pi_old` (tensors; the trainer syncs them)."""

    approx_kl_old: Tensor    # k3 estimate of KL(pi_old || pi_theta)
    ratio_mean: Tensor
    ratio_max: Tensor
    ratio_min: Tensor


def ratio_stats(logp_B_T: Tensor, old_logp_B_T: Tensor, mask_B_T: Tensor) -> RatioStats:
    """Drift from `pi_old`, whatever the objective.  §5.

    approx_kl = mean(rho - 1 - log rho), the k3 estimator of KL(pi_old || pi_theta) from samples
    of pi_old; the ratio's mean, max and min over the masked tokens.
    """
    with torch.no_grad():
        log_ratio = (logp_B_T - old_logp_B_T).float()
        ratio = log_ratio.exp()
        mask = mask_B_T.float()
        big = torch.finfo(ratio.dtype).max
        return RatioStats(
            approx_kl_old=masked_mean(ratio - 1.0 - log_ratio, mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_max=torch.where(mask > 0, ratio, -big).max(),
            ratio_min=torch.where(mask > 0, ratio, big).min(),
        )


def truncated_is_weights(trainer_logp_B_T: Tensor, engine_logp_B_T: Tensor,
                         cap: float) -> Tensor:
    """Truncated importance weights for samples drawn by another engine (vLLM).  §3.

        w_t = min( pi_old^trainer(y_t) / pi_old^engine(y_t), C )      (no gradient)

    The engine samples with its own kernels, so its probabilities differ slightly from the
    trainer's for the very same weights: the batch is then a little off-policy. Multiplying each
    token's policy-gradient term by w_t corrects for it (§3's importance sampling); the cap C bounds
    the variance a rare large ratio would add (Yao et al. 2025, "truncated IS").
    """
    log_ratio = (trainer_logp_B_T - engine_logp_B_T).detach().float()
    return log_ratio.clamp(max=_MAX_LOG_RATIO).exp().clamp(max=cap)


def sequence_is_weights(trainer_logp_B_T: Tensor, engine_logp_B_T: Tensor, mask_B_T: Tensor,
                        cap: float) -> Tensor:
    """Sequence-level truncated IS: one weight per response, on each of its tokens.  §3.

        w_i = min( prod_t pi_trainer(y_t) / pi_engine(y_t), C )      (no gradient)

    The correction for the whole sequence's probability, not each token's: unbiased for the
    sequence-level gradient before the cap, with more variance than the token form."""
    log_ratio = masked((trainer_logp_B_T - engine_logp_B_T).detach().float(), mask_B_T).sum(-1, keepdim=True)
    return log_ratio.clamp(max=_MAX_LOG_RATIO).exp().clamp(max=cap).expand_as(trainer_logp_B_T)


def _in_band(ratio: Tensor, band: tuple[float, float]) -> Tensor:
    return ((ratio >= band[0]) & (ratio <= band[1])).to(ratio.dtype)


def masked_is_weights(trainer_logp_B_T: Tensor, engine_logp_B_T: Tensor, mask_B_T: Tensor,
                      band: tuple[float, float], sequence: bool = False) -> Tensor:
    """Masked IS: the importance ratio where it lies inside `band`, 0 outside.  §3.

        w_t = rho_t * 1[lo <= rho_t <= hi],   rho_t = pi_trainer(y_t) / pi_engine(y_t)
        (sequence=True: rho_i = prod_t rho_t, on each token of row i)

    Instead of capping a far-off token (or sequence), drop it: its sample says little about the
    trainer's policy (a sampler bug, a precision cliff). Token-level, this is IcePop (Ling Team
    2025, Ring-1T), whose band is [0.5, 5]."""
    log_ratio = (trainer_logp_B_T - engine_logp_B_T).detach().float()
    if sequence:
        log_ratio = masked(log_ratio, mask_B_T).sum(-1, keepdim=True).expand_as(trainer_logp_B_T)
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    return ratio * _in_band(ratio, band)




CorrectionFn = Callable[[Tensor, Tensor, Tensor, float, tuple[float, float]], Tensor]
OFF_POLICY_CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")
OFF_POLICY_CORRECTIONS.register("token_tis")(
    lambda trainer, engine, mask, cap, band: truncated_is_weights(trainer, engine, cap))
OFF_POLICY_CORRECTIONS.register("seq_tis")(
    lambda trainer, engine, mask, cap, band: sequence_is_weights(trainer, engine, mask, cap))
OFF_POLICY_CORRECTIONS.register("token_mis")(
    lambda trainer, engine, mask, cap, band: masked_is_weights(trainer, engine, mask, band))
OFF_POLICY_CORRECTIONS.register("seq_mis")(
    lambda trainer, engine, mask, cap, band: masked_is_weights(trainer, engine, mask, band, True))
# IcePop (Ling Team 2025, Ring-1T): M(k) = k inside [alpha, beta], 0 outside: token masked IS,
# the paper's band [0.5, 5] (--rollout.is_band 0.5,5)
OFF_POLICY_CORRECTIONS.register("icepop")(
    lambda trainer, engine, mask, cap, band: masked_is_weights(trainer, engine, mask, band))


# ---------------------------------------------------------------------------------------------
# Loss aggregation (§6, §7): per-token weights, so the length bias is visible in one tensor
# ---------------------------------------------------------------------------------------------

AggregationFn = Callable[[Tensor, float], Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """GRPO: 1/G sum_i 1/|o_i| sum_t.  §6.  Weight of a token of response i: 1 / (B |o_i|).

    A token of a long response weighs less than one of a short response: the length bias of §7.
    An empty response (|o_i| = 0) has no tokens, gets no weight and is not counted in B (the
    mean is over the responses that have a token), so the weights always sum to 1.
    """
    lengths_B = mask_B_T.sum(-1, keepdim=True)
    rows = (lengths_B > 0).sum().clamp(min=1)
    return mask_B_T / lengths_B.clamp(min=1) / rows


@AGGREGATIONS.register("token_mean")
def token_mean_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """DAPO: 1 / sum_i |o_i| * sum_i sum_t.  §7.  Every token weighs the same, 1 / sum_i |o_i|."""
    return mask_B_T / mask_B_T.sum().clamp(min=1)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """Dr. GRPO: 1/G sum_i sum_t (...) / L_max.  §7.  Weight 1 / (B L_max), a constant."""
    return mask_B_T / (mask_B_T.shape[0] * max_len)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """REINFORCE: sum_t over the sequence (the gradient of log pi(y|x)), mean over the batch.  §2.

    Weight 1 / B; the scale of the update grows with response length.
    """
    return mask_B_T / mask_B_T.shape[0]


def aggregate(loss_B_T: Tensor, weights_B_T: Tensor) -> Tensor:
    """sum_{i,t} w_it L_it.  Weights come from AGGREGATIONS over the whole optimizer batch, so a
    batch split into micro-batches for gradient accumulation sums to exactly the same loss."""
    return masked(loss_B_T, weights_B_T).sum()


# ---------------------------------------------------------------------------------------------
# KL to the reference policy (§4, §5, §6)
# ---------------------------------------------------------------------------------------------

KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator")

# exp() of a log-ratio above this overflows float32; such a token is already far off-policy.
_MAX_LOG_RATIO = 20.0
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


# ---------------------------------------------------------------------------------------------
# Value model (§5)
# ---------------------------------------------------------------------------------------------

def value_loss(values_B_T: Tensor, old_values_B_T: Tensor, returns_B_T: Tensor,
               clip_range: float | None = None) -> tuple[Tensor, Tensor]:
    """Value regression on the returns, optionally clipped around the old prediction.  §5.

        L_t = 0.5 (V_t - G_t)^2
        clipped: L_t = 0.5 max( (V_t - G_t)^2, (V_old + clip(V_t - V_old, -c, c) - G_t)^2 )

    Returns (loss_B_T, clipped_B_T) where clipped marks tokens whose clipped branch was taken.
    """
    unclipped = (values_B_T - returns_B_T) ** 2
    if clip_range is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clipped = old_values_B_T + (values_B_T - old_values_B_T).clamp(-clip_range, clip_range)
    clipped = (v_clipped - returns_B_T) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values_B_T: Tensor, returns_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """1 - Var[G - V] / Var[G] over response tokens: 1 is a perfect critic, <= 0 a useless one."""
    var_ret = masked_mean((returns_B_T - masked_mean(returns_B_T, mask_B_T)) ** 2, mask_B_T)
    diff = returns_B_T - values_B_T
    var_diff = masked_mean((diff - masked_mean(diff, mask_B_T)) ** 2, mask_B_T)
    return 1.0 - var_diff / var_ret.clamp(min=1e-8)


# ---------------------------------------------------------------------------------------------
# On-policy distillation (§8)
# ---------------------------------------------------------------------------------------------

def sampled_reverse_kl(logp_B_T: Tensor, teacher_logp_B_T: Tensor) -> Tensor:
    """Per-token sampled estimate of KL(pi_theta || pi_T) at the student's own tokens.  §8.

        kl_t = log pi_theta(y_t | x, y_<t) - log pi_T(y_t | x, y_<t),    y_t ~ pi_theta

    Unbiased for the exact per-position reverse KL because y_t is drawn from the student.
    """
    return logp_B_T - teacher_logp_B_T


def distillation_advantage(logp_B_T: Tensor, teacher_logp_B_T: Tensor, mask_B_T: Tensor,
                           coef: float = 1.0) -> Tensor:
    """The negated sampled reverse KL as a dense per-token advantage.  §8.

        A_t = -coef * (log pi_theta(y_t) - log pi_T(y_t))     (no gradient through A_t)

    Fed to the usual policy-gradient loss, it pushes each token toward the teacher's preference.
    """
    return -coef * masked(sampled_reverse_kl(logp_B_T, teacher_logp_B_T).detach(), mask_B_T)


def reverse_kl_from_logits(student_logits_N_V: Tensor, teacher_logits_N_V: Tensor,
                           temperature: float = 1.0) -> Tensor:
    """Exact per-position reverse KL(pi_theta || pi_T) over the vocabulary.  §8 (mode-seeking)."""
    return exact_kl_from_logits(student_logits_N_V, teacher_logits_N_V, temperature)


def forward_kl_from_logits(student_logits_N_V: Tensor, teacher_logits_N_V: Tensor,
                           temperature: float = 1.0) -> Tensor:
    """Exact per-position forward KL(pi_T || pi_theta) on the student's own samples.  §8.

        KL_t = sum_v pi_T(v) (log pi_T(v) - log pi_theta(v)),   dKL_t / dz_v = (pi_theta(v) - pi_T(v)) / tau

    (GKD's beta = 0 on on-policy samples; mode-covering.) Where the student is confidently wrong
    (pi_theta(v*) ~ 1, pi_T(v*) ~ 0) the reverse KL's gradient pi_theta (log pi_theta / pi_T - KL)
    vanishes with the student's mass off v*, while this one stays of order one.
    """
    return exact_kl_from_logits(teacher_logits_N_V, student_logits_N_V, temperature)


@dataclass(frozen=True)
class DistillLoss:
    """How a teacher enters the update (§8); the registry key is `algorithm.distill_loss`.

    `in_advantage`: the sampled reverse KL of the student's tokens becomes a dense advantage
    (the teacher's log-probs of the sampled tokens are computed once per batch, before the update).
    `token_loss(logits, teacher_logits, tau) -> (loss_B_T, reverse_kl_B_T)`: a full-vocabulary
    loss per position added to the policy loss, with the exact reverse KL (no gradient) to log;
    the update then runs the teacher on every micro-batch for its logits.
    """

    in_advantage: bool
    token_loss: Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]] | None = None


def _exact_reverse_kl_loss(logits: Tensor, teacher_logits: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    kl = reverse_kl_from_logits(logits, teacher_logits, tau)
    return kl, kl.detach()


def _forward_kl_loss(logits: Tensor, teacher_logits: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    return (forward_kl_from_logits(logits, teacher_logits, tau),
            reverse_kl_from_logits(logits.detach(), teacher_logits, tau))


DISTILL_LOSSES: Registry[DistillLoss] = Registry("distillation loss")
# 'sampled': -(logp_S - logp_T) of the sampled tokens as a dense advantage (cheap, any teacher)
DISTILL_LOSSES.register("sampled")(DistillLoss(in_advantage=True))
# 'exact': the full-vocabulary reverse KL at every position as the loss (lower variance)
DISTILL_LOSSES.register("exact")(DistillLoss(in_advantage=False, token_loss=_exact_reverse_kl_loss))
# 'forward': KL(teacher || student) at the student's positions (its gradient survives where the
# student is confidently wrong); the reverse KL is still logged
DISTILL_LOSSES.register("forward")(DistillLoss(in_advantage=False, token_loss=_forward_kl_loss))


# ---------------------------------------------------------------------------------------------
# Preference losses (§1, §9) and SFT
# ---------------------------------------------------------------------------------------------

def bradley_terry_loss(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Bradley-Terry reward-model loss per pair.  §1.

        L = -log sigmoid( r(x, y_chosen) - r(x, y_rejected) )    (softplus form: stable)
    """
    return F.softplus(rejected_scores - chosen_scores)


def pairwise_accuracy(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Share of pairs ranked correctly, r(chosen) > r(rejected).  §1."""
    return (chosen_scores > rejected_scores).float().mean()


@dataclass(frozen=True)
class DPOOutput:
    loss: Tensor              # per pair
    chosen_rewards: Tensor    # beta * log pi_theta(y_w|x) / pi_ref(y_w|x)
    rejected_rewards: Tensor  # beta * log pi_theta(y_l|x) / pi_ref(y_l|x)


def dpo_loss(chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor,
             ref_rejected_logp: Tensor, beta: float) -> DPOOutput:
    """Direct Preference Optimization on sequence log-probabilities.  §9.

        L = -log sigmoid( beta [ log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l) ] )

    The implicit rewards beta log pi/pi_ref are returned for accuracy and margin metrics.
    """
    chosen_rewards = beta * (chosen_logp - ref_chosen_logp)
    rejected_rewards = beta * (rejected_logp - ref_rejected_logp)
    return DPOOutput(F.softplus(rejected_rewards - chosen_rewards),
                     chosen_rewards.detach(), rejected_rewards.detach())


def sft_loss(logp_B_T: Tensor, mask_B_T: Tensor, n_tokens: float | Tensor | None = None) -> Tensor:
    """Negative log-likelihood of the response tokens, mean over tokens.  §8 (SFT warm-up).

        L = - sum_{i,t} m_it log pi(y_it | x_i, y_i,<t) / N,   N = sum m  (or `n_tokens`: the
                                                               global batch's count, when the
                                                               rows are one rank's share)
    """
    if n_tokens is None:
        return -masked_mean(logp_B_T, mask_B_T)
    return -masked(logp_B_T, mask_B_T).sum() / n_tokens
