"""The masked sums every loss goes through, and log-probabilities and entropy from logits.  §2.

Imports none of the other loss modules: they all import from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


# Rows of logits converted to float32 at a time when the input is half precision: bounds the
# temporary copy to CHUNK x V floats instead of a full-batch float32 copy of the logits.
_CHUNK = 1024

# exp() of a log-ratio above this overflows float32; such a token is already far off-policy.
_MAX_LOG_RATIO = 20.0


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
