"""What samples and scores, as one object: the functions of collect.py and evaluation.py take it
(`SamplingSetup`), and the `Sampling` service (service.py) is one, with the engine's life and a
step's batch source added."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.config.commands import TrainConfig
from posttrain.data.source import PromptStream
from posttrain.envs import Environment, SingleTurn
from posttrain.model.distributed import SINGLE, World
from posttrain.rewards.scorer import Scorer
from posttrain.rollout import RolloutEngine


@dataclass(kw_only=True)
class SamplingSetup:
    """The engine over the policy and its tokenizer, the environment that answers between turns,
    the reward scorer, the training prompts (None: a command that samples given problems), the
    world (each rank samples its share) and the generator the answers' noise is keyed from; `cfg`
    is the run's config (rollout, data, reward, algo, seed)."""

    cfg: TrainConfig
    engine: RolloutEngine | None      # (None: nothing samples, an environment demonstrates)
    tokenizer: Any
    scorer: Scorer | None = None      # (None: nothing is scored, `posttrain serve`)
    prompts: PromptStream | None = None
    env: Environment = field(default_factory=SingleTurn)
    world: World = SINGLE
    generator: torch.Generator | None = None
