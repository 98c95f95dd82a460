#!/usr/bin/env bash
# The default job with each sampler on this machine, one run at a time (2 cores: never two heavy
# jobs at once): `generate` in the trainer's process, vLLM in process, vLLM as a server posttrain
# starts; 3 seeds each, 10 training minutes, held-out every 30 steps (benchmarks/learning.py); then
# the trainer-vs-engine log-prob mismatch with the engine and trainer in float32 and in bf16
# (benchmarks/record.py, 8 steps each). About 2 hours. Rendered by `benchmarks/tables.py`
# (table vllm-cpu in docs/scaling.md).
#
#   bash benchmarks/vllm_cpu.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/vllm-cpu-$(date -u +%Y-%m-%d)}
PY=.venv/bin/python
LEARN=(benchmarks/learning.py --sides posttrain --seeds 0 1 2 --steps 90 --max_minutes 10 --eval_every 30)
"$PY" "${LEARN[@]}" --label generate --out "$OUT/generate"
"$PY" "${LEARN[@]}" --label vllm --out "$OUT/vllm" -- --rollout.backend vllm
"$PY" "${LEARN[@]}" --label vllm-server --out "$OUT/vllm-server" -- --rollout.backend vllm --rollout.vllm_launch 1
SHORT=(--steps 8 --data.eval_size 20 --eval_every 0)
"$PY" benchmarks/record.py "$OUT/mismatch-bf16" -- posttrain train --rollout.backend vllm "${SHORT[@]}"
"$PY" benchmarks/record.py "$OUT/mismatch-fp32" -- posttrain train --rollout.backend vllm --model.autocast none "${SHORT[@]}"
