"""The policy's learner (`train`): the common learner (run/learner.py: model, tokenizer,
optimizer, schedule, non-finite guard, checkpoint, final save) with what policy-gradient training
adds: the run's config and generator, pi_ref (a frozen copy, or the LoRA policy with its
adapters off), the distillation teachers and PPO's value model. Its checkpoint holds pi_ref once
(the starting policy, which a resumed run must get back) and the critic's optimizer; its final
save merges LoRA adapters and writes the value model beside the policy."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config.commands import TrainConfig
from posttrain.config.presets import AlgorithmConfig
from posttrain.model.loading import save_model
from posttrain.run.checkpoint import fsync_path, seal
from posttrain.run.learner import Learner, final_weights
from posttrain.rl.critic import Critic
from posttrain.rl.teachers import Teachers


@dataclass(kw_only=True)
class PolicyLearner(Learner):
    """The policy and everything that trains it; `generator` draws the update's minibatches."""

    cfg: TrainConfig
    generator: torch.Generator
    teachers: Teachers | None = None
    ref_model: Any = None               # pi_ref when it is a separate copy (no LoRA)
    critic: Critic | None = None

    @property
    def algo(self) -> AlgorithmConfig:
        return self.cfg.algo

    @property
    def lora(self) -> bool:
        return self.cfg.lora.rank > 0

    @property
    def device(self) -> torch.device:
        """Where the policy's weights are (FSDP2: this rank's GPU): every batch is moved there."""
        return next(self.model.parameters()).device

    def save_checkpoint(self, run_dir: Path, step: int, extra: dict[str, Any],
                        folders: dict[str, Callable[[Path], None]]) -> None:
        """pi_ref the first time, then the checkpoint: the model, optimizer, schedule, RNG, the
        critic and its optimizer, `extra` (the run's trainer state) and `folders` beside it."""
        self.save_reference(run_dir)
        extra, folders = dict(extra), dict(folders)
        if self.critic is not None:
            extra["critic_optimizer"] = self.critic.optimizer_state()
            folders["critic"] = self.critic.save
        self.save(run_dir, step, self.generator, extra, self.cfg.to_dict(),
                  keep=self.cfg.checkpoint.keep, folders=folders)

    def save_reference(self, run_dir: Path) -> None:
        """pi_ref, once, renamed into place (never half-written) and durable before the
        checkpoints rely on it."""
        ref_dir = run_dir / "reference_model"
        if self.ref_model is None or not self.world.main or ref_dir.is_dir():
            return
        tmp = run_dir / ".reference_model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(self.ref_model, self.tokenizer, tmp)
        seal(tmp, 0)
        os.replace(tmp, ref_dir)
        fsync_path(run_dir)

    def restore(self, state: dict[str, Any], generator: torch.Generator | None = None) -> None:
        """Optimizer, schedule, RNG and the critic's optimizer, as they were at the checkpoint."""
        super().restore(state, self.generator if generator is None else generator)
        if self.critic is not None:
            self.critic.load_optimizer_state(state["critic_optimizer"])

    def save_final_models(self, run_dir: Path) -> dict[str, Any]:
        """The final model (a plain HF model: LoRA adapters merged; under FSDP into a CPU copy
        built from the gathered weights, since peft merges in place and the layers are sharded)
        and the value model. Returns what the summary records (paths, save_s)."""
        world, t0 = self.world, time.perf_counter()
        model, weights = final_weights(self.model, world)
        if world.main:
            save_model(model, self.tokenizer, run_dir / "final_model", weights)
        out: dict[str, Any] = {"final_model": str(run_dir / "final_model")}
        if self.critic is not None:   # a shared value head sits beside the policy it reads
            value_dir = run_dir / ("final_model" if self.critic.shared else "final_value_model")
            self.critic.save(value_dir, self.tokenizer)   # every rank: FSDP gathers the shards
            out["value_model"] = str(value_dir)
        out["save_s"] = time.perf_counter() - t0
        return out
