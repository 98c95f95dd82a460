#!/usr/bin/env bash
# Ecosystem environments and an LLM judge on the reference machine (2 CPU cores,
# SmolLM2-135M-Instruct), each arm beside the native run it re-expresses, same seeds and the same
# training-time budget; docs/environments.md's tables are rendered from these records
# (benchmarks/tables.py). Run from a clean checkout:
#   bash benchmarks/ecosystem.sh [OUT] [SEEDS]
#   guess-number: native vs OpenEnv in process (examples/openenv_guess_number.py)
#   addition (the default job's task): native vs verifiers (examples/verifiers_addition.py)
#   addition rewarded by an LLM judge (SmolLM2 itself behind `posttrain serve`) instead of the verifier
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/ecosystem-$(date +%F)}
SEEDS=${2:-"0 1 2"}
MINUTES=${MINUTES:-4}
R=(.venv/bin/python benchmarks/record.py)
GUESS=(posttrain train --config posttrain/recipes/guess_number.yaml --max_minutes "$MINUTES" --eval_every 0)
ADD=(posttrain train --max_minutes "$MINUTES" --data.eval_size 100 --eval_every 0)
OPENENV=(--env.name openenv --env.openenv examples.openenv_guess_number:GuessNumberEnv)
for s in $SEEDS; do
  "${R[@]}" "$OUT/guess-native-seed$s" -- "${GUESS[@]}" --seed "$s"
  "${R[@]}" "$OUT/guess-openenv-seed$s" -- "${GUESS[@]}" --seed "$s" "${OPENENV[@]}"
  "${R[@]}" "$OUT/addition-native-seed$s" -- "${ADD[@]}" --seed "$s"
  "${R[@]}" "$OUT/addition-verifiers-seed$s" -- "${ADD[@]}" --seed "$s" --data.task verifiers:examples.verifiers_addition
done
# the judge: the policy's own base model, served on loopback (it shares the 2 cores with the
# trainer), asked Yes or No (a 135M model never writes the 'Score: N' line the other templates ask)
PORT=${PORT:-8123}
.venv/bin/python -m posttrain.cli serve --port "$PORT" --served-model-name judge \
    --rollout.max_new_tokens 48 --run_dir "$OUT/judge-server" > "$OUT/judge-server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until .venv/bin/python -c "import socket; socket.create_connection(('127.0.0.1', $PORT), 1)" 2>/dev/null; do sleep 1; done
for s in ${JUDGE_SEEDS:-$SEEDS}; do
  "${R[@]}" "$OUT/addition-judge-seed$s" -- "${ADD[@]}" --seed "$s" --reward.correct_reward 0 \
      --reward.judge "http://127.0.0.1:$PORT/v1" --reward.judge_model judge \
      --reward.judge_template yes_no --reward.max_failing_steps 0
done
