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
