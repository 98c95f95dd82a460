"""On-policy distillation against RL: how many steps each needs to reach the same accuracy.

The claim (lecture §8, docs/algorithms.md §8, Thinking Machines' "On-Policy Distillation"): RL
learns from one number per answer (the reward), while on-policy distillation learns from the
teacher's judgement of every token the student wrote; the student therefore reaches the
teacher's level in far fewer steps than RL needs to get there.

Method: one command, two arms from the same starting weights and seed. The RL arm is the default
GRPO job (16 x 4 answers a step, lr 2e-5 cosine) run for REPEATS steps (30: about a third of the
default job), evaluated every 2 steps; its final model is then the teacher of the
distillation arm, which is the OPD recipe (posttrain/recipes/addition_opd.yaml: 64 x 2 answers,
the exact full-vocabulary reverse KL, lr 5e-5 cosine over 8 steps) from the same start,
evaluated every 2 steps. The teacher is the RL run's own result, so the question is exactly "how
many steps did RL take to get here, and how many does distillation take to follow". Both arms'
held-out accuracy (100 problems, greedy) is read back by step and by training minutes (the step
times summed, evaluations left out); answers sampled per step differ (64 against 128) and are
recorded. A seed (`--seed S`) is one command.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from posttrain.experiments.common import Progress, train_arm
from posttrain.config.options import load_config, recipe_path

CLAIM = ("on-policy distillation learns from the teacher's judgement of every token, so the "
         "student reaches the teacher's accuracy in far fewer steps than RL needed (§8)")
OVERRIDES = ["--data.eval_size", "100"]
REPEATS = 30            # RL steps (the teacher's training); distillation takes the recipe's 8
KEEP_FREED_MEMORY = False   # the two arms' batches differ in size
MIN_REPEATS = 2
EVAL_EVERY_RL = 2      # (100 greedy answers: a few seconds)
EVAL_EVERY_OPD = 2
OPD_RECIPE = "addition_opd.yaml"
REACHED = 0.9           # "reached": at least 90% of the teacher's final held-out accuracy


def opd_recipe(teacher: Path):
    """The OPD recipe with `teacher` as its teacher."""
    return load_config(recipe_path(OPD_RECIPE), ["--teacher.path", str(teacher)])


def opd_fields(run, opd) -> dict:
    """The distillation arm: the OPD recipe's (`opd`) preset, batch shape, optimiser and teacher
    on the run's model, data and sampling."""
    rollout = replace(run.cfg.rollout, prompts_per_step=opd.rollout.prompts_per_step,
                      group_size=opd.rollout.group_size)
    optim = replace(run.cfg.optim, lr=opd.optim.lr, schedule=opd.optim.schedule)
    return {"preset": opd.preset, "rollout": rollout, "optim": optim,
            "teacher": replace(run.cfg.teacher, path=opd.teacher.path)}


def first_reaching(steps: list[int], accuracy: list[float], minutes: list[float],
                   target: float) -> dict:
    """The first evaluation at or above `target` (its step and training minutes; None if none)."""
    for s, a, m in zip(steps, accuracy, minutes):
        if a >= target:
            return {"step": s, "minutes": m}
    return {"step": None, "minutes": None}


def run(run, out, repeats: int, progress: Progress) -> dict:
    out = Path(out)
    rl = train_arm(run, "grpo", {}, out, repeats, progress,
                   eval_every=EVAL_EVERY_RL, keep_model=True)
    teacher = out / "run" / "grpo" / "final_model"
    recipe = opd_recipe(teacher)
    opd_steps = min(recipe.steps, repeats)
    fields = opd_fields(run, recipe)
    opd = train_arm(run, "opd", recipe.algorithm, out, opd_steps, progress,
                    eval_every=EVAL_EVERY_OPD, **fields)
    shutil.rmtree(teacher, ignore_errors=True)   # the record keeps its figures, not its weights
    target = REACHED * rl["eval_after"]
    arms = {"grpo": rl, "opd": opd}
    for arm in arms.values():
        arm["reached"] = first_reaching(arm["eval_steps"][1:], arm["eval_accuracy"][1:],
                                        arm["eval_minutes"][1:], target)
    return {"arms": arms, "teacher_accuracy": rl["eval_after"], "target": target,
            "rl_steps": repeats, "opd_steps": opd_steps,
            "answers_per_step": {"grpo": run.cfg.batch_size,
                                 "opd": fields["rollout"].prompts_per_step * fields["rollout"].group_size},
            "eval_size": run.cfg.data.eval_size}


def plot(numbers: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, x, label in ((axes[0], "eval_steps", "step"), (axes[1], "eval_minutes", "training minutes")):
        for arm, n in numbers["arms"].items():
            ax.plot(n[x], [100 * a for a in n["eval_accuracy"]], marker="o", ms=4,
                    label={"grpo": "GRPO (the teacher's own run)", "opd": "OPD from that teacher"}[arm])
        ax.axhline(100 * numbers["target"], color="grey", ls=":", lw=1,
                   label=f"{REACHED:.0%} of the teacher's {100 * numbers['teacher_accuracy']:.0f}%")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (%)")
        ax.legend(fontsize=8)
    fig.suptitle("on-policy distillation against RL from the same start", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
