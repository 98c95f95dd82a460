"""Sampling responses from the policy. The trainer sees only `RolloutEngine` and `Rollout`."""

from posttrain.rollout.base import Rollout, RolloutEngine, SamplingParams
from posttrain.rollout.hf import HFRolloutEngine

__all__ = ["HFRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(backend: str, model, tokenizer, **vllm_options) -> RolloutEngine:
    """`vllm_options`: VLLMRolloutEngine's (model_path, rollout_cfg, dtype, seed, ...)."""
    if backend == "hf":
        return HFRolloutEngine(model, tokenizer)
    if backend == "vllm":
        from posttrain.rollout.vllm import VLLMRolloutEngine   # optional dependency, GPU only
        return VLLMRolloutEngine(model, tokenizer, **vllm_options)
    raise ValueError(f"rollout.backend={backend!r} is not available; accepted: ['hf', 'vllm']")
