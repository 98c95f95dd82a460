"""Tinker's built-in losses, each one of posttrain's per-token formulas (losses/policy.py), summed
over the datum's positions as Tinker sums them (no mean: the client weights tokens through its
`weights` or `advantages`). Position i of a datum predicts `target_tokens[i]`; `logp` below are
those targets' log-probs under the training client's current weights.

    cross_entropy        -sum w_t logp_t                        (vanilla_pg_loss with A = w)
    importance_sampling  -sum exp(logp_t - s_t) A_t             (importance_sampled_pg_loss)
    ppo                  -sum min(r A, clip(r, lo, hi) A)       (clipped_surrogate_loss)
    cispo                -sum sg[clip(r, lo, hi)] A logp        (cispo_loss)
    dro                  -sum (A logp - beta/2 (logp - s)^2)    (dro_loss)
    gspo                 GSPO-token over `sequence_ratio_mask`  (gspo_loss, token_level)

`s` are the sampler's log-probs (`logprobs`), r = exp(logp - s). `lo` and `hi` are Tinker's ratio
bounds (`clip_low_threshold`, `clip_high_threshold`: 0.8 and 1.2 unless the request sets them),
posttrain's eps_low = 1 - lo and eps_high = hi - 1. `stable_reinforce` is refused: its formula is
not published (the SDK names a `kl_coeff` and provenance spans, no more).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from posttrain.losses.policy import (cispo_loss, clipped_surrogate_loss, dro_loss, gspo_loss,
                                     importance_sampled_pg_loss, vanilla_pg_loss)
from posttrain.util.registry import Registry

TinkerLoss = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]
TINKER_LOSSES: Registry[TinkerLoss] = Registry("Tinker loss")

REFUSED = {
    "stable_reinforce": "its server-side formula is not published; use importance_sampling or "
                        "ppo (tinker-cookbook: loss_fn=importance_sampling)",
    "custom": "server-side custom losses are not served; forward_backward_custom runs your loss "
              "on the client over cross_entropy, which is served",
}
INPUTS = {"cross_entropy": ("target_tokens", "weights")}   # the rest: target_tokens, logprobs, advantages


def needed_inputs(loss_fn: str) -> tuple[str, ...]:
    return INPUTS.get(loss_fn, ("target_tokens", "logprobs", "advantages"))


def _eps(config: dict[str, float]) -> dict[str, float]:
    """Tinker's ratio bounds as posttrain's clip widths."""
    return {"clip_low": 1.0 - config.get("clip_low_threshold", 0.8),
            "clip_high": config.get("clip_high_threshold", 1.2) - 1.0}


@TINKER_LOSSES.register("cross_entropy")
def cross_entropy(logp: Tensor, x: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-w_t logp_t: weighted negative log-likelihood (REINFORCE's term with the weight as A)."""
    return vanilla_pg_loss(logp, logp.detach(), x["weights"])


@TINKER_LOSSES.register("importance_sampling")
def importance_sampling(logp: Tensor, x: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    return importance_sampled_pg_loss(logp, x["logprobs"], x["advantages"])


@TINKER_LOSSES.register("ppo")
def ppo(logp: Tensor, x: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    return clipped_surrogate_loss(logp, x["logprobs"], x["advantages"], **_eps(config))


@TINKER_LOSSES.register("cispo")
def cispo(logp: Tensor, x: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    return cispo_loss(logp, x["logprobs"], x["advantages"], **_eps(config))


@TINKER_LOSSES.register("dro")
def dro(logp: Tensor, x: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    if "beta" not in config:
        raise ValueError("loss_fn 'dro' needs loss_fn_config {'beta': ...} (the penalty's weight)")
    return dro_loss(logp, x["logprobs"], x["advantages"], beta=config["beta"])


@TINKER_LOSSES.register("gspo")
def gspo(logp: Tensor, x: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """GSPO-token: the sequence ratio over the positions `sequence_ratio_mask` marks (without
    one: those with an advantage, the sampled tokens; the prompt's carry none), each token's
    own advantage."""
    mask = x.get("sequence_ratio_mask")
    mask = (mask if mask is not None else (x["advantages"] != 0).float())[None]
    return gspo_loss(logp[None], x["logprobs"][None], x["advantages"][None], mask,
                     token_level=True, **_eps(config))[0] * mask[0]


PER_TOKEN_BOUNDS = ("clip_low_threshold", "clip_high_threshold")


def check_inputs(loss_fn: str, inputs: dict) -> None:
    """Ratio bounds given per token (the SDK allows it) are refused: they are read from
    loss_fn_config only."""
    given = [k for k in PER_TOKEN_BOUNDS if k in inputs]
    if given:
        raise ValueError(f"loss_fn_inputs {given}: per-token ratio bounds are not served; set "
                         f"them once in loss_fn_config")


NEEDED_CONFIG = {"dro": "beta"}   # loss_fn_config a loss cannot run without


def check_config(loss_fn: str, config: dict[str, float]) -> None:
    """The loss_fn_config entries the loss needs are there (checked before a batch runs)."""
    if loss_fn in NEEDED_CONFIG and NEEDED_CONFIG[loss_fn] not in config:
        raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_config "
                         f"{{'{NEEDED_CONFIG[loss_fn]}': ...}} (the penalty's weight)")


def check_loss(loss_fn: str) -> TinkerLoss:
    """The loss `loss_fn` names, or one line saying why it is not served."""
    if loss_fn in REFUSED:
        raise ValueError(f"loss_fn {loss_fn!r} is not served by posttrain: {REFUSED[loss_fn]}")
    if loss_fn not in TINKER_LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; served: {TINKER_LOSSES.names()}")
    return TINKER_LOSSES[loss_fn]
