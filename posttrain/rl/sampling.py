"""What every command that samples builds, built one way: the task, its environment and the
reward scorer (checked before any model loads: a bad data file, environment or reward function
fails here), and the engine that samples the policy (`train`, `eval`, `generate`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posttrain.config.commands import TrainConfig
from posttrain.data.source import Task, build_task
from posttrain.model.distributed import SINGLE, World
from posttrain.envs import Environment, make_env
from posttrain.rewards.scorer import Scorer
from posttrain.rollout import RolloutEngine, make_engine, vllm_options

log = logging.getLogger("posttrain")


def isolation(scorer: Scorer, env: Environment) -> dict[str, str]:
    """Where the model's text is handled: the reward scorers' sandbox, and each tool that runs
    the model's code (docs/safety.md); written to the start line, config.json and summary.json."""
    out = {"rewards": scorer.sandbox or "trainer process (reward.workers 0)"}
    for tool in getattr(env, "tools", ()):
        if tool.sandbox is not None:
            out[f"tool {tool.name}"] = tool.sandbox
    return out


def sampling_inputs(cfg: TrainConfig, check=None, run_dir: Path | None = None,
                    judge: bool = True) -> tuple[Task, Environment, Scorer]:
    """The task (data errors surface here), its environment (unknown environments and tools
    too), then `check()` (the command's own checks: a teacher's folder), then the reward scorer
    with its sandbox started (a function the sandbox cannot import fails here too); where the
    model's text runs is said once. `run_dir`: where the LLM judge keeps its replies; `judge`
    False: no judge (eval and generate score with the verifier alone)."""
    task = build_task(cfg.data, needs_answer=cfg.reward.verifier != "none")
    env = make_env(cfg.env, task)
    if check is not None:
        check()
    scorer = Scorer(cfg.reward, task.verifier, cfg.data.system_prompt, cfg.model.autocast,
                    run_dir=run_dir, judge=judge)
    scorer.start()
    log.info("the model's text runs in: %s",
             ", ".join(f"{k} {v}" for k, v in isolation(scorer, env).items()))
    return task, env, scorer


def sampling_engine(cfg: TrainConfig, path: str | Path, model: Any, tokenizer: Any,
                    world: World = SINGLE) -> RolloutEngine:
    """The engine `rollout.backend` names over `model` (vLLM: loaded from `path`)."""
    return make_engine(cfg.rollout.backend, model, tokenizer, cfg.rollout.autocast,
                       cfg.rollout.weights, **vllm_options(cfg, path, model, world))


def load_sampled_model(cfg: TrainConfig, model: Any = None, tokenizer: Any = None,
                       weights: bool = True) -> tuple[Any, Any, str | Path]:
    """The model `model.path` names (default: the embedded one) and its tokenizer, unless given;
    `weights=False`: the tokenizer only. Returns (model, tokenizer, the folder it came from)."""
    from posttrain.model.loading import load_policy, load_tokenizer, resolve_model_path
    path: str | Path = cfg.model.path
    if tokenizer is None:
        path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        tokenizer = load_tokenizer(path)
    if model is None and weights:
        model = load_policy(path, cfg.model.dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, path
