"""The critic's loss and how well it explains the returns.  §5.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.losses.common import masked_mean


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
