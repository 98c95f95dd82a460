"""What scoring costs the trainer per step, by where the scorers run: the default job's batch (64
answers of 2-digit addition, the math verifier, answers as the policy writes them) scored in the
trainer's process (reward.workers 0) and in the reward sandbox (`off`, `fallback`, `bwrap`); the
first batch (the sandbox and its workers start) and the median and p90 of the next 30. With
`--before DIR`, an older posttrain checkout's scorer is measured the same way in the same run.
Each configuration runs in its own process, one after another.

    .venv/bin/python benchmarks/reward_sandbox_cost.py [--before /tmp/posttrain-base]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MEASURE = r"""
import json, random, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from posttrain.data.tasks import Problem
from posttrain.config.sections import RewardConfig
from posttrain.rewards import Scorer
settings = json.loads(sys.argv[2])
rng = random.Random(0)
problems, answers = [], []
for i in range(64):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    c = a + b + rng.choice([0, 0, 0, 1, -10])
    problems.append(Problem(f"What is {a} + {b}?", str(a + b)))
    answers.append(rng.choice([f"{a} + {b} = {c}.", f"The answer is {c}.", f"\\boxed{{{c}}}", str(c)]))
scorer = Scorer(RewardConfig(**settings))
t0 = time.perf_counter()
first = scorer(problems, answers)
first_s = time.perf_counter() - t0
times = []
for _ in range(30):
    t0 = time.perf_counter()
    result = scorer(problems, answers)
    times.append(time.perf_counter() - t0)
scorer.close()
times.sort()
print(json.dumps({"first_batch_s": round(first_s, 3), "median_ms": round(statistics.median(times) * 1000, 1),
                  "p90_ms": round(times[int(0.9 * len(times)) - 1] * 1000, 1),
                  "accuracy": float(result.correct_B.float().mean()), "failures": dict(result.failures)}))
"""


def measure(checkout: Path, settings: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(checkout), json.dumps(settings)],
                         capture_output=True, text=True, timeout=600, cwd=checkout)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, help="an older posttrain checkout to measure beside this one")
    ap.add_argument("--out", type=Path, help="write the record here (JSON)")
    args = ap.parse_args()
    rows = {}
    if args.before:
        rows["before: worker pool in the trainer's machine (reward.workers 2)"] = measure(args.before, {"workers": 2})
        rows["before: in the trainer's process (reward.workers 0)"] = measure(args.before, {"workers": 0})
    rows["in the trainer's process (reward.workers 0)"] = measure(ROOT, {"workers": 0})
    for mode in ("off", "fallback", "bwrap"):
        rows[f"reward sandbox '{mode}' (reward.workers 2)"] = measure(ROOT, {"workers": 2, "sandbox": mode})
    print(f"{'64 answers, math verifier':66s} {'first batch':>12s} {'median':>9s} {'p90':>9s} {'accuracy':>9s}")
    for name, r in rows.items():
        print(f"{name:66s} {r['first_batch_s']:>10.2f} s {r['median_ms']:>6.1f} ms {r['p90_ms']:>6.1f} ms"
              f" {r['accuracy']:>9.3f}")
    if args.out:
        from posttrain.run.provenance import provenance
        record = {"rows": rows, "provenance": provenance("python benchmarks/reward_sandbox_cost.py "
                                                         + " ".join(sys.argv[1:]))}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"record: {args.out}")


if __name__ == "__main__":
    main()
