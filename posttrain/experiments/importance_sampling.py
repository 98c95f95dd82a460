"""Importance sampling: one batch reused for several epochs, until the ratio drifts.

The claim (lecture §3 and §5, docs/algorithms.md §3, §5): samples from pi_old can train
pi_theta through the ratio rho = pi_theta / pi_old, so a batch may be reused for several
updates; the further pi_theta moves, the wider the ratio spreads and the fewer samples carry the
estimate; PPO's clip stops a token's gradient once its ratio leaves [1 - eps, 1 + eps], which
bounds the drift.

Method: draw one batch of the recipe (16 prompts x 4 answers from the real policy), GRPO's
group advantages, and pi_old's log-probs recomputed by the trainer's own forward (so the first
ratio is 1). Then, from the same starting weights, E epochs of full-batch AdamW steps with each
objective from the registry: 'importance_sampled' (rho A, no clip) and 'clipped' (PPO's). Before
every epoch and after the last: the ratio's mean, spread and range over the batch's tokens, the
share of tokens outside the clip band, the clipped shares, the k3 estimate of KL(pi_old ||
pi_theta), and the effective sample size of the answers' sequence weights prod_t rho_t,
(sum w)^2 / sum w^2 as a share of the batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses.advantages import grpo_advantage
from posttrain.experiments.common import Progress, sample_batch
from posttrain.rollout.forward import frozen_logprobs, group_chunks, sequence_logprobs
from posttrain.losses.common import masked_mean
from posttrain.losses.correction import ratio_stats
from posttrain.losses.policy import POLICY_LOSSES, PolicyInputs, clip_fractions, clip_sides
from posttrain.sampling.batch import ScoredBatch

CLAIM = ("a batch from pi_old can be reused through the ratio pi_theta / pi_old while the ratio "
         "stays near 1; the clip bounds how far it drifts (§3, §5)")
OVERRIDES = ["--data.difficulty", "1", "--data.eval_size", "20"]   # rewards that differ in a group
REPEATS = 16            # epochs on the one batch
KEEP_FREED_MEMORY = True
MIN_REPEATS = 1
ARMS = ("importance_sampled", "clipped")


def drift(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, eps: tuple[float, float]) -> dict:
    """How far pi_theta has moved from pi_old on the batch's tokens."""
    stats = ratio_stats(logp, old, mask)
    ratio = (logp - old).exp()
    on = mask > 0
    seq_w = ((logp - old) * mask).sum(-1).exp().double()
    clipped = clip_fractions(clip_sides(ratio, adv, 1 - eps[0], 1 + eps[1]), mask)
    return {"ratio_mean": float(stats.ratio_mean), "ratio_sd": float(ratio[on].std()),
            "ratio_min": float(stats.ratio_min), "ratio_max": float(stats.ratio_max),
            "outside_band": float(((ratio[on] < 1 - eps[0]) | (ratio[on] > 1 + eps[1])).float().mean()),
            "clip_frac_low": float(clipped["policy/clip_frac_low"]),
            "clip_frac_high": float(clipped["policy/clip_frac_high"]),
            "approx_kl_old": float(stats.approx_kl_old),
            "ess_share": float(seq_w.sum() ** 2 / (seq_w ** 2).sum() / len(seq_w))}


@dataclass(frozen=True)
class ReusedBatch:
    """The one batch every epoch trains on: the sampled batch, and pi_old's log-probs of its
    tokens and its GRPO advantages, (B, T) each."""

    batch: ScoredBatch
    old: Tensor
    adv: Tensor


def epoch(model, optimizer, data: ReusedBatch, arm: str, run) -> Tensor:
    """One full-batch step of objective `arm` (micro-batches accumulate; token-mean over the
    batch; the recipe's gradient clipping); returns the log-probs it started from."""
    batch, old, adv = data.batch, data.old, data.adv
    cfg, rollout, mask = run.cfg, batch.rollout, batch.loss_mask_B_T
    n_tokens, logps = mask.sum().clamp_min(1), []
    for rows in group_chunks(len(batch.rewards_B), rollout.group_size, cfg.optim.micro_batch_size):
        logp = sequence_logprobs(model, rollout, rows, cfg.rollout.temperature,
                                 autocast=cfg.model.autocast).logp
        x = PolicyInputs(logp, old[rows], adv[rows], mask[rows], rollout.group_size)
        term = POLICY_LOSSES[arm](x, run.algo.objective_params())
        ((term.loss_B_T * mask[rows]).sum() / n_tokens).backward()
        logps.append(logp.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.cat(logps) * rollout.response_mask_B_T


def run_arm(start, data: ReusedBatch, arm: str, run, epochs: int, *,
            progress: bool = True) -> list[dict]:
    """`epochs` steps of `arm` from the starting weights; the drift before each and after the last."""
    batch, old, adv = data.batch, data.old, data.adv
    model = copy.deepcopy(start).train()
    o, eps = run.cfg.optim, (run.algo.clip_low, run.algo.clip_high)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                  weight_decay=o.weight_decay)
    mask, rows = batch.loss_mask_B_T, []
    for _ in progress.range(epochs, f"importance-sampling {arm}: epoch"):
        logp = epoch(model, optimizer, data, arm, run)
        rows.append(drift(logp, old, adv, mask, eps))
    after = frozen_logprobs(model, batch.rollout, run.cfg.rollout.temperature,
                            o.micro_batch_size, run.cfg.model.autocast)
    rows.append(drift(after, old, adv, mask, eps))
    return rows


def run(run, out, repeats: int, progress: Progress) -> dict:
    cfg = run.cfg
    batch = sample_batch(run)
    old = frozen_logprobs(run.learner.model, batch.rollout, cfg.rollout.temperature,
                          cfg.optim.micro_batch_size, cfg.model.autocast)
    rewards_P_G = batch.rewards_B.view(-1, batch.rollout.group_size).float()
    adv = grpo_advantage(rewards_P_G).flatten()[:, None] * batch.loss_mask_B_T
    data = ReusedBatch(batch, old, adv)
    arms = {arm: run_arm(run.learner.model, data, arm, run, repeats, progress=progress) for arm in ARMS}
    return {"arms": arms, "epochs": repeats, "lr": cfg.optim.lr,
            "clip_band": [1 - run.algo.clip_low, 1 + run.algo.clip_high],
            "answers": len(batch.rewards_B), "mean_reward": float(batch.rewards_B.mean()),
            "tokens": int(batch.loss_mask_B_T.sum()),
            "answers_with_signal": int((adv.abs().sum(-1) > 0).sum()),
            "mean_abs_advantage": float(masked_mean(adv.abs(), batch.loss_mask_B_T))}


def plot(numbers: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("approx_kl_old", "k3 estimate of KL(pi_old || pi_theta)"),
              ("ratio_sd", "spread of the ratio over tokens (sd)"),
              ("outside_band", "share of tokens outside the clip band"),
              ("ess_share", "effective sample size of the answers (share)")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, (key, title) in zip(axes, panels):
        for arm, rows in numbers["arms"].items():
            ax.plot(range(len(rows)), [r[key] for r in rows], marker="o", ms=3, label=arm)
        if key in ("approx_kl_old", "ratio_sd"):   # the unclipped run spans five decades
            ax.set_yscale("symlog", linthresh=1e-2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("epochs on the same batch")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
