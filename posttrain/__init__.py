"""posttrain: post-training of language models with reinforcement learning and distillation.

The public API for notebooks and scripts (imported lazily, so `import posttrain` and the command
line's `--help` stay fast):

    import posttrain
    cfg = posttrain.load_config("my.yaml", ["--optim.lr", "2e-5"])   # or None for the defaults
    summary = posttrain.train(cfg)                                     # the RL loop
    posttrain.sft / posttrain.dpo / posttrain.reward_model             # the offline stages
    posttrain.ADVANTAGES, posttrain.POLICY_LOSSES, ...                 # the registries
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.9.0"

# name -> the module that defines it
_PUBLIC = {
    "train": "posttrain.rl.loop",
    "evaluate": "posttrain.sampling.evaluation",
    "load_config": "posttrain.config.options",
    "recipe_path": "posttrain.config.options",
    "TrainConfig": "posttrain.config.commands",
    "AlgorithmConfig": "posttrain.config.presets",
    "ConfigError": "posttrain.util.errors",
    "PRESETS": "posttrain.config.presets",
    "StageConfig": "posttrain.config.commands",
    "sft": "posttrain.stages.sft",
    "dpo": "posttrain.stages.preference",
    "reward_model": "posttrain.stages.reward_model",
    "generate": "posttrain.stages.generate",
    "build_task": "posttrain.data.source",
    "TASKS": "posttrain.data.tasks",
    "ADVANTAGES": "posttrain.losses.advantages",
    "POLICY_LOSSES": "posttrain.losses.policy",
    "AGGREGATIONS": "posttrain.losses.aggregation",
    "KL_ESTIMATORS": "posttrain.losses.kl",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value          # later lookups skip this function
        return value
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
