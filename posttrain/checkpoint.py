"""Checkpoints that never lose data and resume exactly.

A checkpoint folder holds the model (Hugging Face format), the optimizer and scheduler state, every
RNG state, the data position and the resolved config. It is written under a temporary name and
renamed into place, so an interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STATE = "trainer_state.pt"


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "sampler": generator.get_state()}


def restore_rng(state: dict[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampler"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, scheduler,
                    generator: torch.Generator, extra: dict[str, Any], config: dict[str, Any],
                    keep: int = 2, extra_models: dict[str, Any] | None = None,
                    world=None) -> Path:
    """`extra_models` maps a subfolder name to a function that saves into a folder (the critic).

    Weights and optimizer state are saved full (gathered from FSDP shards) and the optimizer
    state keyed by parameter name, so a checkpoint resumes on any number of ranks. Every rank
    must call this (gathering is collective); rank 0 writes."""
    from posttrain.distributed import SINGLE, barrier, full_state_dict, optimizer_state
    from posttrain.models import is_lora
    world = world or SINGLE
    # LoRA: only the adapters are saved (the base model is the run's start)
    lora = is_lora(model)
    weights = full_state_dict(model, world, only=(lambda k: "lora_" in k) if lora else None)
    optim_state = optimizer_state(model, optimizer)
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".step_{step:06d}.tmp"
    if world.main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    for name, save in (extra_models or {}).items():
        save(tmp / name)     # every rank (FSDP gathers are collective); rank 0 writes
    if not world.main:
        barrier(world)
        return final
    if lora:
        model.save_pretrained(tmp / "adapter", state_dict=weights)
    else:
        model.save_pretrained(tmp / "model", state_dict=weights)
        tokenizer.save_pretrained(tmp / "model")
    torch.save({"step": step, "optimizer": optim_state,
                "scheduler": scheduler.state_dict(), "rng": rng_state(generator), **extra},
               tmp / _STATE)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    barrier(world)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / _STATE).is_file())
    return done[-1] if done else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / _STATE, weights_only=False)
