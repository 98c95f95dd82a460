#!/usr/bin/env bash
# The update beside an idle in-process vLLM engine on a CPU: the default job, seed 0, 12 steps,
# with `generate` in the trainer's process and with vLLM in process, back to back, twice, one run
# at a time (benchmarks/record.py). Each step's phases are in its metrics.jsonl (perf/generate_s,
# perf/update_s, perf/weight_push_s, perf/step_s); rendered by benchmarks/tables.py (table
# vllm-idle in docs/scaling.md). About 10 minutes.
#
#   bash benchmarks/vllm_idle.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/vllm-idle-$(date -u +%Y-%m-%d)}
for round in 1 2; do
  for backend in hf vllm; do
    .venv/bin/python benchmarks/record.py "$OUT/$backend-round$round" -- posttrain train \
        --steps 12 --eval_every 0 --data.eval_size 0 --seed 0 --rollout.backend "$backend"
  done
done
