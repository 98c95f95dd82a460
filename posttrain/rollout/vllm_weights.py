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

import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from posttrain.rollout.vllm_worker import fingerprint

log = logging.getLogger("posttrain")


def shared_memory_root(version_bytes: int, copies: int = 2) -> Path:
    """/dev/shm where it exists, is writable and holds `copies` versions of the weights (the
    newest is written before the previous one goes; asynchronous training: the one the engine
    holds, one waiting and one being written; Docker's default /dev/shm is 64 MB), else the
    temporary folder, said in one line."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        free = shutil.disk_usage(shm).free
        if free >= copies * version_bytes:
            return shm
        log.warning("vLLM weight pushes go through %s: /dev/shm has %.2f GB free, %d versions of "
                    "the weights take %.2f GB (Docker: --shm-size)", tempfile.gettempdir(),
                    free / 1e9, copies, copies * version_bytes / 1e9)
    return Path(tempfile.gettempdir())


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

    def __init__(self, dtype: torch.dtype, root: Path | None = None, copies: int = 2) -> None:
        self.dtype, self.root, self.copies = dtype, root, copies
        self.dir: Path | None = None      # (made on the first write, where the weights fit)
        self.version = -1
        self.current: Path | None = None
        self._remove = None

    def write(self, full_state: dict[str, torch.Tensor],
              whole: bool = True) -> tuple[Path, int, list[float | None]]:
        """The next version's folder, its number and the fingerprint an engine must report
        after loading it (`whole` False: without the sums over whole matrices, which engines
        that drop their weights after packing them cannot report)."""
        from safetensors.torch import save_file
        state = engine_state_dict(full_state, self.dtype)
        if self.dir is None:
            size = sum(t.numel() * t.element_size() for t in state.values())
            self.dir = Path(tempfile.mkdtemp(prefix="posttrain-weights-",
                                             dir=self.root or shared_memory_root(size, self.copies)))
            # removed however the run ends (an error, a signal's exit), not only by close()
            self._remove = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.version += 1
        folder = self.dir / f"v{self.version:06d}"
        folder.mkdir()
        save_file(state, str(folder / "model.safetensors"))
        return folder, self.version, fingerprint(state.items(), whole)

    def loaded(self, folder: Path) -> None:
        """Every engine holds `folder`'s weights: older folders go (a newer one, written while
        the engines sampled, stays for their next load)."""
        for old in self.dir.iterdir():
            if int(old.name[1:]) < int(folder.name[1:]):   # ('v000042': the version)
                shutil.rmtree(old, ignore_errors=True)
        self.current = folder

    def close(self) -> None:
        if self._remove is not None:
            self._remove()
