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
    """A few sums that change with every update: the embedding's and every norm weight's, in
    float64. Norms and the embedding are loaded as written (no kernel repacking), so the trainer
    computes the same numbers from the tensors it wrote."""
    embed, norms = 0.0, 0.0
    for name, p in named_parameters:
        if name.endswith("embed_tokens.weight"):
            embed += float(p.detach().double().sum())
        elif name.endswith("norm.weight"):
            norms += float(p.detach().double().sum())
    return [embed, norms]


def same_fingerprint(a: list[float], b: list[float], rel: float = 1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-6) for x, y in zip(a, b))


class WeightSync:
    """Mixed into vLLM's worker class."""

    def posttrain_load(self, path: str, version: str) -> dict:
        """Reload every weight from the safetensors folder `path`; remember `version`."""
        self.model_runner.reload_weights(weights_path=str(path))
        self.posttrain_weights_version = int(version)
        return self.posttrain_state()

    def posttrain_state(self) -> dict:
        """The weight version this worker holds (-1: the folder it started from) and its
        fingerprint."""
        model = self.model_runner.get_model()
        return {"version": getattr(self, "posttrain_weights_version", -1),
                "fingerprint": fingerprint(model.named_parameters())}
