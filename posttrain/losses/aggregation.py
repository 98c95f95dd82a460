"""How per-token losses sum to one loss (`AGGREGATIONS`: per-token weights) and `aggregate`.  §6, §7.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from posttrain.losses.common import masked
from posttrain.util.registry import Registry


# ---------------------------------------------------------------------------------------------
# Loss aggregation (§6, §7): per-token weights, so the length bias is visible in one tensor
# ---------------------------------------------------------------------------------------------

AggregationFn = Callable[[Tensor, float], Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


def responses_in_loss(mask_B_T: Tensor) -> Tensor:
    """B of the sequence means: the responses with a token in the loss. A response with none (an
    unscorable one, a truncated one under the overlong filter) is as if it had never been
    sampled: it leaves the count as it leaves the baseline (losses/advantages.py
    `excluding_unscored`). Never 0, so an empty batch divides by 1."""
    return (mask_B_T.sum(-1) > 0).sum().clamp(min=1)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """GRPO: 1/G sum_i 1/|o_i| sum_t.  §6.  Weight of a token of response i: 1 / (B |o_i|).

    A token of a long response weighs less than one of a short response: the length bias of §7.
    An empty response (|o_i| = 0) has no tokens, gets no weight and is not counted in B (the
    mean is over the responses that have a token), so the weights always sum to 1.
    """
    lengths_B = mask_B_T.sum(-1, keepdim=True)
    return mask_B_T / lengths_B.clamp(min=1) / responses_in_loss(mask_B_T)


@AGGREGATIONS.register("token_mean")
def token_mean_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """DAPO: 1 / sum_i |o_i| * sum_i sum_t.  §7.  Every token weighs the same, 1 / sum_i |o_i|."""
    return mask_B_T / mask_B_T.sum().clamp(min=1)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """Dr. GRPO: 1/G sum_i sum_t (...) / L_max.  §7.  Weight 1 / (B L_max), a constant.

    B counts the responses in the loss (`responses_in_loss`), not the rows: an unscorable
    response changes nothing for the others, as if it had never been sampled."""
    return mask_B_T / (responses_in_loss(mask_B_T) * max_len)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum_weights(mask_B_T: Tensor, max_len: float) -> Tensor:
    """REINFORCE: sum_t over the sequence (the gradient of log pi(y|x)), mean over the batch.  §2.

    Weight 1 / B (B: the responses in the loss, `responses_in_loss`); the scale of the update
    grows with response length.
    """
    return mask_B_T / responses_in_loss(mask_B_T)


def aggregate(loss_B_T: Tensor, weights_B_T: Tensor) -> Tensor:
    """sum_{i,t} w_it L_it.  Weights come from AGGREGATIONS over the whole optimizer batch, so a
    batch split into micro-batches for gradient accumulation sums to exactly the same loss."""
    return masked(loss_B_T, weights_B_T).sum()
