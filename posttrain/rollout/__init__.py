"""Sampling responses from the policy. The trainer sees only `RolloutEngine` and `Rollout`."""

from posttrain.rollout.base import Rollout, RolloutEngine, SamplingParams
from posttrain.rollout.hf import HFRolloutEngine

__all__ = ["HFRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(backend: str, model, tokenizer) -> RolloutEngine:
    if backend == "hf":
        return HFRolloutEngine(model, tokenizer)
    raise ValueError(f"rollout.backend={backend!r} is not available; accepted: ['hf']")
