"""Data-parallel training on torch.distributed: launched by `torchrun`, DDP or FSDP2 by config.

    torchrun --nproc-per-node 8 -m posttrain.cli train ...                  (one node)
    torchrun --nnodes 2 --node-rank R --rdzv-endpoint HOST:29500 --nproc-per-node 8 -m posttrain.cli train ...

How a step is split (the loop in rl/loop.py is unchanged; it asks this module where to split):
- every rank draws the same P prompts from the same stream and keeps its contiguous P / world share,
  so each prompt's group of G responses lives on one rank and group advantages stay exact;
- every response is sampled from noise keyed by its own seed (rollout.hf.hash_uniform), so a run on
  N ranks samples exactly the responses of the same run on 1 rank;
- the loss of each rank is weighted with the *global* token / response counts (`global_sum`) and
  scaled by world size, so DDP's gradient average equals the 1-process gradient of the whole batch;
- metrics are averaged over ranks; rank 0 writes logs, checkpoints (full, unsharded state: they
  resume on any number of ranks) and the final model.
Under FSDP2 (`fully_shard` on every decoder layer and the root) parameters, gradients and optimizer
states are sharded; generation gathers the full weights once (`unshard`) and keeps them for the
whole sampling loop, so ranks that finish early never wait on each other's collectives.
Gloo on CPU, NCCL on GPUs. A plain `posttrain train` (no torchrun) never touches this module's
process group.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger("posttrain")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    strategy: str = "none"          # 'none' (one process), 'ddp', 'fsdp'

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, n: int) -> slice:
        """This rank's contiguous share of n items (n divisible by the world size)."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


SINGLE = World()


def init_world(strategy: str = "ddp") -> World:
    """Join the process group torchrun describes in the environment; one process: no group."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SINGLE
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        # A process that exits with the group alive can abort in gloo's thread teardown
        # ("terminate called without an active exception", SIGABRT), failing a run that finished;
        # library callers (a script calling train() or sft()) need not remember to leave it.
        atexit.register(_leave_group)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return World(dist.get_rank(), dist.get_world_size(), local_rank, strategy)


def device_for(world: World) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def global_sum(x: Tensor, world: World) -> Tensor:
    """Sum of a tensor over ranks (a copy; the input is untouched)."""
    if not world.distributed:
        return x
    out = x.detach().clone()
    dist.all_reduce(out)
    return out


def mean_metrics(metrics: dict[str, float], world: World) -> dict[str, float]:
    """Average every numeric metric over ranks (missing / None on a rank: averaged over the rest)."""
    if not world.distributed:
        return metrics
    keys = sorted(metrics)
    all_keys: list[list[str]] = [None] * world.size  # type: ignore[list-item]
    dist.all_gather_object(all_keys, keys)
    union = sorted(set().union(*all_keys))
    values = torch.zeros(len(union), dtype=torch.float64)
    counts = torch.zeros(len(union), dtype=torch.float64)
    for i, k in enumerate(union):
        v = metrics.get(k)
        if isinstance(v, (int, float)):
            values[i], counts[i] = float(v), 1.0
    dist.all_reduce(values)
    dist.all_reduce(counts)
    out = {}
    for i, k in enumerate(union):
        if k.endswith("_max"):      # maxima are not averages; recompute exactly
            t = torch.tensor([float(metrics.get(k) or float("-inf"))], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[k] = t.item()
        else:
            out[k] = (values[i] / counts[i]).item() if counts[i] > 0 else None
    return out


def wrap(model, world: World):
    """Prepare a model for data-parallel training, in place.

    'ddp': weights replicated; `average_gradients` all-reduces the gradients once per optimizer
    step (DDP's arithmetic; DDP's own wrapper arms its reducer in its forward, which the trainer's
    prompt-shared body + head calls bypass).
    'fsdp': FSDP2 `fully_shard` on every decoder layer: their weights, gradients and Adam states
    are sharded over the ranks and gathered layer by layer. The embeddings, final norm and LM head
    stay replicated (tied input/output embeddings would otherwise span two FSDP groups); their
    gradients are averaged like DDP's."""
    if not world.distributed:
        return model
    if world.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model.get_decoder().layers:
            fully_shard(layer)
    elif world.strategy != "ddp":
        raise ValueError(f"parallel.strategy={world.strategy!r} is not valid; accepted: ['ddp', 'fsdp']")
    return model


def _is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def average_gradients(params: list[Tensor], world: World) -> None:
    """Mean over ranks of every replicated parameter's gradient, as one flat all-reduce (FSDP2
    already reduce-scattered the sharded ones in its backward hooks)."""
    if not world.distributed:
        return
    params = [p for p in params if p.requires_grad and not _is_sharded(p)]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world.size
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def clip_grad_norm(params: list[Tensor], max_norm: float, world: World) -> Tensor:
    """Global gradient norm over replicated and sharded parameters, and clipping to max_norm
    (torch's clip_grad_norm_ cannot mix DTensor shards with plain tensors)."""
    if not world.distributed or world.strategy != "fsdp":
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if _is_sharded(g):
            sharded += g.to_local().double().pow(2).sum().cpu()
        else:
            replicated += g.double().pow(2).sum().cpu()
    dist.all_reduce(sharded)
    total = (sharded + replicated).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, torch.float32))
    return total.float()


@contextlib.contextmanager
def full_weights_for_generation(model, world: World):
    """FSDP2: gather the full parameters once and keep them through the sampling loop (no
    collective per token, so ranks whose responses end early never block the others)."""
    if model is None or world.strategy != "fsdp" or not world.distributed:
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model, world: World, only=None) -> dict[str, Tensor]:
    """The full (unsharded) model state on CPU, for rank 0 to save; `only(name)` picks entries
    (LoRA: the adapters). Under FSDP every rank must call it (the gather is collective), and only
    rank 0 receives the tensors, gathered one at a time into CPU memory (torch.distributed's
    `get_model_state_dict` with full_state_dict and cpu_offload): the other ranks get {}, so a
    checkpoint costs one full copy on the host, not one per rank (7B x 8 ranks would be 8 x 28
    GB in float32)."""
    if world.strategy == "fsdp" and world.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
        return {k: v.detach() for k, v in state.items() if only is None or only(k)}
    out = {}
    for k, v in model.state_dict().items():
        if only is None or only(k):
            out[k] = (v.full_tensor() if _is_sharded(v) else v).detach().cpu()
    return out


def optimizer_state(model, optimizer) -> dict:
    """Optimizer state with full tensors, keyed by parameter name: the same format on any number
    of ranks and strategy, so a checkpoint resumes anywhere (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def global_max(x: float, world: World) -> float:
    if not world.distributed:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_objects(obj, world: World) -> list:
    if not world.distributed:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def global_aggregation_weights(fn, mask_B_T: Tensor, max_len: float, world: World) -> Tensor:
    """Per-token loss weights as if every rank's rows were one batch, times the world size (the
    gradient average divides by it again): token-mean and sequence-mean normalisers then count
    the tokens and responses of the whole global batch, exactly as one process would."""
    if not world.distributed:
        return fn(mask_B_T, max_len)
    masks = gather_objects(mask_B_T.detach().cpu(), world)
    T = max(m.shape[1] for m in masks)
    full = torch.cat([torch.nn.functional.pad(m, (0, T - m.shape[1])) for m in masks])
    start = sum(m.shape[0] for m in masks[:world.rank])
    mine = fn(full, max_len)[start:start + mask_B_T.shape[0], :mask_B_T.shape[1]]
    return mine.to(mask_B_T.device) * world.size
