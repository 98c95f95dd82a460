"""The in-process vLLM engine's processes in a session of their own, so that a signal sent to the
trainer's whole process group (a terminal's Ctrl-C, a scheduler's SIGTERM to the job's group)
reaches the trainer alone: the trainer finishes its step on the engine, saves a checkpoint and
closes the engine itself (vLLM's shutdown: SIGTERM to the engine core by its pid, which stops its
workers and frees their shared memory). In the trainer's group, vLLM's own handlers would stop
the engine at the signal and the step in flight would fail on a dead engine.

Out of the group, the engine would outlive a trainer killed outright (SIGKILL, the OOM killer):
the engine core watches its parent and shuts down, as on a close, once the trainer is gone.

The hook is the executor class (`distributed_executor_backend` takes an Executor subclass): vLLM
builds it inside the engine core process, before the core starts its workers, which then share
the core's session; what it runs there is `vllm_worker.detach_from_trainer`.
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from posttrain.rollout.vllm_worker import (TRAINER_PID, detach_from_trainer,  # noqa: F401
                                           quiet_shared_memory_readers)


class DetachedMultiprocExecutor(MultiprocExecutor):
    """vLLM's executor of worker processes (CPU), the core detached first; its readers of the
    worker's messages, and the worker's of the core's, sleep instead of spinning between
    messages (the trainer updates on the same cores: vllm_worker.quiet_shared_memory_readers)."""

    def _init_executor(self) -> None:
        detach_from_trainer()
        quiet_shared_memory_readers()
        super()._init_executor()


class DetachedUniProcExecutor(UniProcExecutor):
    """vLLM's executor with the worker in the engine core (one GPU), the core detached first."""

    def _init_executor(self) -> None:
        detach_from_trainer()
        super()._init_executor()


def detached_executor(cuda: bool) -> type:
    """The executor vLLM would pick for one engine on this device, detaching: one GPU, the
    worker in the core; a CPU, a worker process (vLLM's CPU backend needs it for its OpenMP
    settings, unless multiprocessing is off)."""
    if cuda or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        return DetachedUniProcExecutor
    return DetachedMultiprocExecutor
