"""The rollout section of a config: how responses are sampled (group size, temperature, stop
strings, the token budget), by which engine (transformers in process, vLLM in process or as
servers, their weight push), how far ahead of the trainer (`max_staleness`) and with which
off-policy correction; `validate` checks its ranges with an error naming the field. The field
comments are `--help`'s descriptions (config/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.util.checks import check_choice, check_range
from posttrain.util.errors import ConfigError
from posttrain.losses.correction import OFF_POLICY_CORRECTIONS


@dataclass(frozen=True)
class RolloutConfig:
    # 'hf': in-process transformers sampling (exact pi_old, any device); 'vllm': vLLM engines, in
    # this process or `vllm serve` servers, on a CPU or a GPU (rollout/vllm.py), the trainer's
    # weights pushed to each after every update
    backend: Literal["hf", "vllm"] = "hf"
    prompts_per_step: int = 8           # P prompts per generated batch
    group_size: int = 4                 # G responses per prompt
    max_new_tokens: int = 24            # response length limit (a longer answer is truncated)
    temperature: float = 1.0            # sampling temperature; log-probs are taken at it too
    top_p: float = 1.0                  # nucleus sampling (1: the full distribution)
    # in-process sampling under bf16 autocast (body bf16, LM head float32): its log-probs are not
    # the trainer's, and are corrected like vLLM's (tis_cap below); `weights` below is faster
    autocast: Literal["none", "bfloat16"] = "none"
    # 'shared': in-process sampling from the very weights the trainer updates; 'bfloat16': from a
    # bf16 copy of the transformer body (the LM head stays the policy's own, in float32), synced
    # after every update: decoding about 1.7x faster on CPUs with AVX-512 bf16. Its log-probs
    # then differ slightly from the trainer's and are corrected like vLLM's (tis_cap below).
    weights: Literal["shared", "bfloat16"] = "shared"
    stop: tuple[str, ...] = ()          # stop strings, also used by evaluation (e.g. "\n\n")
    # Another engine's log-probs differ from the trainer's for the same weights: each token's
    # policy-gradient term is weighted by `correction` below, capped at tis_cap (None: no
    # correction of any kind; the mismatch is logged either way). Used when the sampler is not
    # the trainer's float32 policy (off_trainer: vLLM, weights/autocast bfloat16, top_p < 1).
    tis_cap: float | None = 2.0
    # how another engine's samples are corrected (docs §3,
    # losses.correction.OFF_POLICY_CORRECTIONS):
    # token_tis (min(rho_t, tis_cap)), seq_tis (min(prod_t rho_t, tis_cap) per response),
    # token_mis / seq_mis (rho where it lies in is_band, else 0), icepop (token_mis by its
    # paper's name: rho inside is_band, 0 outside; the paper's band is 0.5,5)
    correction: str = "token_tis"
    is_band: tuple[float, float] = (0.5, 2.0)   # token_mis, seq_mis, icepop: ratios kept
    # vLLM: in this process unless servers are named or launched; requests are shared out over
    # the servers, a server that fails is dropped (named) and its prompts go to the others
    # 'http://host:port' of `vllm serve` servers you started (with --logprobs-mode
    # processed_logprobs and posttrain's worker extension: checked at start, rollout/vllm.py)
    vllm_servers: tuple[str, ...] = ()
    vllm_launch: int = 0                # `vllm serve` servers started on loopback, each with a secret
    vllm_timeout_s: float = 300.0       # a server that does not answer a request within it is dropped
    # how weights reach the engines: 'shm' (a safetensors folder in shared memory, reloaded in
    # place: any device, this machine), 'ipc' / 'nccl' (CUDA, in process / one server); 'auto':
    # shm without CUDA, else ipc in process, nccl for one server, shm for several
    vllm_weight_push: Literal["auto", "shm", "ipc", "nccl"] = "auto"
    vllm_cpu_kv_cache_gb: int = 1       # CPU: GB of memory for the KV cache of each engine
    vllm_gpu_memory_utilization: float = 0.3   # share of the GPU vLLM may take (in process)
    vllm_sleep: bool = True             # GPU: free vLLM's weights and KV cache while the trainer updates
    # Asynchronous training (docs/scaling.md): the engine samples the next steps' batches while
    # the trainer updates, from weights at most `max_staleness` updates older than those it
    # trains (0: sample, then update, in turn). Each batch carries the weight version that
    # sampled it; one older than max_staleness is dropped (counted) and its prompts drawn again.
    max_staleness: int = 0
    # batches the engine may hold ready or in flight ahead of the trainer (null: max_staleness);
    # more than max_staleness keeps the engine busier and drops what grows too old
    async_ahead: int | None = None
    # asynchronous training on a CPU: the engine's threads on the upper half of the cores, the
    # trainer's on the lower (unless `threads` says otherwise); false: both on every core
    async_cpu_split: bool = True

    def validate(self) -> None:
        r = self
        for name in ("prompts_per_step", "group_size", "max_new_tokens"):
            check_range(f"rollout.{name}", getattr(r, name), 1)
        check_range("rollout.temperature", r.temperature, 0.0, lo_open=True)
        check_range("rollout.top_p", r.top_p, 0.0, 1.0, lo_open=True)
        check_range("rollout.vllm_gpu_memory_utilization", r.vllm_gpu_memory_utilization, 0.0,
                     1.0, lo_open=True)
        if r.tis_cap is not None:
            check_range("rollout.tis_cap", r.tis_cap, 1.0)
        check_choice("rollout.correction", r.correction, OFF_POLICY_CORRECTIONS.names())
        if not 0.0 <= r.is_band[0] <= 1.0 <= r.is_band[1]:
            raise ConfigError(f"rollout.is_band={list(r.is_band)} must be [lo, hi] with "
                              "0 <= lo <= 1 <= hi (ratios inside are kept)")
        for url in r.vllm_servers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.vllm_servers has {url!r}: each must be a URL such as "
                                  "http://host:8000")
        check_range("rollout.vllm_launch", r.vllm_launch, 0)
        check_range("rollout.vllm_timeout_s", r.vllm_timeout_s, 0.0, lo_open=True)
        check_range("rollout.vllm_cpu_kv_cache_gb", r.vllm_cpu_kv_cache_gb, 1)
        self._check_async()
        servers = len(r.vllm_servers) + r.vllm_launch
        if r.vllm_weight_push == "ipc" and servers:
            raise ConfigError("rollout.vllm_weight_push='ipc' reaches an engine in this process "
                              "only: with rollout.vllm_servers or vllm_launch use 'shm' (servers "
                              "on this machine) or 'nccl' (one server)")
        if r.vllm_weight_push == "nccl" and servers != 1:
            raise ConfigError(f"rollout.vllm_weight_push='nccl' broadcasts to exactly one server "
                              f"(vllm_servers and vllm_launch name {servers}): use 'shm' for "
                              "engines on this machine")

    def _check_async(self) -> None:
        r = self
        check_range("rollout.max_staleness", r.max_staleness, 0)
        if r.async_ahead is not None:
            check_range("rollout.async_ahead", r.async_ahead, 1)
            if r.max_staleness == 0:
                raise ConfigError(f"rollout.async_ahead={r.async_ahead} needs rollout.max_staleness "
                                  ">= 1 (with 0 the engine never samples ahead)")
        if r.max_staleness and r.backend != "vllm":
            raise ConfigError(f"rollout.max_staleness={r.max_staleness} samples while the trainer "
                              f"updates, which needs an engine outside the trainer's process: set "
                              f"rollout.backend=vllm (backend={r.backend!r} samples from the very "
                              "weights being updated)")
        if r.max_staleness and r.vllm_weight_push not in ("auto", "shm"):
            raise ConfigError(f"rollout.max_staleness={r.max_staleness} with rollout.vllm_weight_push="
                              f"{r.vllm_weight_push!r}: asynchronous training publishes each version "
                              "as a folder the engine loads between batches; use 'shm' (or 'auto')")

    @property
    def ahead(self) -> int:
        """Batches the engine may sample ahead of the trainer (0: synchronous)."""
        return self.async_ahead or self.max_staleness

    @property
    def off_trainer(self) -> bool:
        """The sampler is not the trained weights in float32 themselves (another engine, a bf16
        copy, bf16 autocast while sampling, or a nucleus cut by top_p): its log-probs are not
        pi_old."""
        return (self.backend != "hf" or self.weights != "shared" or self.autocast != "none"
                or self.top_p < 1.0)
