"""Baselines: the same expected gradient with less variance.

The claim (lecture §2, docs/algorithms.md §2): subtracting a baseline b that does not depend on
the answer keeps REINFORCE's expected gradient, E[(R - b) grad log pi(y)] = E[R grad log pi(y)],
and cuts its variance. A baseline that includes the answer's own reward (the batch or group mean)
scales the expectation by (1 - 1/n) for a mean over n rewards; leave-one-out (RLOO) keeps it exactly.

Method: draw the recipe's batches (16 prompts x 4 answers, sampled from the real policy), and
for each batch compute the policy gradient of (1/B) sum_i A_i log pi(y_i) with A from each arm:
no baseline, no baseline on rewards shifted by +1 (a common offset), batch mean, group mean,
leave-one-out, and GRPO's group-standardised advantage (not a baseline: it rescales each group).
Every gradient (all 135M coordinates) is kept as a count sketch; over the batches come each
arm's total variance tr Cov(g), and its expected gradient against the no-baseline one: the scale
s = <E g_arm, E g_none> / |E g_none|^2 and the cosine between the two expectations, both
estimated without the noise bias (products of different batches only), with jackknife standard
errors over batches.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.losses.advantages import (batch_mean_baseline_advantage, grpo_advantage,
                                  group_mean_baseline_advantage, reinforce_advantage,
                                  rloo_advantage)
from posttrain.experiments.common import (CountSketch, Progress, flat_grad, jackknife,
                                          sample_batch)
from posttrain.rollout.forward import sequence_logprobs

CLAIM = ("a baseline keeps the policy gradient's expectation and cuts its variance; "
         "leave-one-out keeps it exactly (§2)")
# 1-digit addition: the policy solves some answers and not others at temperature 1, so the
# rewards of a group differ and every arm has something to weigh
OVERRIDES = ["--data.difficulty", "1", "--data.eval_size", "20"]   # (81 problems; none evaluated)
REPEATS = 16            # batches
KEEP_FREED_MEMORY = True
MIN_REPEATS = 3         # the cross-batch products and the jackknife need 3
SKETCH = 2 ** 20
def offset_rewards(rewards_P_G: Tensor) -> Tensor:
    """No baseline on rewards that share an offset (+1: a bonus every answer earns). The
    expected gradient is the same, E[grad log pi] = 0; every baseline subtracts the offset."""
    return reinforce_advantage(rewards_P_G + 1.0)


ARMS = {"none": reinforce_advantage, "none_reward_plus_1": offset_rewards,
        "batch_mean": batch_mean_baseline_advantage,
        "group_mean": group_mean_baseline_advantage, "leave_one_out": rloo_advantage,
        "grpo_std": grpo_advantage}


def expected_scale(arm: str, batch_size: int, group_size: int) -> float | None:
    """What theory says E[g_arm] is, as a multiple of E[g_none] (None: no such multiple)."""
    return {"none": 1.0, "none_reward_plus_1": 1.0, "batch_mean": 1 - 1 / batch_size, "group_mean": 1 - 1 / group_size,
            "leave_one_out": 1.0}.get(arm)


def arm_gradients(run, sketch: CountSketch) -> tuple[dict[str, Tensor], Tensor]:
    """One batch: each arm's sketched gradient of (1/B) sum_i A_i log pi(y_i), and the rewards."""
    batch = sample_batch(run)
    cfg, rollout = run.cfg, batch.rollout
    rows = torch.arange(len(batch.rewards_B))
    logp = sequence_logprobs(run.learner.model, rollout, rows, cfg.rollout.temperature,
                             autocast=cfg.model.autocast).logp
    seq_logp_B = (logp * batch.loss_mask_B_T).sum(-1)
    rewards_P_G = batch.rewards_B.view(-1, rollout.group_size).float()
    out = {}
    for arm, advantage in ARMS.items():
        adv_B = advantage(rewards_P_G).flatten()
        (adv_B * seq_logp_B).mean().backward(retain_graph=True)
        out[arm] = sketch(flat_grad(run.learner.model))
    return out, rewards_P_G


def off_diagonal_sums(cross_K_K: Tensor) -> tuple[float, Tensor]:
    """sum_{i != j} C_ij over all batches, and the same sum with batch k left out, for each k."""
    total = cross_K_K.sum() - cross_K_K.trace()
    diag = cross_K_K.diagonal()
    without = total - (cross_K_K.sum(1) - diag) - (cross_K_K.sum(0) - diag)
    return float(total), without


def arm_statistics(g_K_R: Tensor, none_K_R: Tensor) -> dict[str, float | None]:
    """Total variance, and the expectation against no baseline (scale and cosine, noise-free
    products of different batches) with jackknife standard errors; None where the no-baseline
    gradient has no expectation to compare with (every reward 0)."""
    k = g_K_R.shape[0]
    centred = g_K_R - g_K_R.mean(0)
    variance = float((centred ** 2).sum() / (k - 1))
    ab, ab_k = off_diagonal_sums(g_K_R @ none_K_R.T)
    aa, aa_k = off_diagonal_sums(g_K_R @ g_K_R.T)
    bb, bb_k = off_diagonal_sums(none_K_R @ none_K_R.T)
    stats = {"variance": variance, "mean_norm2": aa / (k * (k - 1)), "scale": None,
             "scale_se": None, "cosine": None, "cosine_se": None}
    if bb > 0 and aa > 0 and bool((bb_k > 0).all()) and bool((aa_k > 0).all()):
        cos_k = ab_k / (aa_k * bb_k).sqrt()
        stats.update(scale=ab / bb, scale_se=jackknife(ab_k / bb_k),
                     cosine=ab / math.sqrt(aa * bb), cosine_se=jackknife(cos_k))
    return stats


def run(run, out, repeats: int, progress: Progress) -> dict:
    dim = sum(p.numel() for p in run.learner.model.parameters() if p.requires_grad)
    sketch = CountSketch(dim, SKETCH, seed=run.cfg.seed)
    grads: dict[str, list[Tensor]] = {arm: [] for arm in ARMS}
    rewards, all_equal = [], 0
    for _ in progress.range(repeats, "baselines: batch"):
        g, r = arm_gradients(run, sketch)
        for arm, v in g.items():
            grads[arm].append(v)
        rewards.append(float(r.mean()))
        all_equal += int((r.amax(1) == r.amin(1)).sum())
    none = torch.stack(grads["none"])
    B, G = run.cfg.batch_size, run.cfg.rollout.group_size
    arms = {}
    for arm, vs in grads.items():
        arms[arm] = {**arm_statistics(torch.stack(vs), none),
                     "expected_scale": expected_scale(arm, B, G)}
    for arm in arms:
        v = arms[arm]["variance"]
        arms[arm]["variance_reduction"] = arms["none"]["variance"] / v if v > 0 else None
    measured = len(rewards)   # (fewer than `repeats` when --max_minutes ends the loop)
    return {"arms": arms, "batches": measured, "answers_per_batch": B, "group_size": G,
            "mean_reward": sum(rewards) / measured,
            "all_equal_groups": all_equal / (measured * B // G)}


def plot(numbers: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = numbers["arms"]
    names = list(arms)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = axes[0].bar(names, [arms[a]["variance"] for a in names])
    none = arms["none"]["variance"]
    for bar, a in zip(bars, names):
        if none > 0:
            axes[0].annotate(f"{arms[a]['variance'] / none:.2f}x none's",
                             (bar.get_x(), bar.get_height()), fontsize=8, va="bottom")
    axes[0].set_yscale("log")
    axes[0].set_title(f"tr Cov of the gradient estimate ({numbers['batches']} batches of "
                      f"{numbers['answers_per_batch']})")
    x = range(len(names))
    measured = [(i, arms[a]["scale"], 2 * arms[a]["scale_se"]) for i, a in enumerate(names)
                if arms[a]["scale"] is not None]
    if measured:
        xs, ys, es = zip(*measured)
        axes[1].errorbar(xs, ys, yerr=es, fmt="o", capsize=4, label="measured (2 SE)")
    theory = [(i, arms[a]["expected_scale"]) for i, a in enumerate(names)
              if arms[a]["expected_scale"] is not None]
    axes[1].plot(*zip(*theory), "rx", ms=10, label="theory")
    axes[1].set_xticks(list(x), names)
    axes[1].axhline(1, color="k", lw=0.5)
    axes[1].set_title("E[g_arm] along E[g_none] (scale)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
