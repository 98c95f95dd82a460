"""Drift from `pi_old` (`ratio_stats`), and the importance weights that correct for samples drawn by
another engine (`OFF_POLICY_CORRECTIONS`: truncated and masked IS, per token or per sequence).  §3, §5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses.common import _MAX_LOG_RATIO, masked, masked_mean
from posttrain.util.registry import Registry


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
