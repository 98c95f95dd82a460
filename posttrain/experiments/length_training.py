"""Length bias over training: the lengths of wrong and correct answers under each aggregation.

The claim (lecture §7, docs/algorithms.md §7): GRPO's per-answer mean 1/|o_i| sum_t pushes each
token of a long wrong answer down less than a token of a short one, so over training wrong answers
drift longer; token-mean (DAPO) and Dr. GRPO's constant L_max weigh every token the same and do
not. `length-bias` measures the per-token weights exactly and the direction of one small step;
this experiment trains.

Method: training runs from the same weights and seed, one per aggregation, in length-bias's
setting (1-digit addition, up to 64 new tokens, no stop string: wrong answers ramble on and can
grow; 8 prompts x 4 answers a step): GRPO as it ships (std-normalised group advantage, 1/|o_i| per answer), the same with the
token mean, and Dr. GRPO (no std, the constant L_max). The learning rate is constant and the KL
off (the recipe's beta 0), so the arms differ in the aggregation (and Dr. GRPO's advantage scale)
alone. Every step's mean length of the wrong and of the correct answers sampled, their
accuracy, and held-out accuracy before and after are read back from each run's metrics.jsonl.
A seed (`--seed S`) is one command; the record keeps each step.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.experiments.common import Progress, mean_of, plot_per_step, train_arm
from posttrain.config.presets import PRESETS

CLAIM = ("under GRPO's 1/|o| aggregation wrong answers grow longer over training; token-mean and "
         "Dr. GRPO's constant normaliser do not make them grow (§7)")
# length-bias's setting (answers that vary in length, wrong ones in every group) at 8 prompts x 4
# answers a step (64 answers of up to 64 tokens take ~33 s a step here; 32 take half), a
# constant lr and 20 held-out problems before and after (1-digit addition has only 100 problems)
OVERRIDES = ["--data.difficulty", "1", "--rollout.max_new_tokens", "64", "--rollout.stop", "",
             "--rollout.prompts_per_step", "8", "--optim.schedule", "constant",
             "--data.eval_size", "20"]
REPEATS = 20            # training steps per arm: about 6 minutes each
KEEP_FREED_MEMORY = False   # answer lengths vary from batch to batch
MIN_REPEATS = 2
FIELDS = ("advantage", "scale_by_std", "aggregation", "policy_loss", "clip_low", "clip_high")
# arm -> (preset, changes): the fields that decide how a token is weighed, from the registries
ARM_PRESETS = {"grpo": ("grpo", {}), "grpo_token_mean": ("grpo", {"aggregation": "token_mean"}),
               "dr_grpo": ("dr_grpo", {})}
ARMS = {arm: {**{f: getattr(PRESETS[preset], f) for f in FIELDS}, **changes}
        for arm, (preset, changes) in ARM_PRESETS.items()}


def quarters(values: list[float | None]) -> tuple[float | None, float | None]:
    """The mean of the first and of the last quarter of the steps (the steps that have a value)."""
    tail = max(len(values) // 4, 1)
    return mean_of(values[:tail]), mean_of(values[-tail:])


def run(run, out, repeats: int, progress: Progress) -> dict:
    arms = {arm: train_arm(run, arm, algorithm, Path(out), repeats, progress)
            for arm, algorithm in ARMS.items()}
    for n in arms.values():
        for key in ("length_wrong", "length_correct", "accuracy"):
            n[f"{key}_first_quarter"], n[f"{key}_last_quarter"] = quarters(n[key])
    return {"arms": arms, "steps": repeats, "answers_per_step": run.cfg.batch_size,
            "max_new_tokens": run.cfg.rollout.max_new_tokens, "lr": run.cfg.optim.lr,
            "eval_size": run.cfg.data.eval_size}


def plot(numbers: dict, path):
    panels = [("length_wrong", "mean length of the wrong answers (tokens)"),
              ("length_correct", "mean length of the correct answers (tokens)"),
              ("accuracy", "accuracy of the answers sampled")]
    return plot_per_step(numbers, panels, lambda arm, n: f"{arm}: {n['algorithm']['aggregation']}",
                         path)
