"""Every per-token quantity the lecture trains on, as small pure functions on tensors.

Shape suffixes: `_B` responses (B = P * G), `_T` response tokens, `_V` vocabulary, `_N` any
flattened positions. `mask_B_T` is 1 on response tokens and 0 on padding. Nothing here calls
`.item()`: metrics come back as tensors and the trainer syncs once per step.

Sections refer to docs/algorithms.md (`§N`), which states each formula and names the lecture section.
"""

from __future__ import annotations

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
# Policy losses (§2, §3, §5); one signature so the trainer dispatches with one lookup
# ---------------------------------------------------------------------------------------------

PolicyLossFn = Callable[..., Tensor]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


@POLICY_LOSSES.register("vanilla")
def vanilla_pg_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, *,
                    clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None) -> Tensor:
    """REINFORCE / vanilla policy gradient, per token.  §2.

        L_t = -A_t * logp_t        (grad L = -A grad log pi: "reward-weighted SFT")

    Needs on-policy samples; `old_logp` and the clip arguments are ignored.
    """
    return -adv_B_T * logp_B_T


@POLICY_LOSSES.register("importance_sampled")
def importance_sampled_pg_loss(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, *,
                               clip_low: float = 0.2, clip_high: float = 0.2,
                               dual_clip: float | None = None) -> Tensor:
    """Importance-sampled policy gradient, per token.  §3.

        L_t = -rho_t * A_t,   rho_t = exp(logp_t - old_logp_t)

    grad L = -rho A grad log pi: unbiased for samples drawn from `pi_old`, but unbounded.
    """
    return -torch.exp(logp_B_T - old_logp_B_T) * adv_B_T


@POLICY_LOSSES.register("clipped")
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


@dataclass(frozen=True)
class RatioStats:
    """Diagnostics of the update against `pi_old` (tensors; the trainer syncs them)."""

    clip_frac_low: Tensor    # share of tokens whose gradient the low side of the clip removed
    clip_frac_high: Tensor   # ... the high side
    approx_kl_old: Tensor    # k3 estimate of KL(pi_old || pi_theta)
    ratio_mean: Tensor
    ratio_max: Tensor
    ratio_min: Tensor


def ratio_stats(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
                clip_low: float, clip_high: float) -> RatioStats:
    """Clip fractions and drift from `pi_old`.  §5.

    A token is clipped on the low side when A < 0 and rho < 1 - eps_low (its gradient is then
    zero), on the high side when A > 0 and rho > 1 + eps_high. approx_kl = mean(rho - 1 - log rho),
    the k3 estimator of KL(pi_old || pi_theta) from samples of pi_old.
    """
    with torch.no_grad():
        log_ratio = (logp_B_T - old_logp_B_T).float()
        ratio = log_ratio.exp()
        mask = mask_B_T.float()
        low = ((ratio < 1.0 - clip_low) & (adv_B_T < 0)).float()
        high = ((ratio > 1.0 + clip_high) & (adv_B_T > 0)).float()
        big = torch.finfo(ratio.dtype).max
        return RatioStats(
            clip_frac_low=masked_mean(low, mask),
            clip_frac_high=masked_mean(high, mask),
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


# ---------------------------------------------------------------------------------------------
# Loss aggregation (§6, §7): per-token weights, so the length bias is visible in one tensor
# ---------------------------------------------------------------------------------------------

AggregationFn = Callable[[Tensor, float], Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """GRPO: 1/G sum_i 1/|o_i| sum_t.  §6.  Weight of a token of response i: 1 / (B |o_i|).

    A token of a long response weighs less than one of a short response: the length bias of §7.
    An empty response (|o_i| = 0) has no tokens and gets no weight.
    """
    lengths_B = mask_B_T.sum(-1, keepdim=True).clamp(min=1)
    return mask_B_T / lengths_B / mask_B_T.shape[0]


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
    """k1 = log(pi / pi_ref).  §6.  Unbiased for KL(pi || pi_ref) under y ~ pi; can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 (log(pi / pi_ref))^2.  §6.  Biased, >= 0, low variance; its gradient is that of
    the true KL to first order."""
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
    overflows near 88)."""
    log_r = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.exp(log_r) - log_r - 1.0
    return k3 if cap is None else k3.clamp(max=cap)


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
