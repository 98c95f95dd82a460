"""Layer 5: sampling responses from the policy (the trainer sees only `RolloutEngine` and
`Rollout`), and the one prompt-shared forward over a rollout (forward.py: log-probs, entropy)."""

from collections.abc import Callable

from posttrain.rollout.base import (PublishesWeights, Rollout, RolloutEngine, SamplingParams,
                                    async_core_split, close_engine, evaluation_engine, runs_episodes)
from posttrain.rollout.episodes import EpisodeSettings
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.util.registry import Registry

__all__ = ["ENGINES", "HFRolloutEngine", "PublishesWeights", "Rollout", "RolloutEngine",
           "SamplingParams", "async_core_split", "close_engine", "engine_context",
           "episode_settings", "evaluation_engine", "make_engine", "runs_episodes", "vllm_options"]

# rollout.backend -> build(model, tokenizer, autocast, weights, **backend options): the one place
# an engine is built (make_engine); a new engine is a module and one registration here
ENGINES: Registry[Callable[..., RolloutEngine]] = Registry("rollout.backend")


@ENGINES.register("hf")
def _hf(model, tokenizer, autocast: str = "none", weights: str = "shared", **_) -> RolloutEngine:
    return HFRolloutEngine(model, tokenizer, autocast, weights)


@ENGINES.register("vllm")
def _vllm(model, tokenizer, autocast: str = "none", weights: str = "shared",
          **vllm_options) -> RolloutEngine:
    from posttrain.rollout.vllm_engines import make_vllm_engine   # optional dependency
    return make_vllm_engine(model, tokenizer, **vllm_options)


def make_engine(backend: str, model, tokenizer, autocast: str = "none", weights: str = "shared",
                **options) -> RolloutEngine:
    """The engine `backend` names (ENGINES). `autocast`, `weights`: the in-process engine's
    precision ('bfloat16': body in bf16 under autocast, or from a bf16 copy; the head in
    float32); `options`: the backend's own (vLLM: model_path, rollout_cfg, dtype, seed, ...)."""
    if backend not in ENGINES:
        raise ValueError(f"rollout.backend={backend!r} is not available; accepted: {ENGINES.names()}")
    return ENGINES[backend](model, tokenizer, autocast, weights, **options)


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
