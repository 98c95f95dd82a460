#!/usr/bin/env bash
# Environments as their authors publish them, trained on the reference machine (2 CPU cores,
# SmolLM2-135M-Instruct, the default recipe), held-out before -> after over seeds, beside
# posttrain's own equivalent task where one exists. Run from a clean checkout:
#   bash benchmarks/artifacts.sh [OUT] [SEEDS]       (ARMS="chain-sum scratchpad" by default)
#   chain-sum: OpenEnv's reasoning_gym_env (tests/vendor/openenv, in process: the question comes
#              from its reset, its own score is the reward, solved at 1) vs posttrain's
#              reasoning_gym:chain_sum task (the same generator and scorer, native)
#   scratchpad: verifiers' scratchpad (tests/vendor/verifiers: a tool server the taskset shares,
#              one word a task to round-trip through it; its rubric the reward, solved at full
#              marks; held out: 8 of its 20 words); no native equivalent
#   kuhn-poker: verifiers' kuhn_poker (its Env referees two seats of self-play; held out: the
#              first seat wins); no native equivalent, about 3 minutes a step here
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/artifacts-$(date +%F)}
SEEDS=${2:-"0 1 2"}
MINUTES=${MINUTES:-2}
ARMS=${ARMS:-"chain-sum scratchpad"}
VF="$PWD/tests/vendor/verifiers"   # (absolute: verifiers starts tool servers in other folders)
R=(.venv/bin/python benchmarks/record.py)
OPTIONS='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
mkdir -p "$OUT"
# rows that are the environment's reset parameters: a seed each (held-out seeds apart)
.venv/bin/python - "$OUT" "$OPTIONS" <<'PY'
import json, sys
out, options = sys.argv[1], json.loads(sys.argv[2])
for name, seeds in (("train", range(0, 2000)), ("heldout", range(900000, 900050))):
    with open(f"{out}/chain_sum_{name}.jsonl", "w") as f:
        for s in seeds:
            f.write(json.dumps({"prompt": "Answer with a number.", "dataset_name": "chain_sum",
                                "dataset_config": options, "seed": s, "size": 1}) + "\n")
PY
TRAIN=(posttrain train --max_minutes "$MINUTES" --eval_every 0)
OPENENV=(--data.task file --data.train_path "$OUT/chain_sum_train.jsonl"
         --data.eval_path "$OUT/chain_sum_heldout.jsonl" --data.eval_size 50
         --reward.verifier none --env.name openenv --env.max_turns 1 --env.openenv_action answer
         --env.openenv tests.vendor.openenv.reasoning_gym_env.server.reasoning_gym_environment:ReasoningGymEnvironment)
NATIVE=(--data.task reasoning_gym:chain_sum --data.task_options "$OPTIONS" --data.eval_size 50)
for s in $SEEDS; do
  if [[ " $ARMS " == *" chain-sum "* ]]; then
    "${R[@]}" "$OUT/chain-sum-openenv-seed$s" -- "${TRAIN[@]}" --seed "$s" "${OPENENV[@]}"
    "${R[@]}" "$OUT/chain-sum-native-seed$s" -- "${TRAIN[@]}" --seed "$s" "${NATIVE[@]}"
  fi
  if [[ " $ARMS " == *" scratchpad "* ]]; then
    PYTHONPATH="$VF/scratchpad" "${R[@]}" "$OUT/scratchpad-verifiers-seed$s" -- \
        "${TRAIN[@]}" --seed "$s" --data.task verifiers:scratchpad --data.eval_size 8
  fi
  if [[ " $ARMS " == *" kuhn-poker "* ]]; then   # (the default recipe's 16 x 4 episodes, 2 seats)
    PYTHONPATH="$VF/kuhn_poker" "${R[@]}" "$OUT/kuhn-poker-verifiers-seed$s" -- \
        "${TRAIN[@]}" --seed "$s" --data.task verifiers:kuhn-poker --data.eval_size 8 --env.max_tokens 256
  fi
done
