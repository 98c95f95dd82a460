"""The trainer's weights, written where vLLM engines can load them: a safetensors folder in shared
memory (`/dev/shm`), one per weight version, which each engine reloads in place
(rollout/vllm_worker.py). This path works on a CPU and on a GPU, in process and for any number of
`vllm serve` processes on this machine; the CUDA-only transfers (IPC, NCCL) live in rollout/vllm.py.

Why a folder and not tensors through `collective_rpc`: the server route takes strings only, and
the in-process route would pickle 270 MB through vLLM's message queue; a file in shared memory is
read by every engine at memory speed and leaves nothing behind on disk. The folder of the
previous version is removed once the engines hold the new one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from posttrain.rollout.vllm_worker import fingerprint


def shared_memory_root() -> Path:
    """/dev/shm where it exists and is writable (Linux), else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def engine_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The policy's weights as the engine loads them: cast to its dtype, contiguous, tied
    weights once (the LM head tied to the embedding is the embedding)."""
    seen: dict[int, str] = {}
    out = {}
    for name, t in state.items():
        if t.data_ptr() in seen:      # (a tied copy: vLLM ties it again from its config)
            continue
        seen[t.data_ptr()] = name
        out[name] = t.detach().to("cpu", dtype).contiguous()
    return out


class WeightFolders:
    """Writes each weight version to its own folder under shared memory; keeps the newest."""

    def __init__(self, dtype: torch.dtype, root: Path | None = None) -> None:
        self.dtype = dtype
        self.dir = Path(tempfile.mkdtemp(prefix="posttrain-weights-", dir=root or shared_memory_root()))
        self.version = -1
        self.current: Path | None = None

    def write(self, full_state: dict[str, torch.Tensor]) -> tuple[Path, int, list[float]]:
        """The next version's folder, its number and the fingerprint an engine must report
        after loading it."""
        from safetensors.torch import save_file
        state = engine_state_dict(full_state, self.dtype)
        self.version += 1
        folder = self.dir / f"v{self.version:06d}"
        folder.mkdir()
        save_file(state, str(folder / "model.safetensors"))
        return folder, self.version, fingerprint(state.items())

    def loaded(self, folder: Path) -> None:
        """Every engine holds `folder`'s weights: older folders go."""
        for old in self.dir.iterdir():
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self.current = folder

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
