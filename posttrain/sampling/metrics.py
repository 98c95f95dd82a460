"""What sampling measures about a batch's scores, computed on the device and read in one
transfer: the reward model's scores beside the verifier's verdicts, the judge's agreement."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def reward_model_metrics(scores_B: Tensor, correct_B: Tensor) -> dict[str, Tensor]:
    """The reward model's mean score, overall and on correct / incorrect answers (nan: none)."""
    correct_B = correct_B.to(scores_B.device)
    return {"reward/model_score": scores_B.mean(),
            "reward/model_score_correct": mean_where(scores_B, correct_B),
            "reward/model_score_incorrect": mean_where(scores_B, ~correct_B)}


def judge_metrics(scores_B: Tensor, correct_B: Tensor, stats: dict[str, float]) -> dict[str, Tensor]:
    """The judge's mean score over the responses it scored, how often it agrees with the verifier
    (score >= 0.5 on a verified answer, < 0.5 on a wrong one; nan: none scored), its requests,
    cache hits and unscorable responses."""
    correct_B = correct_B.to(scores_B.device)
    scored = ~scores_B.isnan()
    agree = (scores_B >= 0.5) == correct_B
    return {"reward/judge_score": mean_where(scores_B.nan_to_num(0.0), scored),
            "reward/judge_agreement": mean_where(agree.float(), scored),
            "reward/judge_unscorable": torch.tensor(float(stats.get("unscorable", 0))),
            "reward/judge_requests": torch.tensor(float(stats.get("calls", 0))),
            "reward/judge_cache_hits": torch.tensor(float(stats.get("cache_hits", 0)))}


def mean_where(x: Tensor, rows: Tensor) -> Tensor:
    """Mean of x over the rows where `rows` holds (0 / 0 = nan when none does)."""
    return (x * rows).sum() / rows.float().sum()


def read_floats(t: dict[str, Tensor]) -> dict[str, float]:
    """Scalar metric tensors as floats, in one device-to-host transfer; nan ones left out."""
    if not t:
        return {}
    device = next(iter(t.values())).device
    values = torch.stack([v.detach().float().reshape(()).to(device) for v in t.values()]).tolist()
    return {k: v for k, v in zip(t, values) if not math.isnan(v)}
