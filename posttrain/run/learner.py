"""The learner every training command composes: a model and what trains it (tokenizer,
optimizer, learning-rate schedule, the non-finite guard), its checkpoint (saved and restored)
and its final save. `train` extends it with pi_ref, the teachers and PPO's value model
(rl/learner.py); sft, dpo and reward-model use it as it is (stages/common.py).

    learner.optimizer_step()          average the gradients over ranks, clip, step if finite
    learner.count_skipped(skipped)    N updates in a row all skipped: stop (NonFiniteError)
    learner.save(run_dir, step, ...)  an atomic checkpoint (run/checkpoint.py)
    learner.restore(state, generator) optimizer, schedule and RNG as they were
    learner.save_final(folder)        a plain Hugging Face model folder
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from posttrain.config.sections import OptimConfig
from posttrain.model.distributed import (SINGLE, World, average_gradients, barrier, clip_grad_norm,
                                         full_state_dict, load_optimizer_state)
from posttrain.model.loading import is_lora, merge_lora, merged_lora_copy, save_model
from posttrain.run.checkpoint import restore_rng, save_checkpoint, trainer_state
from posttrain.util.errors import NonFiniteError

log = logging.getLogger("posttrain")


def step_if_finite(params: list[Tensor], optimizer, scheduler, max_grad_norm: float,
                   world: World) -> tuple[Tensor, bool]:
    """Clip the (averaged) gradients to max_grad_norm and step Adam and the schedule, unless the
    gradient norm is not finite (a NaN or Inf loss, an overflow): then the gradients are dropped
    and weights, optimizer state and schedule stay untouched. Returns (norm, stepped). The
    finiteness test is the step's one host sync; the norm is global, so every rank agrees."""
    norm = clip_grad_norm(params, max_grad_norm, world)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        log.warning("non-finite gradient norm (%s): optimizer step skipped", norm.item())
        return norm, False
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return norm, True


def check_nonfinite_streak(streak: int, limit: int) -> None:
    """Stop after `limit` consecutive skipped steps, with what to try (the weights are those of
    the last good step; the latest checkpoint is intact)."""
    if limit and streak >= limit:
        raise NonFiniteError(
            f"{streak} optimizer steps in a row had a non-finite loss or gradient norm and were "
            "skipped; stopping (the latest checkpoint is intact). Try a lower optim.lr, "
            "model.autocast none, or optim.max_grad_norm; optim.max_nonfinite_steps sets the limit")


@dataclass(kw_only=True)
class Learner:
    """A model being trained and what trains it. `optim` holds max_grad_norm and
    max_nonfinite_steps; the scheduler may be set once the number of steps is known."""

    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    optim: OptimConfig
    scheduler: Any = None
    world: World = SINGLE
    nonfinite_streak: int = 0          # updates in a row whose every optimizer step was skipped

    def optimizer_step(self) -> tuple[Tensor, bool]:
        """Average the gradients over ranks, clip them, step Adam and the schedule unless the
        norm is not finite. Returns (norm, stepped)."""
        params = list(self.model.parameters())   # (after backward: FSDP2 re-registered its shards)
        average_gradients(params, self.world)
        return step_if_finite(params, self.optimizer, self.scheduler, self.optim.max_grad_norm,
                              self.world)

    def count_skipped(self, all_skipped: bool) -> None:
        """An update whose every optimizer step was skipped (non-finite) lengthens the streak,
        any other ends it; `optim.max_nonfinite_steps` in a row stop the run (NonFiniteError)."""
        self.nonfinite_streak = self.nonfinite_streak + 1 if all_skipped else 0
        check_nonfinite_streak(self.nonfinite_streak, self.optim.max_nonfinite_steps)

    def save(self, run_dir: Path, step: int, generator: torch.Generator, extra: dict[str, Any],
             config: dict[str, Any], *, keep: int = 2,
             folders: dict[str, Callable[[Path], None]] | None = None) -> Path:
        """An atomic checkpoint of the model (LoRA: its adapters), optimizer, schedule, RNG and
        `extra` (the command's trainer state); `folders`: more models saved beside it."""
        state = trainer_state(self.model, self.optimizer, self.scheduler, generator, extra)
        return save_checkpoint(run_dir, step, self.model, self.tokenizer, state, config,
                               keep=keep, extra_models=folders or None, world=self.world)

    def restore(self, state: dict[str, Any], generator: torch.Generator) -> None:
        """The optimizer, schedule and RNG of a checkpoint's trainer state (`generator`: the
        run's; the torch, numpy and Python RNGs are restored too)."""
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"], generator)

    def save_final(self, folder: Path, extra_files: dict[str, str] | None = None) -> str:
        """The final model as a Hugging Face folder, once (rank 0; FSDP shards gathered first;
        LoRA adapters merged: the model is then done training)."""
        model, weights = final_weights(self.model, self.world)
        if self.world.main:
            save_model(model, self.tokenizer, folder, weights, extra_files)
        barrier(self.world)
        return str(folder)


def final_weights(model, world: World) -> tuple[Any, dict[str, Tensor] | None]:
    """(the model to save as a plain Hugging Face model, its full weights): LoRA adapters merged
    into the base weights by peft, in place (under FSDP into a CPU copy built from the gathered
    weights, on rank 0, since the live layers are sharded); FSDP shards gathered (every rank
    must call this: the gather is collective)."""
    if is_lora(model) and world.strategy == "fsdp" and world.distributed:
        weights = full_state_dict(model, world)
        return (merged_lora_copy(model, weights) if world.main else None), None
    if is_lora(model):
        model = merge_lora(model)
    return model, full_state_dict(model, world)
