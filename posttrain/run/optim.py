"""Pieces of a run's lifecycle that every command shares: seeding and the learning-rate schedule."""

from __future__ import annotations

import math
import random

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def lr_factor(i: int, total: int, warmup_steps: int = 0, schedule: str = "constant") -> float:
    """The learning rate of optimizer step i (0-based) as a share of the peak: a linear warm-up
    over `warmup_steps`, then constant, linear decay to 0 or cosine decay to 0 at step `total`."""
    if warmup_steps and i < warmup_steps:
        return (i + 1) / warmup_steps
    progress = min((i - warmup_steps) / max(total - warmup_steps, 1), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def make_adamw(params, lr: float, betas: tuple[float, float] = (0.9, 0.999),
               weight_decay: float = 0.0, sharded: bool = False) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel: one pass over all parameters instead of one op
    per tensor and update term (135M parameters on a 2-core CPU: 0.09 s a step against 0.31 s for
    torch's CPU default, the for-loop). FSDP2's sharded DTensors keep the for-loop."""
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = not sharded and all(p.device.type in ("cpu", "cuda") for p in tensors)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                             fused=True if fused else None, foreach=False if sharded else None)


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                   schedule: str = "constant") -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as a torch scheduler over `total_steps` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_factor(i, total_steps, warmup_steps, schedule))
