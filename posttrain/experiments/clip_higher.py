"""Clip-Higher: a wider upper clip keeps the policy's entropy from collapsing.

The claim (lecture §7, docs/algorithms.md §7, DAPO): with a symmetric clip [1 - eps, 1 + eps] a
token the policy rarely writes (pi_old = 0.01) can rise only to 0.012 per batch when its
advantage is positive, while a likely token keeps rising: the rare tokens that explore are held
down and the entropy collapses. Raising the upper bound alone (eps_high 0.28, eps_low 0.2)
lets them rise further, which keeps entropy up with no loss of accuracy.

Method: training runs of the recipe from the same weights and seed, one per arm: two that differ
only in clip_high (0.2 against 0.28), and one for each of the field's newer objectives (GSPO,
CISPO, SAPO, GMPO: docs/algorithms.md §11) with its preset's objective, bounds and aggregation,
each of which bounds the update its own way (a sequence-level clip, a capped weight that keeps
every token's gradient, a soft gate, a clip on the token log-ratio). Each step's batch is used
for 4 successive minibatch updates (`--optim.minibatches 4`), so the ratio leaves 1 and the clip
acts (with one update per batch the ratio is exactly 1 and no clip ever binds); the learning rate
is constant. Every step's entropy and the share of tokens whose gradient each side of the clip
removed (both as the update measures them: on the groups whose rewards differ, over its 4
minibatches as the weights move), the reward, and held-out accuracy before and after are read
back from each run's metrics.jsonl (CISPO clips no gradient: its count is the tokens whose weight was capped). A seed
(`--seed S`) is one command; the record keeps each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from posttrain.experiments.common import Progress, mean_of, plot_per_step, train_arm
from posttrain.config.presets import PRESETS, AlgorithmConfig

CLAIM = ("a symmetric clip holds down rare tokens with positive advantage and the entropy "
         "collapses; raising only the upper bound (Clip-Higher, 0.2 -> 0.28) keeps entropy "
         "up without losing accuracy (§7)")
# 4 updates per batch (the ratio moves, the clip acts); a constant lr (a schedule would decay
# over this run's few steps); 100 held-out problems, before and after
OVERRIDES = ["--optim.minibatches", "4", "--optim.schedule", "constant", "--data.eval_size", "100"]
REPEATS = 20            # training steps per arm: about 4 minutes each
KEEP_FREED_MEMORY = True
MIN_REPEATS = 2
NEWER = ("gspo", "cispo", "sapo", "gmpo")   # the field's objectives, each as its preset ships it
ARMS = {"symmetric": {"clip_low": 0.2, "clip_high": 0.2},
        "clip_higher": {"clip_low": 0.2, "clip_high": 0.28},
        **{name: {field: getattr(PRESETS[name], field)
                  for field in ("policy_loss", "clip_low", "clip_high", "aggregation")}
           for name in NEWER}}
# what bounds each objective's update, in words (the figure's legend and the docs' table)
BOUNDS: dict[str, Callable[[AlgorithmConfig], str]] = {
    "clipped": lambda a: f"ratio in [{1 - a.clip_low:.2f}, {1 + a.clip_high:.2f}]",
    "gspo": lambda a: f"sequence ratio in [1 - {a.clip_low:g}, 1 + {a.clip_high:g}]",
    "cispo": lambda a: f"weight capped at {1 + a.clip_high:g}, no gradient clipped",
    "sapo": lambda a: "soft gate, no clip",
    "gmpo": lambda a: f"token log-ratio in [-{a.clip_low:g}, {a.clip_high:g}]"}


def bound(algo: AlgorithmConfig) -> str:
    """How the arm's objective bounds its update (another objective: its name and bounds)."""
    other = lambda a: f"{a.policy_loss}, clip_low {a.clip_low:g}, clip_high {a.clip_high:g}"  # noqa: E731
    return BOUNDS.get(algo.policy_loss, other)(algo)


def run(run, out, repeats: int, progress: Progress) -> dict:
    # each arm as it trains: the recipe's algorithm (and the user's overrides) with the arm's changes
    bounds = {arm: bound(replace(run.cfg, algorithm={**run.cfg.algorithm, **changes}).algo)
              for arm, changes in ARMS.items()}
    arms = {arm: train_arm(run, arm, algorithm, Path(out), repeats, progress)
            for arm, algorithm in ARMS.items()}
    for numbers in arms.values():   # the run's last steps: where a collapse shows
        tail = max(len(numbers["entropy"]) // 4, 1)
        numbers["entropy_last_quarter"] = mean_of(numbers["entropy"][-tail:])
        numbers["reward_last_quarter"] = mean_of(numbers["reward"][-tail:])
        numbers["clip_frac_high_mean"] = mean_of(numbers["clip_frac_high"])
        numbers["clip_frac_low_mean"] = mean_of(numbers["clip_frac_low"])
        numbers["weight_capped_mean"] = mean_of(numbers["weight_capped"])
    for arm, numbers in arms.items():
        numbers["bound"] = bounds[arm]
    return {"arms": arms, "steps": repeats, "minibatches": run.cfg.optim.minibatches,
            "lr": run.cfg.optim.lr, "answers_per_step": run.cfg.batch_size,
            "eval_size": run.cfg.data.eval_size}


def plot(numbers: dict, path):
    panels = [("entropy", "entropy (the update's groups with a signal)"),
              ("clip_frac_high", "share of tokens clipped high"), ("reward", "training reward")]
    return plot_per_step(numbers, panels, lambda arm, n: f"{arm}: {n['bound']}", path)
