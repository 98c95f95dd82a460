"""What posttrain adds to each vLLM worker (`worker_extension_cls`): loading the trainer's newest
weights from a safetensors folder and saying which weights it holds.

vLLM mixes this class into its worker, in the worker's own process (in-process engines and
`vllm serve` alike), and its methods are called by name through `collective_rpc` (the server's
`POST /collective_rpc`, under VLLM_SERVER_DEV_MODE=1). `reload_weights` is vLLM's in-place reload:
it runs every layer's post-load processing again, which on CPU repacks the linear layers into
oneDNN's layout (a plain `load_weights` would leave the repacked copies stale). Kept free of
posttrain's other modules: it is imported inside vLLM's processes.
"""

from __future__ import annotations

import math


def fingerprint(named_parameters) -> list[float]:
    """Two sums that change with every update, in float64: every norm weight's, and every 997th
    entry of the embedding (all of it would cost 0.1 s a push). Norms and the embedding are
    loaded as written (no kernel repacking), so the trainer computes the same numbers from the
    tensors it wrote."""
    embed, norms = 0.0, 0.0
    for name, p in named_parameters:
        if name.endswith("embed_tokens.weight"):
            embed += float(p.detach().reshape(-1)[::997].double().sum())
        elif name.endswith("norm.weight"):
            norms += float(p.detach().double().sum())
    return [embed, norms]


def same_fingerprint(a: list[float], b: list[float], rel: float = 1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-6) for x, y in zip(a, b))


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

    def posttrain_load(self, path: str, version: str) -> dict:
        """Reload every weight from the safetensors folder `path`; remember `version`."""
        self.model_runner.reload_weights(weights_path=str(path))
        repack_kept_cpu_weights(self.model_runner.get_model())
        self.posttrain_weights_version = int(version)
        return self.posttrain_state()

    def posttrain_state(self) -> dict:
        """The weight version this worker holds (-1: the folder it started from) and its
        fingerprint."""
        model = self.model_runner.get_model()
        return {"version": getattr(self, "posttrain_weights_version", -1),
                "fingerprint": fingerprint(model.named_parameters())}
