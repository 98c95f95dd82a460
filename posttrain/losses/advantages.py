"""Advantage estimators: how much better than expected each response (or token) was.

docs/algorithms.md §2 (REINFORCE, baselines, RLOO), §5 (GAE), §6 (GRPO), §7 (Dr. GRPO).
The pure functions take tensors; the registry `ADVANTAGES` wraps them behind one signature,
`fn(AdvantageInputs, AdvantageParams) -> Advantages`, so the trainer dispatches with one lookup.
Shapes: `_P` prompts, `_G` responses per prompt, `_B` = P * G responses, `_T` response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.util.registry import Registry

# ---------------------------------------------------------------------------------------------
# Outcome advantages: one number per response (§2, §6, §7)
# ---------------------------------------------------------------------------------------------


def reinforce_advantage(rewards_P_G: Tensor) -> Tensor:
    """REINFORCE without a baseline: A_i = R_i.  §2 (Williams 1992)."""
    return rewards_P_G.clone()


def batch_mean_baseline_advantage(rewards_P_G: Tensor) -> Tensor:
    """REINFORCE with the batch mean as baseline: A_i = R_i - mean_batch(R).  §2.

    The baseline uses the sample itself, so it is very slightly biased (by 1/B); the leave-one-out
    form `rloo_advantage` is the exactly unbiased version.
    """
    return rewards_P_G - rewards_P_G.mean()


def group_mean_baseline_advantage(rewards_P_G: Tensor) -> Tensor:
    """REINFORCE with a per-prompt baseline: A_i = R_i - mean_j R_j over the prompt's group.  §2."""
    return rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)


def rloo_advantage(rewards_P_G: Tensor) -> Tensor:
    """REINFORCE leave-one-out (RLOO).  §2.

        A_i = R_i - 1/(G-1) sum_{j != i} R_j  =  G/(G-1) (R_i - mean_j R_j)

    The baseline does not depend on y_i, so the estimator stays exactly unbiased. Needs G >= 2.
    """
    G = rewards_P_G.shape[1]
    if G < 2:
        raise ValueError(f"RLOO needs at least 2 responses per prompt, got group size {G}")
    return (rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)) * (G / (G - 1))


def grpo_advantage(rewards_P_G: Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> Tensor:
    """Group-relative advantage.  §6 (GRPO), §7 (Dr. GRPO when scale_by_std=False).

        A_i = (R_i - mean_j R_j) / (std_j R_j + eps)        GRPO
        A_i =  R_i - mean_j R_j                              Dr. GRPO

    std is the unbiased one (divisor G-1), as in verl and TRL; eps sits outside the root. A group
    whose rewards are all equal gives exactly 0 (numerator 0, denominator eps): no NaN.
    """
    centred = rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    if rewards_P_G.shape[1] < 2:
        raise ValueError("GRPO's std needs at least 2 responses per prompt")
    return centred / (rewards_P_G.std(dim=1, keepdim=True) + eps)


def excluding_unscored(fn: Callable[[Tensor], Tensor], rewards_P_G: Tensor,
                       scored_P_G: Tensor | None, per_group: bool = True) -> Tensor:
    """An outcome estimator as if the responses nobody could score (an LLM judge's outage) had
    never been sampled: each group's estimator over its scored members alone (per_group; a group
    with fewer than 2 has no baseline and gets 0), or a batch estimator over every scored
    response; unscored responses get 0. With every response scored this is `fn(rewards_P_G)`.

        A_i = fn({R_j : j in group, scored_j})_i   for scored i,   A_i = 0 otherwise
    """
    if scored_P_G is None or bool(scored_P_G.all()):
        return fn(rewards_P_G)
    out = torch.zeros_like(rewards_P_G)
    if not per_group:
        out[scored_P_G] = fn(rewards_P_G[scored_P_G][None])[0]
        return out
    for p in range(rewards_P_G.shape[0]):
        keep = scored_P_G[p]
        if int(keep.sum()) >= 2:
            out[p, keep] = fn(rewards_P_G[p, keep][None])[0]
    return out


# ---------------------------------------------------------------------------------------------
# Token-level advantages from a value model (§5)
# ---------------------------------------------------------------------------------------------


def gae(token_rewards_B_T: Tensor, values_B_T: Tensor, mask_B_T: Tensor,
        gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over masked token sequences.  §5.

        delta_t = r_t + gamma V_{t+1} - V_t
        A_t     = sum_l (gamma lambda)^l delta_{t+l}      = delta_t + gamma lambda A_{t+1}
        G_t     = A_t + V_t                               (the value model's regression target)

    Masked positions (mask 0: padding, or tool output inside a response) are skipped: the next
    *unmasked* position's value and advantage carry over them, and their own values never enter.
    After the last response token V = 0 (the episode ends). lambda=1 gives Monte Carlo returns
    minus V; lambda=0 gives the one-step TD error. Returns (advantages, returns), both zero on
    masked positions.
    """
    B, T = mask_B_T.shape
    mask = mask_B_T.to(values_B_T.dtype)
    next_value = torch.zeros(B, dtype=values_B_T.dtype, device=values_B_T.device)
    next_adv = torch.zeros_like(next_value)
    adv_B_T = torch.zeros_like(values_B_T)
    for t in reversed(range(T)):  # a recursion over time: T is small, B is vectorised
        m = mask[:, t]
        delta = token_rewards_B_T[:, t] + gamma * next_value - values_B_T[:, t]
        adv_t = delta + gamma * lam * next_adv
        adv_B_T[:, t] = adv_t * m
        next_adv = m * adv_t + (1 - m) * next_adv
        next_value = m * values_B_T[:, t] + (1 - m) * next_value
    return adv_B_T, (adv_B_T + values_B_T) * mask


def discounted_returns(token_rewards_B_T: Tensor, mask_B_T: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = sum_l gamma^l r_{t+l} over unmasked tokens.  §2, §5 (= GAE, V=0, lambda=1)."""
    adv, _ = gae(token_rewards_B_T, torch.zeros_like(token_rewards_B_T), mask_B_T, gamma, 1.0)
    return adv


def whiten(x_B_T: Tensor, mask_B_T: Tensor, shift_mean: bool = True, eps: float = 1e-8,
           total: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """(x - mean) / std over the masked tokens of the batch (PPO's advantage whitening).  §5.

        mean = sum_m x / n,   var = sum_m (x - mean)^2 / (n - 1),   out = (x - mean) / sqrt(var + eps)

    The variance is Bessel-corrected (n - 1), the convention of verl's and OpenRLHF's masked
    whitening and of torch.std; with one token it is the biased one (no division by 0).
    Positions outside the mask come out 0, whatever x held there. `total` sums a statistic over
    data-parallel ranks (identity on one process), so the mean and std are those of the global
    batch, as one process would compute them."""
    mask = mask_B_T.to(x_B_T.dtype)
    x = torch.where(mask != 0, x_B_T, torch.zeros((), dtype=x_B_T.dtype, device=x_B_T.device))
    n = total(mask.sum())
    mean = total((x * mask).sum()) / n.clamp(min=1)
    var = total((((x - mean) * mask) ** 2).sum()) / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


# ---------------------------------------------------------------------------------------------
# The registry: one signature for every estimator
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What a scored batch offers an estimator. Optional fields are checked by config validation
    (e.g. `gae` without a value model is refused before any model loads)."""

    rewards_P_G: Tensor                       # scalar score per response
    mask_B_T: Tensor                          # response tokens
    token_rewards_B_T: Tensor | None = None   # dense rewards (KL folded in, score on last token)
    values_B_T: Tensor | None = None          # value model predictions V(x, y_<t)
    old_logp_B_T: Tensor | None = None        # log pi_old of the sampled tokens (distillation)
    teacher_logp_B_T: Tensor | None = None    # log pi_T of the same tokens (distillation)
    scored_P_G: Tensor | None = None          # False: unscorable (left out; None: all scored)


@dataclass(frozen=True)
class AdvantageParams:
    eps: float = 1e-6
    scale_by_std: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    reward_weight: float = 0.0    # distillation: weight of the verifiable-reward group advantage
    kl_in_loss: bool = False      # distillation: the exact reverse KL is the loss; no KL advantage


@dataclass(frozen=True)
class Advantages:
    adv_B_T: Tensor
    returns_B_T: Tensor | None = None         # value targets, only for value-based estimators


AdvantageFn = Callable[[AdvantageInputs, AdvantageParams], Advantages]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

# Which estimators need a value model / a group of >= 2 responses (used by config validation).
NEEDS_VALUES = {"gae"}
NEEDS_GROUP = {"rloo", "group"}
NEEDS_TEACHER = {"reverse_kl"}


def _per_token(adv_P_G: Tensor, mask_B_T: Tensor) -> Tensor:
    """Every token of response i gets A_i.  (P, G) -> (B, T)."""
    return adv_P_G.reshape(-1, 1).to(mask_B_T.dtype) * mask_B_T


def _outcome_estimator(fn: Callable[[Tensor], Tensor], per_group: bool = True) -> AdvantageFn:
    """Wrap a parameter-free (P, G) -> (P, G) outcome estimator for the registry."""
    def estimator(inp: AdvantageInputs, p: AdvantageParams) -> Advantages:
        adv_P_G = excluding_unscored(fn, inp.rewards_P_G, inp.scored_P_G, per_group)
        return Advantages(_per_token(adv_P_G, inp.mask_B_T))
    estimator.__qualname__ = f"outcome[{fn.__name__}]"
    return estimator


for _name, _fn, _per_group in (("reinforce", reinforce_advantage, False),
                               ("batch_mean", batch_mean_baseline_advantage, False),
                               ("group_mean", group_mean_baseline_advantage, True),
                               ("rloo", rloo_advantage, True)):
    ADVANTAGES.register(_name)(_outcome_estimator(_fn, _per_group))


def _grpo(inp: AdvantageInputs, p: AdvantageParams) -> Tensor:
    return excluding_unscored(lambda r: grpo_advantage(r, p.eps, p.scale_by_std),
                              inp.rewards_P_G, inp.scored_P_G)


@ADVANTAGES.register("group")
def _group(inp: AdvantageInputs, p: AdvantageParams) -> Advantages:
    return Advantages(_per_token(_grpo(inp, p), inp.mask_B_T))


@ADVANTAGES.register("gae")
def _gae(inp: AdvantageInputs, p: AdvantageParams) -> Advantages:
    if inp.values_B_T is None or inp.token_rewards_B_T is None:
        raise ValueError("the 'gae' estimator needs values and per-token rewards")
    adv, ret = gae(inp.token_rewards_B_T, inp.values_B_T, inp.mask_B_T, p.gamma, p.lam)
    return Advantages(adv, ret)


@ADVANTAGES.register("reverse_kl")
def _reverse_kl(inp: AdvantageInputs, p: AdvantageParams) -> Advantages:
    """On-policy distillation (§8) as a dense reward r_t = -(log pi_old(y_t) - log pi_T(y_t)).

        A_t = sum_{t' >= t} gamma^(t'-t) r_t'        (+ reward_weight x GRPO group advantage)

    With gamma = 1 this is the reward-to-go, whose policy gradient is that of the sequence-level
    reverse KL sum_t KL_t: a token is also charged for the contexts it leads the student into.
    gamma = 0 keeps only r_t (the per-token form some recipes use). With kl_in_loss (config
    `distill_loss: exact` or `forward`) the full-vocabulary KL is added to the loss by the trainer
    instead, and only the optional reward part is an advantage.
    """
    from posttrain.losses.distill import distillation_advantage
    if p.kl_in_loss:
        adv = torch.zeros_like(inp.mask_B_T)
    else:
        if inp.old_logp_B_T is None or inp.teacher_logp_B_T is None:
            raise ValueError("the 'reverse_kl' estimator needs the student's and the teacher's "
                             "log-probs")
        rewards = distillation_advantage(inp.old_logp_B_T, inp.teacher_logp_B_T, inp.mask_B_T)
        adv = discounted_returns(rewards, inp.mask_B_T, p.gamma)
    if p.reward_weight:
        adv = adv + p.reward_weight * _per_token(_grpo(inp, p), inp.mask_B_T)
    return Advantages(adv)
