"""The vLLM engines a `VLLMRolloutEngine` samples from, and how weights reach them.

- `LocalEngine`: a `vllm.LLM` started by this process (vLLM runs its engine core and worker in
  processes of their own; on a CPU they take the cores named in VLLM_CPU_OMP_THREADS_BIND while
  the trainer waits for them, and leave them while it updates), in a session of their own so
  that a signal to the trainer's process group leaves the engine to the trainer to close
  (rollout/vllm_process.py).
- `ServerEngine`: a `vllm serve` process, started by posttrain on loopback (`vllm_launch`, each
  with its share of the cores) or by you (`vllm_servers`); requests over its OpenAI-compatible
  HTTP API, weights and checks over its development routes.
- Pushes (rollout/vllm_push.py): which one `push_kind` picks, and `make_push`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from posttrain.util.errors import EngineError
from posttrain.rollout.vllm import (INSTALL_HINT, REQUIRE_SECRET, WORKER_EXTENSION, Completion,
                                    EngineGone, VLLMRolloutEngine, completion_from_openai,
                                    completion_from_vllm, free_port)
from posttrain.rollout.base import async_core_split
from posttrain.rollout.vllm_push import CudaIPCPush, NcclPush, SharedMemoryPush

log = logging.getLogger("posttrain")

MAX_REQUESTS = 16          # requests in flight to one server at a time
START_TIMEOUT_S = 900.0     # a server's start: imports, weights, warm-up, on a busy CPU


def cuda() -> bool:
    return torch.cuda.is_available()


def cpu_settings(kv_cache_gb: int, cores: str | None = None) -> dict[str, str]:
    """vLLM's CPU backend: its KV cache in GB (default: most of the memory), no core kept back
    (it keeps one by default, half of a 2-core machine), its threads on `cores` (default: all)."""
    if cuda():
        return {}
    n = os.cpu_count() or 1
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": cores or f"0-{n - 1}"}


def cpu_engine_args(max_model_len: int) -> dict:
    """vLLM's engine on a CPU: no compilation (a minute of start), and no chunked prefill. With
    chunked prefill, a seeded request whose prompt is cut between two engine steps stops the
    CPU worker (vLLM 0.32: 'CPU Generator does not use offset', seen on a server taking 16
    requests at once); whole prefills, up to `max_num_batched_tokens`, never cut one."""
    return {"enforce_eager": True, "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(8192, max_model_len)}


def split_cores(n_servers: int, n_cores: int | None = None, first: int = 0) -> list[str]:
    """Each server's cores, as VLLM_CPU_OMP_THREADS_BIND takes them ('0-1'): cores `first`..
    split evenly, or all of them for each when there are more servers than cores."""
    n_cores = (n_cores or os.cpu_count() or 1) - first
    if n_servers > n_cores:
        return [f"{first}-{first + n_cores - 1}"] * n_servers
    per = n_cores // n_servers
    return [f"{first + k * per}-{first + (k + 1) * per - 1}" for k in range(n_servers)]


def first_engine_core(cfg) -> int:
    """Where the engines' cores begin: 0, or the upper half under asynchronous training on a
    CPU (rollout.async_cpu_split; the trainer's threads take the lower half)."""
    split = async_core_split(cfg)
    return split[1] if split else 0


# -- engines --------------------------------------------------------------------------------------

class LocalEngine:
    """A `vllm.LLM` owned by this process."""

    name = "in-process"
    reported = None   # what the last weight push's load reported (VLLMRolloutEngine checks it)

    def __init__(self, model_path: str, dtype: str, seed: int, max_model_len: int, cfg,
                 **engine_args) -> None:
        cores = split_cores(1, first=first_engine_core(cfg))[0]
        for key, value in cpu_settings(cfg.vllm_cpu_kv_cache_gb, cores).items():
            os.environ.setdefault(key, value)   # (read by the engine's processes; yours win)
        from vllm import LLM
        from posttrain.rollout.vllm_process import TRAINER_PID, detached_executor
        # (the engine's processes in a session of their own: a Ctrl-C to the trainer's group
        # leaves them to finish the step; rollout/vllm_process.py)
        kwargs = dict(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                      max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                      worker_extension_cls=WORKER_EXTENSION,
                      distributed_executor_backend=detached_executor(cuda()))
        if cuda():
            kwargs.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                          enable_sleep_mode=cfg.vllm_sleep)
            if push_kind(cfg, local=True) == "ipc":
                kwargs["weight_transfer_config"] = {"backend": "ipc"}
        else:
            kwargs.update(cpu_engine_args(max_model_len))
        kwargs.update(engine_args)   # (e.g. a Tinker server's enable_lora, max_lora_rank)
        os.environ[TRAINER_PID] = str(os.getpid())   # (read by the engine core it starts)
        try:
            self.llm = LLM(**kwargs)
        finally:
            os.environ.pop(TRAINER_PID, None)
        self.sleep_between = cuda() and cfg.vllm_sleep
        self.asleep: list[str] = []

    def wake(self, tags: list[str] | None = None) -> None:
        tags = [t for t in (tags or self.asleep) if t in self.asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self.asleep = [t for t in self.asleep if t not in tags]

    def complete(self, prompts: list[list[int]], G: int, kwargs: dict,
                 seeds: list[int | None], lora=None) -> list[list[Completion]]:
        """G answers to each prompt (`lora`: a vLLM LoRARequest they are all sampled with)."""
        from vllm import SamplingParams as VSamplingParams
        self.wake()
        sps = [VSamplingParams(n=G, seed=s, **kwargs) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False,
                                 lora_request=lora)
        if self.sleep_between:   # give the GPU back to the trainer for the update
            self.llm.sleep(level=1)
            self.asleep = ["weights", "kv_cache"]
        return [[completion_from_vllm(o) for o in out.outputs] for out in outs]

    def rpc(self, method: str, kwargs: dict[str, str]) -> list:
        self.wake(["weights"])
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()


class ServerEngine:
    """A `vllm serve` process at `url` (launched by posttrain when `process` is given; then every
    request carries its secret, `api_key`)."""

    def __init__(self, url: str, timeout_s: float, process: subprocess.Popen | None = None,
                 log_path: Path | None = None, api_key: str | None = None) -> None:
        import requests
        self.name, self.url, self.timeout_s = url, url.rstrip("/"), timeout_s
        self.process, self.log_path = process, log_path
        self.http = requests.Session()
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"
        for scheme in ("http://", "https://"):   # a connection kept for each of the 16 requests
            self.http.mount(scheme, requests.adapters.HTTPAdapter(pool_maxsize=MAX_REQUESTS))
        self.reported = None
        self._finalizer = weakref.finalize(self, _stop_server, process) if process else None

    def _post(self, route: str, body: dict, timeout: float | None = None):
        import requests
        url, timeout = f"{self.url}{route}", timeout or self.timeout_s
        try:
            try:
                r = self.http.post(url, json=body, timeout=timeout)
            except requests.ConnectionError:
                # once more on a new connection: a kept-alive one the server closed as the
                # request went out ('Remote end closed connection without response', seen between
                # two steps of a run) is not a dead server; every request here may be repeated
                # (seeded sampling, a reload of the same folder, a state query)
                r = self.http.post(url, json=body, timeout=timeout)
        except requests.RequestException as e:   # refused, reset, timed out: the server is gone
            raise EngineGone(f"{type(e).__name__}: {str(e)[:200]}") from None
        if r.status_code >= 500:
            raise EngineGone(f"HTTP {r.status_code} on {route}: {r.text[:200]}")
        if r.status_code >= 400:   # a request posttrain got wrong: an error, not a dead server
            raise RuntimeError(f"vLLM server {self.name} refused {route} (HTTP {r.status_code}): "
                               f"{r.text[:500]}")
        return r.json() if r.content else None

    @property
    def model(self) -> str:
        """The name the server serves its model under (its first in /v1/models)."""
        if getattr(self, "_model", None) is None:
            self._model = self._get("/v1/models")["data"][0]["id"]
        return self._model

    def _get(self, route: str):
        import requests
        try:
            r = self.http.get(f"{self.url}{route}", timeout=self.timeout_s)
            r.raise_for_status()
        except requests.RequestException as e:
            raise EngineGone(f"{type(e).__name__}: {str(e)[:200]}") from None
        return r.json()

    def complete(self, prompts: list[list[int]], G: int, kwargs: dict,
                 seeds: list[int | None]) -> list[list[Completion]]:
        model = self.model

        def one(k: int) -> list[Completion]:
            body = dict(model=model, prompt=prompts[k], n=G, seed=seeds[k], return_token_ids=True,
                        **kwargs)
            choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return [completion_from_openai(c) for c in choices]
        pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_REQUESTS, len(prompts))))
        try:
            return list(pool.map(one, range(len(prompts))))
        finally:   # a failed request: the queued ones are not sent (a hung server costs one
            pool.shutdown(wait=True, cancel_futures=True)   # timeout, not one per 16 prompts)

    def rpc(self, method: str, kwargs: dict[str, str]) -> list:
        body = {"method": method, "kwargs": {k: str(v) for k, v in kwargs.items()}}
        return self._post("/collective_rpc", body)["results"]

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache", {})

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def _stop_server(process: subprocess.Popen) -> None:
    """Kill a launched server and its engine processes. They share its process group (it leads
    one), which outlives the server itself: a server that died leaves its engine core and worker
    running (vLLM does not stop them), and they are found by the group."""
    import signal
    from posttrain.sandbox.procs import kill_tree
    if process.poll() is None:
        kill_tree(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def launch_servers(n: int, model_path: str, dtype: str, seed: int, max_model_len: int,
                   cfg) -> list[ServerEngine]:
    """Start `n` `vllm serve` processes on loopback, each with its share of the cores and a
    secret of its own that every request must carry (any local process can reach a loopback
    port; the development routes load weights), and wait until each answers /health (a server
    that exits first is an error naming its log)."""
    import secrets
    logs = Path(tempfile.mkdtemp(prefix="posttrain-vllm-"))
    servers = []
    for k, cores in enumerate(split_cores(n, first=first_engine_core(cfg))):
        port, key = free_port(), secrets.token_urlsafe(32)
        # (the API server's module, not the `vllm serve` command: vllm-cpu 0.32's command line
        # looks up the package metadata of 'vllm' and stops, its package being 'vllm-cpu')
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--seed", str(seed),
                "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
                "--worker-extension-cls", WORKER_EXTENSION, "--middleware", REQUIRE_SECRET]
        if not cuda():
            args = cpu_engine_args(max_model_len)
            argv += ["--enforce-eager", "--no-enable-chunked-prefill",
                     "--max-num-batched-tokens", str(args["max_num_batched_tokens"])]
        # (connections kept alive across a step's update and push, not closed after vLLM's 5 s;
        # the secret in the environment, which other users cannot read, not on the command line)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "3600",
               "VLLM_API_KEY": key, **cpu_settings(cfg.vllm_cpu_kv_cache_gb, cores)}
        log_path = logs / f"server-{k}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        servers.append(ServerEngine(f"http://127.0.0.1:{port}", cfg.vllm_timeout_s, proc, log_path,
                                    api_key=key))
    log.info("vLLM: %d server(s) starting (logs in %s)", n, logs)
    try:
        for server in servers:
            wait_healthy(server)
    except BaseException:        # (one that does not start: the others stop too)
        for server in servers:
            server.close()
        raise
    return servers


def check_server(server: ServerEngine) -> None:
    """A server samples as the trainer needs: posttrain's worker extension answers, and each
    sampled token's log-prob is the one after temperature and top-p (`--logprobs-mode
    processed_logprobs`; vLLM's default is the raw distribution's, which would make every
    correction and DPPO weight wrong whenever temperature != 1 or top_p < 1)."""
    try:
        settings = server.rpc("posttrain_settings", {})
    except (EngineGone, RuntimeError) as e:
        why = (str(e).splitlines() or [""])[0][:200]
        raise EngineError(f"vLLM server {server.name} did not answer posttrain's worker extension "
                          f"({why}): start it with VLLM_SERVER_DEV_MODE=1 and "
                          f"--worker-extension-cls {WORKER_EXTENSION}") from None
    modes = sorted({str(s.get("logprobs_mode")) for s in settings})
    if modes != ["processed_logprobs"]:
        raise EngineError(f"vLLM server {server.name} returns log-probs as {', '.join(modes)}, "
                          f"before temperature and top-p: restart it with --logprobs-mode "
                          f"processed_logprobs")


def wait_healthy(server: ServerEngine, timeout_s: float = START_TIMEOUT_S) -> None:
    import requests
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if server.process is not None and server.process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-1500:] if server.log_path else ""
            raise EngineError(f"vLLM server {server.name} exited while starting (log "
                               f"{server.log_path}):\n{tail}")
        try:
            if server.http.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise EngineError(f"vLLM server {server.name} did not answer /health within {timeout_s:g} s "
                      f"(log {server.log_path})")


# -- weight pushes --------------------------------------------------------------------------------

def push_kind(cfg, local: bool) -> str:
    """How weights reach the engines: the configured way, or on 'auto' shm without CUDA, else
    IPC in process, NCCL to one server, shm to several (NCCL's broadcast reaches one)."""
    if cfg.vllm_weight_push != "auto":
        return cfg.vllm_weight_push
    if not cuda() or cfg.max_staleness:   # (asynchronous: versions the engine loads when it may)
        return "shm"
    return "ipc" if local else ("nccl" if len(cfg.vllm_servers) + cfg.vllm_launch == 1 else "shm")


# -- the factory ----------------------------------------------------------------------------------

def make_vllm_engine(model, tokenizer, model_path: str, rollout_cfg, dtype: str, *, seed: int = 0,
                     max_model_len: int = 4096, world=None) -> VLLMRolloutEngine:
    """The engines the config names (in process; launched servers; given servers), the push that
    reaches them, and the RolloutEngine over both. `seed`: the engines' sampling seed (a run's
    `seed`); `max_model_len`: the longest sequence they hold (rollout.engine_context)."""
    from posttrain.model.distributed import SINGLE
    world = world or SINGLE
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise EngineError(INSTALL_HINT) from e
    cfg = rollout_cfg
    if world.distributed and (cfg.vllm_launch or not cfg.vllm_servers):
        raise EngineError("rollout.backend='vllm' under torchrun takes servers you start: set "
                           "rollout.vllm_servers (one engine or launch per rank is not supported)")
    engines, push = [], None
    try:    # (whatever fails on the way, what was started stops)
        engines = [ServerEngine(url, cfg.vllm_timeout_s) for url in cfg.vllm_servers]
        if cfg.vllm_launch:
            engines += launch_servers(cfg.vllm_launch, model_path, dtype, seed, max_model_len, cfg)
        for engine in engines:
            check_server(engine)
        if not engines:
            engines = [LocalEngine(model_path, dtype, seed, max_model_len, cfg)]
        push = make_push(model, engines, cfg, world, getattr(torch, dtype))
        return VLLMRolloutEngine(model, tokenizer, engines, push, world)
    except BaseException:
        for engine in engines:
            engine.close()
        if push is not None:
            push.close()
        raise


def make_push(model, engines: list, cfg, world, dtype: torch.dtype):
    """How the trainer's weights reach `engines` (rollout.vllm_weight_push, push_kind)."""
    local = isinstance(engines[0], LocalEngine)
    kind = push_kind(cfg, local=local)
    if kind == "ipc" and local:
        return CudaIPCPush(model, engines[0], dtype)
    if kind == "nccl" and not local:
        return NcclPush(model, engines, world, dtype)
    return SharedMemoryPush(dtype, world, copies=3 if cfg.max_staleness else 2)
