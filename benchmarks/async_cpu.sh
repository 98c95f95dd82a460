#!/usr/bin/env bash
# Asynchronous training on this machine (rollout.max_staleness K, docs/scaling.md): the default
# job on vLLM in process with K = 0 (sample, then update), 1 and 2; K = 1 and 2 without the
# off-policy correction (rollout.tis_cap null); DPPO (dppo_tv) at K = 2; K = 1 and 2 with the
# engine and the trainer on separate cores (rollout.async_cpu_split). Seeds 0-2, 3 training
# minutes each, held-out (the run's own evaluator, 200 problems) every 10 steps; one run at a time
# (2 cores), seeds in the outer loop so that an interrupted sweep leaves every arm with as many
# seeds. About 110 minutes (ARMS_ORDER and SEEDS pick a part). Rendered by `benchmarks/tables.py` (table async-cpu in docs/scaling.md).
#
#   bash benchmarks/async_cpu.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/async-cpu-$(date -u +%Y-%m-%d)}
PY=.venv/bin/python
VLLM=(--rollout.backend vllm)
# (the first arms share every core between the engine and the trainer, as before
# rollout.async_cpu_split; the *-split arms give the engine core 1 and the trainer core 0)
SHARED="--rollout.async_cpu_split false"
declare -A ARMS=(
  [k0]=""
  [k1]="--rollout.max_staleness 1 $SHARED"
  [k2]="--rollout.max_staleness 2 $SHARED"
  [k1-nocorr]="--rollout.max_staleness 1 --rollout.tis_cap null $SHARED"
  [k2-nocorr]="--rollout.max_staleness 2 --rollout.tis_cap null $SHARED"
  [k2-dppo]="--rollout.max_staleness 2 --algorithm.policy_loss dppo_tv --algorithm.dppo_ratio_cap 2 $SHARED"
  [k1-split]="--rollout.max_staleness 1 --threads 1"
  [k2-split]="--rollout.max_staleness 2 --threads 1"
)
ORDER=(${ARMS_ORDER:-k0 k1 k2 k2-nocorr k2-dppo k1-nocorr k1-split k2-split})
for seed in ${SEEDS:-0 1 2}; do
  for arm in "${ORDER[@]}"; do
    # shellcheck disable=SC2086
    "$PY" benchmarks/learning.py --sides posttrain --seeds "$seed" --steps 60 --max_minutes 3 \
      --eval_every 10 --no-final --label "$arm" --out "$OUT/$arm" -- "${VLLM[@]}" ${ARMS[$arm]}
  done
done
