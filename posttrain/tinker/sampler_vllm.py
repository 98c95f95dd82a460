"""Sampling for a Tinker server through vLLM (`posttrain tinker-serve --sampler vllm`): the base
model in one in-process `vllm.LLM` with LoRA enabled (rollout/vllm_engines.LocalEngine), each
sampler revision's adapter written once as a peft folder and named in the requests that sample
it (a vLLM LoRARequest of its own id), so a sampling session stays pinned to its revision's
weights while training clients go on updating theirs.

What a sample carries is what the in-process sampler (sampler.py) gives: the tokens, each one's
log-prob at the sampling temperature (vLLM's `processed_logprobs`), and whether it stopped (EOS,
a stop string or token) or ran out of tokens. Each sample is one vLLM request seeded from its own
seed (sampler.sample_seeds), so it depends on that seed alone, not on what shares its batch; the
stream of random numbers is vLLM's, so a seed does not draw the tokens the in-process sampler
draws. Prompt log-probs, when asked, come from the training model (sampler.prompt_logprobs).
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from posttrain.tinker.models import Models, lora_config
from posttrain.tinker.revisions import Revision, folder_of
from posttrain.tinker.sampler import (prompt_logprobs, prompt_tokens,
                                      sample_seeds, sampling_params, slot_for)
from posttrain.tinker.wire import Sequence, WireError

KEPT_ADAPTERS = 32     # adapter folders kept on disk for vLLM (the most recently sampled)


class VllmSampler:
    """The base model in vLLM; `folder`: where it was loaded from (vLLM reads it there)."""

    def __init__(self, models: Models, folder: str, run_dir: Path, *, max_lora_rank: int = 32,
                 dtype: str = "float32", max_model_len: int | None = None) -> None:
        from posttrain.config.rollout import RolloutConfig
        from posttrain.rollout.vllm_engines import LocalEngine
        self.models, self.max_lora_rank = models, max_lora_rank
        self.adapters = run_dir / "tinker" / ".vllm_adapters"   # (written, never read back by a client)
        shutil.rmtree(self.adapters, ignore_errors=True)
        self.written: OrderedDict[tuple, int] = OrderedDict()   # revision key -> vLLM's LoRA id
        self.run_dir = run_dir
        self.next_id = 1
        # (vLLM refuses a length its KV cache cannot hold: the model's positions, at most 8192)
        limit = max_model_len or min(getattr(models.base.config, "max_position_embeddings", 2048), 8192)
        self.engine = LocalEngine(folder, dtype, 0, limit, RolloutConfig(backend="vllm", vllm_sleep=False),
                                  enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
                                  max_cpu_loras=KEPT_ADAPTERS)

    def __call__(self, revision: Revision, requests: list[dict[str, Any]],
                 generator: torch.Generator) -> list[tuple[list[Sequence], list[float] | None]]:
        """Every request's `num_samples` continuations, as sampler.sample returns them."""
        from posttrain.rollout.vllm import sampling_kwargs
        fields = requests[0].get("sampling_params") or {}
        params, stop_ids = sampling_params(fields)
        kwargs = {**sampling_kwargs(params), "stop_token_ids": sorted(stop_ids) or None}
        if fields.get("stop") == []:
            kwargs["ignore_eos"] = True          # (Tinker: an empty list stops nowhere, not even at EOS)
        seeds = [sample_seeds(r, generator) for r in requests]
        rows = [prompt_tokens(r) for r, s in zip(requests, seeds) for _ in s]
        flat = [k & 0x7FFF_FFFF_FFFF for s in seeds for k in s]
        out = self.engine.complete(rows, 1, kwargs, flat, lora=self.lora_request(revision))
        results, row = [], 0
        for r, s in zip(requests, seeds):
            sequences = [Sequence(list(c.token_ids), list(c.logprobs), not c.truncated)
                         for [c] in out[row:row + len(s)]]
            results.append((sequences, self.prompt_logprobs(revision, r)))
            row += len(s)
        return results

    def lora_request(self, revision: Revision):
        """The revision's adapter as vLLM loads it (None: the base model), written on first use."""
        from vllm.lora.request import LoRARequest
        if revision.lora is None:
            return None
        rank = int(revision.lora["rank"])
        if rank > self.max_lora_rank:
            raise WireError(f"LoRA rank {rank} is over the vLLM sampler's {self.max_lora_rank}: "
                            "start tinker-serve with a larger --vllm_max_lora_rank")
        key = self.key(revision)
        if key not in self.written:
            self.write(revision, key)
        self.written.move_to_end(key)
        lora_id = self.written[key]
        return LoRARequest(f"r{lora_id}", lora_id, str(self.adapters / str(lora_id)))

    def key(self, revision: Revision) -> tuple:
        """What names a revision's weights: its serial (a session id saved over gets a new one)
        and, for saved sampler weights (a name can be saved over), its folder's write time."""
        if revision.path is None:
            return (revision.serial,)
        return (revision.serial, (folder_of(self.run_dir, revision.path) / "run.json").stat().st_mtime_ns)

    def write(self, revision: Revision, key: tuple) -> None:
        """The revision's adapter as a peft folder (config and safetensors); the oldest folders
        beyond KEPT_ADAPTERS removed (vLLM keeps at most as many loaded, evicting the oldest)."""
        from safetensors.torch import save_file
        lora_id, self.next_id = self.next_id, self.next_id + 1
        folder = self.adapters / str(lora_id)
        folder.mkdir(parents=True)
        config = lora_config(revision.lora)
        config.base_model_name_or_path = self.models.name
        config.save_pretrained(str(folder))
        save_file({k: v.detach().contiguous() for k, v in revision.state.items()},
                  str(folder / "adapter_model.safetensors"))
        self.written[key] = lora_id
        while len(self.written) > KEPT_ADAPTERS:
            _, old = self.written.popitem(last=False)
            shutil.rmtree(self.adapters / str(old), ignore_errors=True)

    def prompt_logprobs(self, revision: Revision, request: dict[str, Any]) -> list[float] | None:
        if not request.get("prompt_logprobs"):
            return None
        with torch.no_grad(), self.models.use(slot_for(self.models, revision)) as model:
            return prompt_logprobs(model, prompt_tokens(request))

    def close(self) -> None:
        self.engine.close()
        shutil.rmtree(self.adapters, ignore_errors=True)


def check_vllm(max_lora_rank: int) -> None:
    """Before the model loads: vLLM is installed, and the rank is one its LoRAConfig takes."""
    import importlib.util
    from posttrain.rollout.vllm import INSTALL_HINT
    from posttrain.util.errors import ConfigError
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("--sampler vllm: " + INSTALL_HINT.replace('rollout.backend="vllm" ', ""))
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    if max_lora_rank not in allowed:
        raise ConfigError(f"--vllm_max_lora_rank {max_lora_rank}: one of "
                          f"{', '.join(map(str, allowed))}")
