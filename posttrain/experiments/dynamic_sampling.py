"""Dynamic sampling: refill the batch with groups that carry a signal; what it costs and buys.

The claim (lecture §7, docs/algorithms.md §7, DAPO): a group whose answers all earn the same
reward (all right or all wrong) has advantage 0 under a group baseline and teaches nothing; as
accuracy rises (or while it is near 0) many groups are such, and the step's effective batch
shrinks. Dynamic sampling draws more prompts until the batch is full of groups whose rewards
differ: every step then learns from a full batch, at the price of the extra generation.

Method: two training runs of the default recipe from the same weights and seed, without and with
`dynamic_sampling` (at most 4 refill rounds a step), the learning rate constant. Every step's
share of all-equal groups among the first round's, the answers generated, the seconds taken and
the reward of the first round's answers (the policy's success rate as sampled, comparable
between the arms) are read back from each run's metrics.jsonl, with held-out accuracy before and
after. A seed (`--seed S`) is one command; the record keeps each step.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.experiments.common import Progress, mean_of, plot_per_step, train_arm

CLAIM = ("groups whose answers all earn the same reward teach nothing; dynamic sampling refills "
         "the batch with groups that carry a signal, which costs generation and buys learning "
         "per step (§7)")
OVERRIDES = ["--optim.schedule", "constant", "--data.eval_size", "100"]
REPEATS = 20            # training steps per arm
KEEP_FREED_MEMORY = False   # refills make batches of varying size
MIN_REPEATS = 2
ARMS = {"off": {"dynamic_sampling": False}, "on": {"dynamic_sampling": True}}


def run(run, out, repeats: int, progress: Progress) -> dict:
    arms = {arm: train_arm(run, arm, algorithm, Path(out), repeats, progress)
            for arm, algorithm in ARMS.items()}
    for n in arms.values():
        tail = max(len(n["step"]) // 4, 1)
        n.update(equal_groups_mean=mean_of(n["equal_groups"]),
                 generated_per_step=mean_of(n["generated"]),
                 step_s_mean=mean_of(n["step_s"]),
                 generated_reward_last_quarter=mean_of(n["generated_reward"][-tail:]))
    return {"arms": arms, "steps": repeats, "answers_per_step": run.cfg.batch_size,
            "max_refill_rounds": run.cfg.algo.max_refill_rounds, "lr": run.cfg.optim.lr,
            "eval_size": run.cfg.data.eval_size}


def plot(numbers: dict, path):
    panels = [("equal_groups", "share of all-equal groups (first round)"),
              ("generated", "answers generated"), ("generated_reward", "reward of the answers sampled")]
    return plot_per_step(numbers, panels, lambda arm, n: f"dynamic sampling {arm}", path)
