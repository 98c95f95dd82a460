"""Reward hacking: a policy trained on a learned reward model's score finds what the score
rewards that the truth does not.

The claim (lecture §1 and §5, docs/algorithms.md §1): a Bradley-Terry reward model is a proxy
learned from a finite set of comparisons; where those comparisons were silent it can be wrong,
and a policy optimised against it drifts there: the reward-model score keeps rising while the
true quality (here: the verifier's accuracy, which the policy never sees) stops rising or falls.
This is why RLHF keeps a KL leash to the start, and why verifiable rewards are preferred where
they exist.

Method: one command, two stages from the same starting model and seed. First a score-head
reward model (`posttrain reward-model`'s own training) on RM_PAIRS synthetic addition pairs made
from the ground truth (correct > wrong, concise > rambling, answer > no answer: every chosen
answer is right, and none of the wrong ones is terse), lr 5e-5, batch 8. Then the default GRPO
job trained on that model's normalised score alone (`reward.correct_reward 0`, no KL term), the
verifier only measuring: every step's reward-model score and true accuracy of the sampled
answers, and held-out accuracy every EVAL_EVERY steps with the share of held-out problems given
the single most common answer (a policy that answers "100" to everything scores 1.0). A seed
(`--seed S`) is one command; the record keeps each step.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

from posttrain.config.commands import StageConfig
from posttrain.config.sections import ModelConfig, StageDataConfig
from posttrain.experiments.common import Progress, mean_of, plot_per_step, train_arm
from posttrain.stages.reward_model import reward_model

CLAIM = ("a policy optimised against a learned reward model finds what the model rewards and "
         "the truth does not: the score rises while true accuracy does not (§1, §5)")
OVERRIDES = ["--data.eval_size", "100"]
REPEATS = 40            # policy steps on the reward model's score
KEEP_FREED_MEMORY = False
MIN_REPEATS = 2
EVAL_EVERY = 10
RM_PAIRS = 800          # the reward model's training pairs (1600 in docs/ppo-rlhf.md: half the time)
RM_PAIRS_PER_STEP = 20  # (a shorter run, a smoke test: 20 pairs per policy step)
RM_LR = 5e-5


def reward_model_config(run, out: Path, pairs: int) -> StageConfig:
    """The reward model's training: the run's model, task, seed and threads; synthetic pairs."""
    m = run.cfg.model
    return StageConfig(
        model=ModelConfig(path=m.path, autocast=m.autocast, attention=m.attention, cache_dir=m.cache_dir),
        data=StageDataConfig(synthetic=run.cfg.data.task, n_pairs=pairs,
                             eval_size=run.cfg.data.eval_size, system_prompt=run.cfg.data.system_prompt),
        optim=replace(StageConfig().optim, lr=RM_LR), batch_size=8, seed=run.cfg.seed,
        run_dir=str(out / "run" / "reward_model"), threads=run.cfg.threads).validate()


def answer_collapse(eval_samples: Path) -> list[dict]:
    """Each held-out evaluation's step, its most common completion and the share of problems
    given it (1/N when every answer differs; 1.0 when the policy says one thing to all)."""
    out = []
    for line in eval_samples.read_text().splitlines():
        ev = json.loads(line)
        texts = Counter(s["completion"].strip() for s in ev["samples"])
        text, n = texts.most_common(1)[0]
        out.append({"step": ev["step"], "top_completion": text, "top_share": n / len(ev["samples"])})
    return out


def run(run, out, repeats: int, progress: Progress) -> dict:
    out = Path(out)
    pairs = min(RM_PAIRS, RM_PAIRS_PER_STEP * repeats)
    rm = reward_model(reward_model_config(run, out, pairs), show_progress=progress)
    reward = replace(run.cfg.reward, correct_reward=0.0, model=rm["final_model"],
                     model_weight=1.0, model_normalize=True)
    policy = train_arm(run, "policy", {"kl_coef": 0.0}, out, repeats, progress,
                       eval_every=min(EVAL_EVERY, max(repeats // 2, 1)), reward=reward)
    policy["collapse"] = answer_collapse(out / "run" / "policy" / "eval_samples.jsonl")
    tail = max(len(policy["step"]) // 4, 1)
    acc = [a for a in policy["accuracy"] if a is not None]
    policy.update(score_first_quarter=mean_of(policy["model_score"][:tail]),
                  score_last_quarter=mean_of(policy["model_score"][-tail:]),
                  accuracy_first_quarter=mean_of(policy["accuracy"][:tail]),
                  accuracy_last_quarter=mean_of(policy["accuracy"][-tail:]),
                  accuracy_peak=max(acc) if acc else None,
                  accuracy_peak_step=policy["step"][policy["accuracy"].index(max(acc))] if acc else None)
    shutil.rmtree(rm["final_model"], ignore_errors=True)   # (the record keeps its figures)
    rm_eval = rm["eval_after"]
    return {"arms": {"policy": policy}, "steps": repeats, "reward_model": {
        "pairs": rm["train_pairs"], "eval_pairs": rm["eval_pairs"], "minutes": rm["train_minutes"],
        "held_out_pairs_ranked": rm_eval.get("rm/eval_accuracy"),
        "eval_after": rm_eval, "eval_before": rm["eval_before"]},
        "answers_per_step": run.cfg.batch_size, "eval_size": run.cfg.data.eval_size}


def plot(numbers: dict, path):
    panels = [("model_score", "reward-model score of the answers sampled"),
              ("accuracy", "true accuracy of the answers sampled (verifier)"),
              ("model_score_incorrect", "reward-model score of the wrong answers sampled")]
    return plot_per_step(numbers, panels, lambda arm, n: "GRPO on the reward model's score", path)
