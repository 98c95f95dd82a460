"""Preference losses (Bradley-Terry, DPO) and the SFT loss.  §1, §8, §9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from posttrain.losses.common import masked, masked_mean


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
