"""What one vLLM weight push costs, part by part: the embedded SmolLM2 in an in-process engine
(the dtype the default recipe's `autocast: auto` picks on this machine), 21 pushes of changed
weights. The trainer's write (the shared-memory folder), the engine's in-place reload, its
repacking of kept weights and its check (full on pushes 0, 10 and 20: every packed kernel and
whole matrix; the rest: the weights' columns), medians of the full and the other pushes. Nothing
else should run meanwhile.

    .venv/bin/python benchmarks/vllm_push.py OUT [DTYPE]   # OUT/record-DTYPE.json

DTYPE (float32 or bfloat16) forces the engine's dtype.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from posttrain.run.provenance import provenance  # noqa: E402

PUSHES = 21


def main() -> None:
    from posttrain.config.rollout import RolloutConfig
    from posttrain.model.loading import EMBEDDED, load_policy, load_tokenizer, resolve_model_path
    from posttrain.rollout.vllm_push import SharedMemoryPush
    from posttrain.rollout.vllm_engines import make_vllm_engine
    from posttrain.util.perf import native_bf16
    out = Path(sys.argv[1])
    prov = provenance(" ".join(sys.argv))
    dtype = sys.argv[2] if len(sys.argv) > 2 else ("bfloat16" if native_bf16() else "float32")
    path = str(resolve_model_path(EMBEDDED))
    model = load_policy(path, "float32")
    engine = make_vllm_engine(model, load_tokenizer(path), path, RolloutConfig(backend="vllm"),
                              dtype, max_model_len=1024)
    rows = []
    try:
        for version in range(PUSHES):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            t0 = time.perf_counter()
            written = engine.publish()
            t1 = time.perf_counter()
            engine.load(written)
            t2 = time.perf_counter()
            worker = {f"{k}_s": v for k, v in engine.push.seconds.items()}
            rows.append({"version": version, "full": SharedMemoryPush.full(version),
                         "write_s": t1 - t0, "load_s": t2 - t1, **worker})
    finally:
        engine.close()
    summary = {}
    for kind, full in (("full", True), ("columns", False)):
        part = [r for r in rows[1:] if r["full"] == full] or [r for r in rows if r["full"] == full]
        summary[kind] = {k: statistics.median(r[k] for r in part) for k in part[0]
                         if k.endswith("_s")}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"record-{dtype}.json").write_text(json.dumps({"provenance": prov, "dtype": dtype,
                                                 "pushes": rows, "median": summary}, indent=1))
    print(json.dumps({"dtype": dtype, **summary}, indent=1))


if __name__ == "__main__":
    main()
