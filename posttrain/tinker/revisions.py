"""What a Tinker server keeps besides the live adapters: sampler revisions (a frozen copy of a
client's adapter, or the base model, that a sampling session is pinned to, so a trajectory never
mixes weights) and checkpoints on disk under the run folder (`save_state`: adapter + AdamW state,
resumed bit-identically; `save_weights_for_sampler` with a name: the adapter alone).

    tinker://MODEL_ID/weights/NAME          RUN_DIR/tinker/MODEL_ID/weights/NAME/
    tinker://MODEL_ID/sampler_weights/NAME  RUN_DIR/tinker/MODEL_ID/sampler_weights/NAME/

Each folder is written beside its final name and renamed into place (run/checkpoint.put_in_place):
a crash leaves the previous one whole.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.run.checkpoint import fsync_path, put_in_place
from posttrain.tinker.wire import WireError

KINDS = ("weights", "sampler_weights")
PATH = re.compile(r"^tinker://(?P<run>[^/]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
KEPT_UNNAMED = 16     # sampler revisions without a name kept in memory (the newest)


@dataclass
class Revision:
    """Frozen weights a sampling session samples from: a client's adapter (`state`, on the CPU)
    or, with `lora` None, the base model."""
    sampler_id: str
    base_model: str
    lora: dict[str, Any] | None
    state: dict[str, Tensor] | None
    path: str | None = None
    serial: int = 0            # set by Revisions.add: a session id replaced gets a new one


class Revisions:
    """Sampler revisions by sampling-session id (HTTP threads and the worker both add). An
    unnamed one holds its weights in memory, the newest KEPT_UNNAMED of them are kept; one made
    from a saved path holds only the path and reads its folder when it samples."""

    def __init__(self) -> None:
        self.by_id: OrderedDict[str, Revision] = OrderedDict()
        self.lock = threading.Lock()
        self.serials = itertools.count(1)

    def add(self, revision: Revision) -> Revision:
        with self.lock:
            revision.serial = next(self.serials)
            self.by_id[revision.sampler_id] = revision
            unnamed = [k for k, r in self.by_id.items() if r.path is None and r.lora is not None]
            for key in unnamed[:-KEPT_UNNAMED]:
                del self.by_id[key]
        return revision

    def get(self, sampler_id: str) -> Revision:
        with self.lock:
            if sampler_id not in self.by_id:
                raise WireError(f"sampling session {sampler_id!r} is not on this server "
                                f"(unnamed sampler weights: the newest {KEPT_UNNAMED} are kept)")
            return self.by_id[sampler_id]


def folder_of(run_dir: Path, path: str) -> Path:
    """The folder a tinker:// path names under the run folder, or one line on what is wrong."""
    m = PATH.match(path or "")
    if not m or not NAME.match(m["name"]):
        raise WireError(f"path {path!r} is not tinker://MODEL_ID/weights/NAME or "
                        "tinker://MODEL_ID/sampler_weights/NAME")
    folder = run_dir / "tinker" / safe(m["run"]) / m["kind"] / m["name"]
    if not (folder / "run.json").is_file():
        raise WireError(f"no checkpoint at {path} on this server")
    return folder


def safe(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in model_id)


def tinker_path(model_id: str, kind: str, name: str) -> str:
    if not NAME.match(name or ""):
        raise WireError(f"checkpoint name {name!r}: letters, digits, '.', '_' or '-' (up to 128)")
    return f"tinker://{model_id}/{kind}/{name}"


def write_checkpoint(run_dir: Path, path: str, state: dict[str, Tensor], meta: dict[str, Any],
                     optimizer: dict[str, Any] | None = None) -> Path:
    """The adapter (safetensors), AdamW's state (with `optimizer`) and run.json, atomically."""
    from safetensors.torch import save_file
    m = PATH.match(path)
    final = run_dir / "tinker" / safe(m["run"]) / m["kind"] / m["name"]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"))
    if optimizer is not None:
        torch.save(optimizer, tmp / "optimizer.pt")
    (tmp / "run.json").write_text(json.dumps({**meta, "path": path, "time": time.time()}, indent=1))
    for f in tmp.iterdir():
        fsync_path(f)
    put_in_place(tmp, final)
    return final


def read_checkpoint(folder: Path, optimizer: bool) -> tuple[dict[str, Tensor], dict[str, Any], Any]:
    """(adapter state, run.json, AdamW state or None)."""
    from safetensors.torch import load_file
    meta = json.loads((folder / "run.json").read_text())
    opt = None
    if optimizer:
        if not (folder / "optimizer.pt").is_file():
            raise WireError(f"{meta['path']} holds no optimizer state (sampler weights): load it "
                            "without the optimizer")
        opt = torch.load(folder / "optimizer.pt", weights_only=True)
    return load_file(str(folder / "adapter_model.safetensors")), meta, opt


def list_checkpoints(run_dir: Path, model_id: str) -> list[dict[str, Any]]:
    """Every checkpoint of a training client, as the SDK's `Checkpoint`."""
    out = []
    for kind in KINDS:
        for folder in sorted((run_dir / "tinker" / safe(model_id) / kind).glob("[!.]*")):
            if (folder / "run.json").is_file():
                meta = json.loads((folder / "run.json").read_text())
                out.append({"checkpoint_id": f"{kind}/{folder.name}", "tinker_path": meta["path"],
                            "checkpoint_type": "training" if kind == "weights" else "sampler",
                            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(meta["time"])),
                            "size_bytes": sum(f.stat().st_size for f in folder.iterdir())})
    return out
