"""How the trainer's new weights reach the vLLM engines (rollout/vllm_engines.py picks one):

- `SharedMemoryPush`: each version a safetensors folder in shared memory (any device, engines on
  this machine); every engine reloads it in place (rollout/vllm_worker.py) and reports the version
  and fingerprint it holds. Written once and loaded later when sampling runs ahead.
- `CudaIPCPush` and `NcclPush`: vLLM's CUDA weight-transfer engines (in process; one server).
  Written for GPUs, not run on one yet: docs/scaling.md.
"""

from __future__ import annotations

import logging
import os

import torch

from posttrain.rollout.vllm import EngineGone, Pushed, VLLMRolloutEngine, Written, free_port
from posttrain.rollout.vllm_weights import WeightFolders
from posttrain.rollout.vllm_worker import FULL_CHECK_EVERY

log = logging.getLogger("posttrain")


class SharedMemoryPush:
    """Each version of the weights a safetensors folder in shared memory; every engine reloads
    it in place (rollout/vllm_worker.py) and reports the version and fingerprint it holds."""

    def __init__(self, dtype: torch.dtype, world, copies: int = 2) -> None:
        self.folders = WeightFolders(dtype, copies=copies)
        self.world = world
        self._folder = None
        self.whole = True    # (False once a full check reports no whole-matrix sums)
        self.seconds: dict[str, float] = {}   # the last load's reload, repack and check

    def write(self, model) -> Written | None:
        """The trainer's weights as the next version's folder (None on ranks other than 0, which
        only take part in gathering them). No engine is touched: they may be sampling."""
        from posttrain.model.distributed import full_state_dict
        state = full_state_dict(model, self.world)   # (every rank: FSDP gathers are collective)
        if not self.world.main:
            return None
        whole = self.whole and self.full(self.folders.version + 1)
        return Written(*self.folders.write(state, whole))

    def load(self, engines: list, written: Written | None, owner: VLLMRolloutEngine) -> Pushed | None:
        """Every engine reloads `written` in place; the version and fingerprint they must report."""
        if written is None:
            return None
        for engine in engines:
            try:
                engine.reported = engine.rpc("posttrain_load", {
                    "path": str(written.folder), "version": str(written.version),
                    "full": str(int(self.full(written.version)))})
                self.seconds = engine.reported[0].get("seconds", {}) if engine.reported else {}
                if self.full(written.version):
                    self.whole = self.whole and all(s["fingerprint"][4] is not None
                                                    for s in engine.reported)
            except EngineGone as e:
                owner.drop(engine, str(e))
        self._folder = written.folder
        return Pushed(written.version, written.fingerprint)

    @staticmethod
    def full(version: int) -> bool:
        """Whether the push of `version` is checked fully (vllm_worker.engine_fingerprint): the
        first, then every FULL_CHECK_EVERY-th."""
        return version % FULL_CHECK_EVERY == 0

    def send(self, model, engines: list, owner: VLLMRolloutEngine) -> Pushed | None:
        """Write the weights, then every engine loads them (`write`, `load`)."""
        return self.load(engines, self.write(model), owner)

    def loaded(self) -> None:
        self.folders.loaded(self._folder)

    def close(self) -> None:
        self.folders.close()


class CudaIPCPush:
    """vLLM's IPC weight transfer into an in-process engine on the trainer's GPU (no copy through
    the CPU). Written for CUDA; not run on a GPU yet."""

    def __init__(self, model, engine, dtype: torch.dtype) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.ipc_engine import (IPCTrainerInitInfo,
                                                                 IPCTrainerWeightTransferEngine)
        self.engine, self.dtype = engine, dtype
        self.sender = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=_LLMClient(engine.llm), source=ModuleSource(model))

    def send(self, model, engines: list, owner) -> Pushed:
        self.engine.wake(["weights"])
        self.sender.send_weights()
        return Pushed(None, _fingerprint_of(model, self.dtype))

    def loaded(self) -> None:
        pass

    def close(self) -> None:
        pass


class NcclPush:
    """vLLM's NCCL weight broadcast from trainer rank 0 to `vllm serve` servers on other GPUs.
    Written for CUDA; not run on a GPU yet."""

    def __init__(self, model, servers: list, world, dtype: torch.dtype) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                  NCCLTrainerWeightTransferEngine)
        if len(servers) != 1:
            raise RuntimeError("rollout.vllm_weight_push nccl takes one server; use shm for several")
        server = servers[0]
        inference_world = int(server.http.get(f"{server.url}/get_world_size", timeout=30).json()["world_size"])
        # (a free port of rank 0's machine, not a fixed one: another run's, or a process waiting
        # on it, never meets this push; every rank takes rank 0's; POSTTRAIN_VLLM_SYNC_PORT names one)
        from posttrain.model.distributed import gather_objects
        port = os.environ.get("POSTTRAIN_VLLM_SYNC_PORT") or gather_objects(free_port(), world)[0]
        init = NCCLTrainerInitInfo(
            master_address=os.environ.get("POSTTRAIN_VLLM_SYNC_ADDR", "127.0.0.1"),
            master_port=int(port), world_size=1 + inference_world, rank=world.rank)

        class Client(HTTPVLLMWeightSyncClient):   # (on the server's session: with its secret)
            def _post(self, path: str, json: dict | None = None) -> None:
                server.http.post(f"{self.base_url}/{path}", json=json,
                                 timeout=self.timeout).raise_for_status()
        self.sender = NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=Client(server.url), source=ModuleSource(model))
        self.dtype, self.world = dtype, world

    def send(self, model, engines: list, owner) -> Pushed | None:
        self.sender.send_weights()   # (every rank takes part in gathering FSDP's shards)
        return Pushed(None, _fingerprint_of(model, self.dtype)) if self.world.main else None

    def loaded(self) -> None:
        pass

    def close(self) -> None:
        pass


class _LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an in-process `vllm.LLM`."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _fingerprint_of(model, dtype: torch.dtype) -> list[float]:
    """The fingerprint of the weights as the engine holds them (cast to its dtype)."""
    from posttrain.rollout.vllm_worker import fingerprint
    return fingerprint((n, p.detach().to(dtype)) for n, p in model.named_parameters())
