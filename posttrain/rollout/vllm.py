"""Sampling with vLLM (GPU only; `pip install "posttrain[vllm]"`).

Two layouts, both behind the same `RolloutEngine` contract as the in-process sampler:

- **colocated** (`rollout.vllm_server` unset): a `vllm.LLM` on the trainer's GPU, taking
  `rollout.vllm_gpu_memory_utilization` of its memory. With `rollout.vllm_sleep` the engine sleeps
  (weights offloaded, KV cache freed) while the trainer updates, and wakes for the next batch.
  New weights go over CUDA IPC (vLLM's `ipc` weight-transfer backend): no copy on disk, no copy
  through the CPU.
- **server** (`rollout.vllm_server=http://host:port`): a separate `vllm serve` process, on other
  GPUs, started as

      VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs \\
          --weight-transfer-config '{"backend": "nccl"}'

  (DEV mode exposes vLLM's weight-update routes). Responses come from `/v1/completions` with
  token ids in and out; new weights are broadcast over NCCL from trainer rank 0 (every rank joins
  the gather of FSDP shards).

Either way the engine records each sampled token's log-prob after temperature
(`processed_logprobs`), which the trainer compares with its own (`rollout/logp_mismatch`) and
corrects for with truncated importance sampling (`losses.correction.truncated_is_weights`).
Group g of prompt i is sampled with vLLM's seed `seeds[i * G] + g` (vLLM gives the n children of
a request seed s+index), so a response depends on its prompt's seed only, as with the in-process
sampler.

Why the weight-transfer engines and not `model.load_weights` through the engine's internals:
they are vLLM's supported path for RL trainers, handle FSDP's DTensors, and do not depend on
private attributes that change between releases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.rollout.base import Rollout, SamplingParams

log = logging.getLogger("posttrain")
from posttrain.prompts import left_pad

INSTALL_HINT = ('rollout.backend="vllm" needs vLLM and a CUDA GPU: pip install "posttrain[vllm]" '
                "(or use rollout.backend=hf)")


@dataclass(frozen=True)
class Completion:
    """One sampled response as any engine reports it."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]     # log-prob of each sampled token (after temperature)
    truncated: bool               # stopped by the token limit, not by EOS or a stop string


def to_rollout(prompts: list[list[int]], group_size: int, completions: list[Completion],
               pad_id: int) -> Rollout:
    """Pack engine output into the trainer's padded layout (prompts left, responses right)."""
    G = group_size
    if len(completions) != len(prompts) * G:
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts x {G}")
    ids_P_L, mask_P_L = left_pad(prompts, pad_id)
    B = len(completions)
    T = max(1, max(len(c.token_ids) for c in completions))
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if len(c.logprobs) != n:
            raise ValueError(f"completion {i}: {n} tokens but {len(c.logprobs)} log-probs")
        if n:
            tokens[i, :n] = torch.tensor(list(c.token_ids), dtype=torch.long)
            logp[i, :n] = torch.tensor(list(c.logprobs), dtype=torch.float32)
            mask[i, :n] = 1.0
    return Rollout(ids_P_L.repeat_interleave(G, 0), mask_P_L.repeat_interleave(G, 0), tokens,
                   mask, logp, torch.tensor([c.truncated for c in completions]), G)


def completion_from_vllm(output) -> Completion:
    """A `vllm.CompletionOutput` (logprobs=0: the sampled token's entry) as a Completion."""
    ids = list(output.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(ids, output.logprobs or [])]
    return Completion(ids, logprobs, output.finish_reason == "length")


def completion_from_openai(choice: dict) -> Completion:
    """One choice of vLLM's `/v1/completions` answer (return_token_ids, logprobs=0)."""
    ids = list(choice["token_ids"])
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    return Completion(ids, logprobs, choice.get("finish_reason") == "length")


def request_seed(seeds: Tensor | None, i: int, group_size: int) -> int | None:
    """vLLM's seed for prompt i's request (its children take seed + g); None: unseeded."""
    if seeds is None:
        return None
    return int(seeds[i * group_size]) & 0x7FFF_FFFF_FFFF   # non-negative, room for + g


class _LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an in-process `vllm.LLM` (its offline RL
    methods take the request dicts that the HTTP routes take)."""

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


class VLLMRolloutEngine:
    """The trainer's `RolloutEngine` on vLLM. `model` is the trainer's policy (its weights are
    sent after every update); `model_path` the folder vLLM loads the architecture from."""

    def __init__(self, model, tokenizer, model_path: str, rollout_cfg, dtype: str, seed: int,
                 max_model_len: int, rank: int = 0, world_size: int = 1) -> None:
        try:
            import vllm  # noqa: F401
            from vllm.distributed.weight_transfer.base import ModuleSource
        except ImportError as e:
            raise RuntimeError(INSTALL_HINT) from e
        if not torch.cuda.is_available():
            raise RuntimeError(INSTALL_HINT)
        if hasattr(model, "get_base_model"):
            raise RuntimeError("rollout.backend='vllm' with LoRA is not supported yet: the "
                               "adapters would have to be merged before every sync")
        self.model, self.tokenizer = model, tokenizer
        self.cfg = rollout_cfg
        self.pad_id = tokenizer.pad_token_id
        self.rank = rank
        self.server = rollout_cfg.vllm_server
        self.asleep: list[str] = []     # colocated: what the engine has released ('weights', ...)
        source = ModuleSource(model)
        if self.server:
            self._init_server(source, world_size)
        else:
            if world_size > 1:
                raise RuntimeError("colocated vLLM under torchrun is not supported yet; start a "
                                   "`vllm serve` process and set rollout.vllm_server")
            self._init_colocated(source, model_path, dtype, seed, max_model_len)

    # -- set-up ------------------------------------------------------------------------------

    def _init_colocated(self, source, model_path: str, dtype: str, seed: int,
                        max_model_len: int) -> None:
        from vllm import LLM
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo, IPCTrainerWeightTransferEngine)
        self.llm = LLM(model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=seed,
                       gpu_memory_utilization=self.cfg.vllm_gpu_memory_utilization,
                       enable_sleep_mode=self.cfg.vllm_sleep, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs",
                       weight_transfer_config={"backend": "ipc"})
        self.sender = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=_LLMClient(self.llm), source=source)

    def _init_server(self, source, world_size: int) -> None:
        import requests
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine)
        self.http = requests.Session()
        url = self.server.rstrip("/")
        try:
            info = self.http.get(f"{url}/get_world_size", timeout=30)
            info.raise_for_status()
        except requests.RequestException as e:
            raise RuntimeError(f"rollout.vllm_server={self.server!r} does not answer "
                               f"/get_world_size ({e}); start it with VLLM_SERVER_DEV_MODE=1 "
                               "(see posttrain/rollout/vllm.py)") from e
        inference_world = int(info.json()["world_size"])
        init = NCCLTrainerInitInfo(
            master_address=os.environ.get("POSTTRAIN_VLLM_SYNC_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("POSTTRAIN_VLLM_SYNC_PORT", "51216")),
            world_size=1 + inference_world, rank=self.rank)
        self.sender = NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=HTTPVLLMWeightSyncClient(url), source=source)

    # -- the RolloutEngine contract ----------------------------------------------------------

    def sync_weights(self) -> None:
        """Send the trainer's weights (called after every optimizer update), then empty the
        prefix cache: its keys and values were computed by the old weights, and vLLM leaves the
        reset to the caller (a group's shared prompt, an episode's earlier turns would otherwise
        be read from a stale cache)."""
        if "weights" in self.asleep:               # weights back on the GPU, KV cache not yet
            self.llm.wake_up(tags=["weights"])
            self.asleep.remove("weights")
        self.sender.send_weights()
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        try:
            if self.server:   # (an endpoint of VLLM_SERVER_DEV_MODE=1, as the weight sync's)
                self.http.post(f"{self.server.rstrip('/')}/reset_prefix_cache",
                               timeout=60).raise_for_status()
            else:
                self.llm.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001 - an engine that cannot: say so once, keep going
            if not getattr(self, "_warned_prefix", False):
                log.warning("vLLM prefix cache not reset after the weight sync (%s): requests that "
                            "share a prefix may read keys and values of older weights", e)
                self._warned_prefix = True

    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams,
                 generator: torch.Generator | None = None, seeds: Tensor | None = None) -> Rollout:
        if self.server:
            completions = self._generate_server(prompts, group_size, params, seeds)
        else:
            if self.asleep:       # (a partial wake keeps scheduling paused until all is back)
                self.llm.wake_up(tags=self.asleep)
                self.asleep = []
            completions = self._generate_colocated(prompts, group_size, params, seeds)
            if self.cfg.vllm_sleep:       # give the GPU back to the trainer for the update
                self.llm.sleep(level=1)
                self.asleep = ["weights", "kv_cache"]
        return to_rollout(prompts, group_size, completions, self.pad_id)

    def _sampling_kwargs(self, params: SamplingParams) -> dict:
        return dict(temperature=0.0 if params.greedy else params.temperature,
                    top_p=1.0 if params.greedy else params.top_p,
                    max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
                    logprobs=0, include_stop_str_in_output=True, skip_special_tokens=False)

    def _generate_colocated(self, prompts, G, params, seeds) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        kwargs = self._sampling_kwargs(params)
        requests_ = [{"prompt_token_ids": p} for p in prompts]
        sps = [VSamplingParams(n=G, seed=request_seed(seeds, i, G), **kwargs)
               for i in range(len(prompts))]
        outputs = self.llm.generate(requests_, sps, use_tqdm=False)
        return [completion_from_vllm(o) for out in outputs for o in out.outputs]

    def _generate_server(self, prompts, G, params, seeds) -> list[Completion]:
        from concurrent.futures import ThreadPoolExecutor
        kwargs = self._sampling_kwargs(params)
        url = f"{self.server.rstrip('/')}/v1/completions"

        def one(i: int) -> list[Completion]:
            body = dict(prompt=prompts[i], n=G, seed=request_seed(seeds, i, G),
                        return_token_ids=True, **kwargs)
            r = self.http.post(url, json=body, timeout=600)
            r.raise_for_status()
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            return [completion_from_openai(c) for c in choices]

        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:
            return [c for group in pool.map(one, range(len(prompts))) for c in group]
