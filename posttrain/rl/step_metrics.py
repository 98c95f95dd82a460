"""What a step logs about its batch, computed on the device and read in one transfer: rewards,
lengths of correct and wrong answers, per-domain accuracy and KL (MOPD), the reward model's
scores, and the value model's fit (PPO)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.sampling.batch import ScoredBatch
from posttrain.sampling.metrics import mean_where
from posttrain.losses.common import masked_mean
from posttrain.losses.kl import kl_penalized_rewards
from posttrain.losses.value import explained_variance


def per_domain(batch: ScoredBatch, kl_B_T: Tensor | None = None) -> dict[str, Tensor]:
    """Accuracy and sampled reverse KL per domain, when a batch mixes domains (MOPD)."""
    domains = [p.domain for p in batch.problems]
    if len(set(domains)) < 2:
        return {}
    out = {}
    for d in sorted(set(domains)):
        rows = torch.tensor([i for i, x in enumerate(domains) if x == d])
        if kl_B_T is not None:
            out[f"distill/reverse_kl@{d}"] = masked_mean(kl_B_T[rows], batch.loss_mask_B_T[rows])
        out[f"reward/accuracy@{d}"] = batch.correct_B[rows].float().mean()
    return out


def rollout_metrics(batch: ScoredBatch) -> dict[str, float | None]:
    """What was sampled and how it scored, read from the device in one transfer ('_tokens': the
    generated tokens, for the throughput; None where no row qualifies)."""
    lengths, correct, r = batch.rollout.lengths_B, batch.correct_B, batch.rewards_B
    if batch.scored_B is not None:   # the reward of the responses the judge scored
        r = r[batch.scored_B] if batch.scored_B.any() else r[:0]
    t = {"reward/mean": r.mean(), "reward/std": r.std() if len(r) > 1 else torch.zeros(()),
         "reward/accuracy": correct.float().mean(),
         "rollout/length_mean": lengths.mean(),
         "rollout/truncated_frac": batch.rollout.truncated_B.float().mean(),
         "policy/adv_abs_mean": batch.adv_B_T.abs().sum() / batch.loss_mask_B_T.sum().clamp(min=1),
         "rollout/length_correct": mean_where(lengths, correct),
         "rollout/length_incorrect": mean_where(lengths, ~correct),
         "_tokens": batch.rollout.response_mask_B_T.sum()}
    values = torch.stack([v.float().to(r.device) for v in t.values()]).tolist()
    return {k: None if math.isnan(v) else v for k, v in zip(t, values)}


def critic_metrics(batch: ScoredBatch, token_rewards_B_T: Tensor) -> dict[str, Tensor]:
    """How good the value model was on this batch before its update (`batch.old_values_B_T`
    against `batch.returns_B_T`), and where advantage sits (device tensors; nan where no token
    qualifies)."""
    mask, adv_B_T = batch.loss_mask_B_T, batch.adv_B_T
    out = {"critic/explained_variance": explained_variance(
               batch.old_values_B_T, batch.returns_B_T, mask),
           "critic/value_mean": masked_mean(batch.old_values_B_T, mask),
           "critic/return_mean": masked_mean(batch.returns_B_T, mask)}
    # mean (un-whitened) advantage by response position: first tokens, and the last token
    for t in range(min(3, mask.shape[1])):
        out[f"advantage/mean_t{t}"] = mean_where(adv_B_T[:, t], mask[:, t])
    last = (torch.arange(mask.shape[1], device=mask.device) * (mask > 0)).amax(-1)
    out["advantage/mean_last"] = mean_where(adv_B_T.gather(1, last[:, None])[:, 0], mask.sum(-1) > 0)
    kl_part = token_rewards_B_T - kl_penalized_rewards(batch.rewards_B, torch.zeros_like(mask), mask, 0.0)
    out["reward/kl_penalty"] = kl_part.sum(-1).mean()
    return out
