"""Layer 5: sampling responses from the policy (the trainer sees only `RolloutEngine` and
`Rollout`), and the one prompt-shared forward over a rollout (forward.py: log-probs, entropy)."""

from posttrain.rollout.base import (Rollout, RolloutEngine, SamplingParams, async_core_split,
                                    close_engine)
from posttrain.rollout.episodes import EpisodeSettings
from posttrain.rollout.hf import HFRolloutEngine

__all__ = ["HFRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams", "async_core_split", "close_engine",
           "engine_context", "episode_settings", "make_engine", "vllm_options"]


def make_engine(backend: str, model, tokenizer, autocast: str = "none", weights: str = "shared",
                **vllm_options) -> RolloutEngine:
    """`autocast`, `weights`: the in-process engine's precision ('bfloat16': body in bf16 under
    autocast, or from a bf16 copy; the head in float32); `vllm_options`: VLLMRolloutEngine's
    (model_path, rollout_cfg, dtype, seed, ...)."""
    if backend == "hf":
        return HFRolloutEngine(model, tokenizer, autocast, weights)
    if backend == "vllm":
        from posttrain.rollout.vllm_engines import make_vllm_engine   # optional dependency
        return make_vllm_engine(model, tokenizer, **vllm_options)
    raise ValueError(f"rollout.backend={backend!r} is not available; accepted: ['hf', 'vllm']")


def vllm_options(cfg, model_path, model, world) -> dict:
    """What a vLLM engine needs besides the policy (`cfg` a TrainConfig, `world` its rank and
    size): the folder it reads the architecture and first weights from, and the sampling set-up
    (rollout/vllm.py). Empty for the in-process backend."""
    if cfg.rollout.backend != "vllm":
        return {}
    # the engine samples in bf16 when the trainer computes in bf16 (its weights are cast on sync)
    dtype = "bfloat16" if cfg.model.autocast == "bfloat16" else cfg.model.dtype
    return dict(model_path=str(model_path), rollout_cfg=cfg.rollout, dtype=dtype,
                seed=cfg.seed, world=world,
                max_model_len=engine_context(cfg, getattr(model.config, "max_position_embeddings", None)))


def engine_context(cfg, model_limit: int | None, prompt_room: int = 2048) -> int:
    """The longest sequence a vLLM engine holds: room for a prompt and the answer (or a whole
    multi-turn episode), at least 4096, never past what the model's positions reach. (vLLM
    sizes its batches and refuses prompts by it: the cap is set, not left at the model's 128k.)"""
    need = max(4096, prompt_room + cfg.rollout.max_new_tokens, prompt_room + cfg.env.max_tokens)
    return min(need, model_limit) if model_limit else need


def episode_settings(cfg) -> EpisodeSettings:
    """How episodes of a TrainConfig are encoded and bounded (rollout/episodes.py)."""
    return EpisodeSettings(cfg.data.system_prompt, cfg.data.chat_template,
                           dict(cfg.data.chat_template_kwargs), cfg.env.max_tokens,
                           cfg.env.max_reply_tokens, cfg.env.turn_timeout_s,
                           cfg.env.episode_timeout_s)
