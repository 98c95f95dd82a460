"""What posttrain runs inside vLLM's processes. In each worker (`worker_extension_cls`): loading
the trainer's newest weights from a safetensors folder, saying which weights it holds and how it
samples. In the in-process engine's core: a session of its own, and shutting down with the
trainer (rollout/vllm_process.py). In the servers posttrain launches: the middleware that makes
every request carry the server's secret.

vLLM mixes this class into its worker, in the worker's own process (in-process engines and
`vllm serve` alike), and its methods are called by name through `collective_rpc` (the server's
`POST /collective_rpc`, under VLLM_SERVER_DEV_MODE=1). `reload_weights` is vLLM's in-place reload:
it runs every layer's post-load processing again, which on CPU repacks the linear layers into
oneDNN's layout (a plain `load_weights` would leave the repacked copies stale). Kept free of
posttrain's other modules: it is imported inside vLLM's processes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


COLUMNS = 8       # columns of every matrix whose entries (all rows) the fingerprint sums
REL_TOL = 1e-10   # float64 sums of the same values in another order agree far closer
FULL_CHECK_EVERY = 10   # pushes between full checks (packed kernels, whole matrices: 0.6 s here)


def columns(k: int, m: int = COLUMNS) -> list[int]:
    """The columns of a matrix with `k` columns that the fingerprint reads: `m` spread evenly, a
    function of `k` alone (the trainer's tensor and the engine's fused one have the same)."""
    m = min(m, k)
    return [((2 * c + 1) * k) // (2 * m) for c in range(m)]


def sum_and_l1(t) -> tuple[float, float]:
    """sum(t) and sum(|t|) in float64, a few million entries at a time (no float64 copy of a
    whole embedding)."""
    s = a = 0.0
    for chunk in t.detach().reshape(-1).split(1 << 22):
        c = chunk.double()
        s += float(c.sum())
        a += float(c.abs().sum())
    return s, a


def matrix_sum_and_l1(t) -> tuple[float, float]:
    """`sum_and_l1` of a whole matrix: each row summed in float32, the row sums in float64. A
    row is summed the same way wherever it lies (vLLM's fused tensors stack the trainer's rows),
    so both sides get the same row sums, in half the time of float64 throughout."""
    import torch
    rows = t.detach().reshape(-1, t.shape[-1])
    return (float(rows.sum(-1, dtype=torch.float32).sum(dtype=torch.float64)),
            float(rows.abs().sum(-1, dtype=torch.float32).sum(dtype=torch.float64)))


def add(acc: list, k: int, sums: tuple[float, float]) -> None:
    acc[k] += sums[0]
    acc[k + 1] += sums[1]


def fingerprint(named_tensors, whole: bool = True) -> list[float | None]:
    """Three (sum, sum of |x|) pairs in float64 over every tensor: every entry of each vector
    (norms, biases); `columns` of each matrix, all rows; every entry of each matrix (None, None
    with `whole` False: an engine that cannot give them, which saves summing every weight). Sums
    do not change when vLLM fuses tensors (q, k, v into one; gate and up) or pads the vocabulary
    with zero rows, so the engine's fused tensors give the trainer's numbers, and one matrix
    that kept its old values (a layer the load missed, a stale packed copy) changes them."""
    acc = [0.0] * 6
    for _, t in named_tensors:
        if t.ndim <= 1:
            add(acc, 0, sum_and_l1(t))
            continue
        rows = t.detach().reshape(-1, t.shape[-1])
        add(acc, 2, sum_and_l1(rows[:, columns(rows.shape[1])]))
        if whole:
            add(acc, 4, matrix_sum_and_l1(t))
    return acc if whole else acc[:4] + [None, None]


def engine_fingerprint(model, full: bool = True) -> list[float | None]:
    """`fingerprint` of the weights a vLLM model computes with. On a CPU, vLLM multiplies with a
    packed copy of each linear layer's weight (and of the embedding, for a tied head), and may
    drop the weight: the columns are then read through each packed kernel (one-hot inputs:
    exact), a copy that disagrees with its weight counting instead of it, and the sums over
    whole matrices, which only the weights give, are None (left out of the comparison). Not
    `full`: the weights' own columns where they are kept, no kernel read and no whole sums (the
    check between full ones: a push that missed a matrix still shows)."""
    acc: list = [0.0] * 6
    weights: dict[int, object] = {}
    kernels: dict[int, list] = {}          # a weight -> the modules multiplying with a copy of it
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            weights.setdefault(id(p), p.data)   # (a tied weight: counted once, as the trainer
            if name == "weight" and hasattr(module, "cpu_linear"):   # writes it; `.data`: no
                kernels.setdefault(id(p), []).append(module)       # vLLM torch_function per op)
    whole = full and all(weights[key].numel() for key in kernels)
    for key, p in weights.items():
        if key not in kernels:
            fingerprint_into(acc, p, whole)
            continue
        seen = [probe(module, p) for module in kernels[key]] if full or not p.numel() else []
        if p.numel():
            if whole:
                add(acc, 4, matrix_sum_and_l1(p))
            seen.insert(0, sum_and_l1(p[:, columns(p.shape[1])]))
        odd = [c for c in seen if not same_fingerprint(list(c), list(seen[0]))]
        add(acc, 2, (odd or seen)[0])
    return acc if whole else acc[:4] + [None, None]


def probe(module, weight) -> tuple[float, float]:
    """sum and sum of |x| of `columns` of the matrix `module`'s packed kernel multiplies with:
    the kernel applied to one-hot rows (each output entry one weight, exactly)."""
    import torch
    k = weight.shape[-1] if weight.numel() else module.input_size_per_partition
    cols = columns(k)
    x = torch.zeros(len(cols), k, dtype=weight.dtype, device=weight.device)
    x[torch.arange(len(cols)), cols] = 1
    return sum_and_l1(module.cpu_linear(x, weight, None))


def fingerprint_into(acc: list, t, whole: bool = True) -> None:
    new = fingerprint([("", t)], whole)
    for k in range(6 if whole else 4):
        acc[k] += new[k]


def same_fingerprint(a: list, b: list, rel: float = REL_TOL) -> bool:
    """Each (sum, sum of |x|) pair agrees within `rel` of the sum of |x| (a pair that one side
    could not compute, None, is left out)."""
    if len(a) != len(b) or len(a) % 2:
        return False
    for k in range(0, len(a), 2):
        if None in (a[k], b[k], a[k + 1], b[k + 1]):
            continue
        tol = rel * max(abs(a[k + 1]), abs(b[k + 1])) + 1e-30
        if abs(a[k] - b[k]) > tol or abs(a[k + 1] - b[k + 1]) > tol:
            return False
    return True


def repack_kept_cpu_weights(model) -> int:
    """vLLM's CPU backend multiplies with a packed copy of each layer's weight. Linear layers
    drop their weight after packing and reload_weights packs them again; a layer that keeps its
    weight (the embedding, which a tied LM head multiplies with) is not packed again in vLLM
    0.32, so its logits stay the old weights' (measured: log-probs off by several nats after an
    update of the embedding). Pack those again here; how many there were."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and getattr(weight, "ndim", 0) == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


class WeightSync:
    """Mixed into vLLM's worker class."""

    def posttrain_load(self, path: str, version: str, full: str = "1") -> dict:
        """Reload every weight from the safetensors folder `path`; remember `version`; the
        state, fully checked or not (`full`: "1" or "0", strings: the server route's), with the
        seconds each part took (`seconds`: reload, repack, check)."""
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_path=str(path))
        t1 = time.perf_counter()
        repack_kept_cpu_weights(self.model_runner.get_model())
        t2 = time.perf_counter()
        self.posttrain_weights_version = int(version)
        state = self.posttrain_state(full)
        state["seconds"] = {"reload": t1 - t0, "repack": t2 - t1, "check": time.perf_counter() - t2}
        return state

    def posttrain_state(self, full: str = "1") -> dict:
        """The weight version this worker holds (-1: the folder it started from) and the
        fingerprint of the weights it computes with (engine_fingerprint)."""
        model = self.model_runner.get_model()
        return {"version": getattr(self, "posttrain_weights_version", -1),
                "fingerprint": engine_fingerprint(model, full == "1")}

    def posttrain_settings(self) -> dict:
        """How this worker samples, as the trainer needs it: which log-probs it returns."""
        return {"logprobs_mode": str(self.vllm_config.model_config.logprobs_mode)}


# -- the in-process engine's core (rollout/vllm_process.py) ------------------------------------

TRAINER_PID = "POSTTRAIN_VLLM_TRAINER_PID"   # (set while the trainer starts its engine)
POLL_S = 0.5       # how often the engine core looks for its trainer
GRACE_S = 15.0     # after the trainer is gone: vLLM's shutdown, then SIGKILL


def detach_from_trainer() -> bool:
    """In an engine core started by the trainer named in TRAINER_PID: a session of its own, and a
    thread that shuts the core down when the trainer is gone. Whether it detached (not in the
    trainer itself: an engine core run in process, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    raw = os.environ.get(TRAINER_PID)
    if not raw or int(raw) == os.getpid():
        return False
    try:
        os.setsid()
    except OSError:       # (already leads a process group: its own already)
        pass
    threading.Thread(target=watch_trainer, args=(int(raw),), daemon=True,
                     name="posttrain-trainer-watch").start()
    return True


def quiet_shared_memory_readers(busy_loop_s: float = 0.05) -> None:
    """On a CPU, vLLM's shared-memory message readers (the engine core waiting on its worker
    process, the worker on the core) spin on sched_yield for 1 s after every message before they
    sleep on a socket, and the trainer updates on the same cores the moment sampling ends: the
    update ran 2x slower beside the engine (3.07 against 1.57 s a step). With `busy_loop_s` 0.05
    a reader spins 50 ms after a message and then sleeps until its socket wakes it: a burst of
    messages (a decoding run, the engine's start) keeps its speed, and an idle engine takes
    almost no CPU (at 0 the tiny test engine took 56 s to start here, against 41 s). Runs in
    the engine core before it starts its worker (vllm_process.py) and in each worker when vLLM
    imports this module for `WeightSync`, before the worker builds its queues; nothing where
    vLLM's queues are not loaded, or on a GPU."""
    shm_broadcast = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    if shm_broadcast is None:
        return
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        # (private: SpinCondition's keyword default is vLLM's only handle on the spin, no option
        # or environment variable; MessageQueue builds its readers' conditions with the default)
        shm_broadcast.SpinCondition.__init__.__defaults__ = (busy_loop_s,)


quiet_shared_memory_readers()   # (in a worker: vLLM imports this module before its queues exist)


def watch_trainer(trainer: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> None:
    """Wait until this process's parent is no longer `trainer` (it died; the process was
    re-parented), then stop as a close stops it, and for good after `grace_s`."""
    while os.getppid() == trainer:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


# -- the servers posttrain launches ----------------------------------------------------------------

async def require_secret(request, call_next):
    """The API server middleware (`--middleware`) of every server posttrain launches: a request
    on any route, /health and the development routes included, must carry the server's secret
    (VLLM_API_KEY in its environment) as a bearer token. vLLM's own --api-key guards /v1 only,
    which leaves /collective_rpc (load any weights into the sampler) open to every local
    process."""
    import hmac
    from starlette.responses import JSONResponse
    key = os.environ.get("VLLM_API_KEY", "")
    given = request.headers.get("authorization", "")
    if not key or not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return await call_next(request)
