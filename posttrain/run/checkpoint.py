"""Checkpoints that never lose data, resume exactly, and cannot run code.

A checkpoint folder holds the model (Hugging Face format), the optimizer and scheduler state, every
RNG state, the data position and the resolved config. It is written under a temporary name, every
file and folder fsynced, a COMPLETE marker listing each file's size and SHA-256 written last, and
only then renamed into place and the parent folder fsynced; older checkpoints are deleted after
that. So a crash or a power loss at any moment leaves the previous checkpoint intact.

Resuming trusts nothing the run did not write: every file of the checkpoint must have its
recorded size and hash (a truncated, flipped or edited file is refused, and the resume falls back
to the previous checkpoint), and the config it continues with is the checkpoint's own copy, not
the run folder's config.json (which names modules to import). `trainer_state.pt` is loaded with
`torch.load(weights_only=True)`: tensors and plain containers only (RNG states are stored as
lists and tensors), so a tampered file is refused instead of running its pickle. The hashes make
edits evident; they are no signature: whoever can rewrite the COMPLETE marker too can make a
checkpoint that loads (docs/safety.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_STATE = "trainer_state.pt"
_COMPLETE = "COMPLETE"


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG's state as lists, numbers and tensors (what weights_only loading accepts)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                      float(cached)],
            "torch": torch.get_rng_state(), "sampler": generator.get_state()}


def restore_rng(state: dict[str, Any], generator: torch.Generator) -> None:
    """Put back every RNG `rng_state` recorded (numpy's keys return to uint32: the values are
    the same, so its stream continues exactly)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss,
                         cached))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampler"])


# -- durable writes ------------------------------------------------------------------------------

def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to the disk (a folder: its list of names)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def seal(folder: Path, step: int) -> None:
    """Make a written folder durable and verifiable: fsync every file and subfolder, then write
    the COMPLETE marker (each file's size and SHA-256) and fsync it and the folder."""
    sizes, hashes = {}, {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(folder))
            sizes[name], hashes[name] = path.stat().st_size, sha256_of(path)
        fsync_path(path)
    marker = folder / _COMPLETE
    marker.write_text(json.dumps({"step": step, "files": sizes, "sha256": hashes}, indent=1))
    fsync_path(marker)
    fsync_path(folder)


def _record(folder: Path) -> dict[str, Any]:
    return json.loads((folder / _COMPLETE).read_text())


def is_complete(folder: Path) -> bool:
    """The COMPLETE marker is there and every file it lists has its recorded size (a truncated
    or missing file fails this; a checkpoint never sealed has no marker). Cheap: no hashing."""
    try:
        files = _record(folder)["files"]
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def problem_with(folder: Path, only: tuple[str, ...] | None = None) -> str | None:
    """Why the folder's files (or `only` these) are not the ones sealed into it: a missing or
    unreadable marker, a marker without hashes (an older posttrain), a file of another size or
    hash, a file the marker does not list. None: every file is as written."""
    try:
        record = _record(folder)
        sizes, hashes = record["files"], record["sha256"]
    except (OSError, ValueError, TypeError):
        return "incomplete (no readable COMPLETE marker)"
    except KeyError:
        return "sealed without file hashes (written by posttrain before 0.10): cannot be verified"
    names = only if only is not None else sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != _COMPLETE)
    for name in names:
        path = folder / name
        if name not in hashes:
            return f"{name} is not one of the files it was sealed with"
        if not path.is_file() or path.stat().st_size != sizes.get(name):
            return f"{name} is missing or not the size it was written with"
        if sha256_of(path) != hashes[name]:
            return f"{name} is not the file it was written as (SHA-256 differs)"
    return None


def step_of(folder: Path) -> int:
    """step_000012 -> 12 (numeric, so step_1000000 comes after step_999999)."""
    try:
        return int(folder.name.removeprefix("step_"))
    except ValueError:
        return -1


def step_folders(run_dir: Path) -> list[Path]:
    """The checkpoint folders of a run, oldest first, in numeric step order."""
    return sorted((p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir() and step_of(p) >= 0),
                  key=step_of)


def trainer_state(model, optimizer, scheduler, generator: torch.Generator,
                  extra: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds besides the weights: the optimizer state (gathered from FSDP
    shards, keyed by parameter name, so it resumes on any number of ranks), the schedule, every
    RNG, and `extra` (the command's own: data position, clock, ...). Collective under FSDP."""
    from posttrain.model.distributed import optimizer_state
    return {"optimizer": optimizer_state(model, optimizer), "scheduler": scheduler.state_dict(),
            "rng": rng_state(generator), **extra}


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict[str, Any],
                    config: dict[str, Any], *, keep: int = 2,
                    extra_models: dict[str, Any] | None = None, world=None) -> Path:
    """The checkpoint of `step`: the weights (full, gathered from FSDP shards), `state`
    (trainer_state) and `config`, sealed and renamed into place; the newest `keep` kept.
    `extra_models` maps a subfolder name to a function that saves into a folder (the critic).
    Every rank must call this (gathering is collective); rank 0 writes."""
    from posttrain.model.distributed import SINGLE, barrier, full_state_dict
    from posttrain.model.loading import is_lora
    world = world or SINGLE
    # LoRA: only the adapters are saved (the base model is the run's start)
    lora = is_lora(model)
    weights = full_state_dict(model, world, only=(lambda k: "lora_" in k) if lora else None)
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".step_{step:06d}.tmp"
    if world.main:
        if not ckpt_root.is_dir():
            ckpt_root.mkdir(parents=True)
            fsync_path(run_dir)   # the first checkpoint's folder must survive a power loss too
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
    torch.save({"step": step, **state}, tmp / _STATE)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    seal(tmp, step)
    put_in_place(tmp, final)
    prune(ckpt_root.parent, keep, newest=step)
    barrier(world)
    return final


def put_in_place(tmp: Path, final: Path) -> None:
    """Rename a sealed folder to its final name and fsync the parent. A folder already there
    (the same step saved again) is moved aside first and deleted only once the new one is in.
    A crash between the two renames loses only that folder: a run saves a step again only when
    it resumed from an older checkpoint (the newer one was refused), and that one is still there."""
    aside = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside.exists():   # the rename failed (a full or failing disk): the old one goes back
            os.replace(aside, final)
        raise
    fsync_path(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def prune(run_dir: Path, keep: int, newest: int) -> None:
    """Delete all but the newest `keep` complete checkpoints up to step `newest` (the one just
    written), and incomplete ones older than them. Folders after `newest` are left alone: a
    resume fell back past them, and the run replaces each when it reaches its step (counting
    them could delete the checkpoint just written)."""
    folders = [p for p in step_folders(run_dir) if step_of(p) <= newest]
    complete = [p for p in folders if is_complete(p)]
    if len(complete) <= keep:
        return
    oldest_kept = step_of(complete[-keep])
    for old in folders:
        if step_of(old) < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of a run (None: none)."""
    done = [p for p in step_folders(run_dir) if is_complete(p)]
    return done[-1] if done else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's trainer state, tensors and plain containers only: a pickle that would
    build any other object (run code) is refused by torch's weights_only unpickler."""
    try:
        return torch.load(ckpt / _STATE, weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, a truncated zip, an OS error
        raise CheckpointError(f"{ckpt / _STATE}: cannot be loaded safely ({_why(e)})") from None


def _why(e: Exception) -> str:
    """A load error in one short line: torch's weights_only refusal is a page of advice (with
    terminal colour codes) whose one useful sentence names what the pickle tried to build."""
    text = " ".join(str(e).split())
    if "WeightsUnpickler error: " in text:
        text = text.split("WeightsUnpickler error: ", 1)[1].split(". ")[0]
    return f"{type(e).__name__}: {text[:200]}"


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt or refused (not plain tensors and containers)."""


def check_files(ckpt: Path) -> None:
    """Read the header of every safetensors file and parse every JSON file of a checkpoint
    (cheap): what would make loading the model fail (a corrupt file of the right size) raises
    here, before any model loads, so the resume can still fall back."""
    from safetensors import safe_open
    for path in sorted(ckpt.rglob("*")):
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), "pt") as f:
                    f.keys()
            elif path.suffix == ".json":
                json.loads(path.read_bytes())
        except Exception as e:  # noqa: BLE001 - whatever a corrupt file makes it raise
            raise CheckpointError(f"{path}: {_why(e)}") from None


def resume_point(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that is complete and loads, with its trainer state; each newer one
    that does not is named in a warning (a resume falls back rather than crash). None: none
    was ever written. Raises CheckpointError when some exist but none loads."""
    refused = []
    for ckpt in reversed(step_folders(run_dir)):
        if not is_complete(ckpt):
            refused.append(f"{ckpt}: incomplete (no COMPLETE marker, or a file of another size)")
            continue
        problem = problem_with(ckpt)
        if problem is not None:
            refused.append(f"{ckpt}: {problem}")
            continue
        try:
            check_files(ckpt)
            state = load_trainer_state(ckpt)
        except CheckpointError as e:
            refused.append(str(e))
            continue
        for reason in refused:
            log.warning("checkpoint not used, resuming from %s instead: %s", ckpt.name, reason)
        return ckpt, state
    if refused:
        raise CheckpointError(f"no checkpoint under {run_dir / 'checkpoints'} loads: "
                              + "; ".join(refused))
    return None


def checkpoint_config(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The config a resumed run continues with: the newest checkpoint's own config.json whose
    hash matches its COMPLETE record (never the run folder's config.json, which anyone who can
    write the folder can edit). CheckpointError when no checkpoint has one."""
    refused = []
    for ckpt in reversed(step_folders(run_dir)):
        problem = problem_with(ckpt, only=("config.json",)) if is_complete(ckpt) else "incomplete"
        if problem is None:
            return ckpt, json.loads((ckpt / "config.json").read_text())
        refused.append(f"{ckpt.name}: {problem}")
    if not refused:
        raise CheckpointError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
    raise CheckpointError(f"no checkpoint under {run_dir / 'checkpoints'} has a config that "
                          "verifies: " + "; ".join(refused))
