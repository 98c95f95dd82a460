"""Host memory a checkpoint's weight gather costs on each FSDP2 rank: every rank gathering the full
state (each shard's `full_tensor()`, the old way) against `distributed.full_state_dict` (rank 0
only, `get_model_state_dict(full_state_dict=True, cpu_offload=True)`).

    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_checkpoint_memory.py old
    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_checkpoint_memory.py new

Two gloo ranks on the CPU, a randomly initialised model of SmolLM2-135M-Instruct's shape (its
config.json, float32: 0.54 GB of weights; the decoder layers sharded as `posttrain train
--parallel.strategy fsdp` shards them). Prints the growth of each rank's resident memory while the
gathered state dict is held (one way per run: memory freed by one gather stays with the
allocator and would hide the next). Tied embeddings count twice in 'tensors held'.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from posttrain.model.distributed import _is_sharded, full_state_dict, init_world, wrap
    from posttrain.model.loading import prepare_embedded
    torch.set_num_threads(1)
    world = init_world("fsdp")
    if world.main:
        prepare_embedded()   # (converted once, by one rank)
    dist.barrier()
    config = AutoConfig.from_pretrained(prepare_embedded())
    torch.manual_seed(0)
    model = wrap(AutoModelForCausalLM.from_config(config), world)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not _is_sharded(p)) + sum(
        p.to_local().numel() * p.element_size() for p in model.parameters() if _is_sharded(p))
    results = {}
    methods = (
            ("every rank gathers (old)", lambda: {k: (v.full_tensor() if _is_sharded(v) else v).detach().cpu()
                                                  for k, v in model.state_dict().items()}),
            ("rank 0 only (full_state_dict)", lambda: full_state_dict(model, world)))
    which = sys.argv[1] if len(sys.argv) > 1 else "new"   # one per process: freed memory stays
    for name, gather in methods[:1] if which == "old" else methods[1:]:  # in the allocator
        gc.collect()
        dist.barrier()
        before = rss_mb()
        state = gather()
        held = sum(v.numel() * v.element_size() for v in state.values()) / 2 ** 20
        grown = rss_mb() - before
        del state
        gc.collect()
        results[name] = (grown, held)
        dist.barrier()
    rows = [None] * world.size
    dist.all_gather_object(rows, results)
    if world.main:
        print(f"model shard per rank: {n_bytes / 2 ** 20:.0f} MB; full weights "
              f"{sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) * 4 / 2 ** 20:.0f} MB")
        for name in results:
            for rank, r in enumerate(rows):
                print(f"{name:32s} rank {rank}: resident memory +{r[name][0]:.0f} MB "
                      f"(tensors held {r[name][1]:.0f} MB)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
