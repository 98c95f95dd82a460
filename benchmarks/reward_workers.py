"""Scoring time of a reward function that sleeps 0.2 s, with 0 (in the trainer's process), 1, 2 and
4 worker processes: 16 responses, median of 3 calls after a warm-up one.

    .venv/bin/python benchmarks/reward_workers.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from posttrain.config.sections import RewardConfig
    from posttrain.data.tasks import Problem
    from posttrain.rewards import Scorer
    problems, texts = [Problem("What is 40 + 2?", "42")] * 16, ["42"] * 16
    for workers in (0, 1, 2, 4):
        scorer = Scorer(RewardConfig(verifier="none", workers=workers,
                                     functions=("tests.toy_rewards:sleeps_02",)))
        scorer(problems[:2], texts[:2])   # warm: workers started, function imported
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            scorer(problems, texts)
            times.append(time.perf_counter() - t0)
        scorer.close()
        print(f"reward.workers {workers}: {statistics.median(times):.2f} s for 16 calls of 0.2 s")


if __name__ == "__main__":
    main()
