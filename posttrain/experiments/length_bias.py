"""Length bias: how each aggregation weighs a token by its answer's length, and what one update
does to the lengths of wrong and correct answers.

The claim (lecture §7, docs/algorithms.md §7): GRPO's per-answer mean 1/|o_i| sum_t gives each
token of a long answer less weight than a token of a short one. For a wrong answer (A < 0) that
means a long one is pushed down less per token than a short one, so wrong answers drift longer;
token-mean (DAPO) and Dr. GRPO's constant L_max weigh every token the same and remove the bias.

Method: draw the recipe's batches from the real policy (16 prompts x 4 answers at temperature 1,
1-digit addition, up to 64 new tokens, no stop string: wrong answers ramble on and vary in length).
For each pair of independent batches (one to update on, one to evaluate on) and each arm (a
preset's advantage, objective and aggregation from the registries, KL off):

1. the exact per-token weight of the update, W_it = -dL/d log pi(y_it) at pi_theta = pi_old
   (every objective's gradient is sum_it W_it grad log pi(y_it) by the chain rule), and for the
   wrong answers the slope of log |W| per token against log |o_i| (-1: 1/|o|; 0: no bias);
2. one small step along that direction, sum_it W_it grad log pi(y_it), of the same L2 length
   for every arm (STEP_L2), so arms differ only in direction (at pi_theta = pi_old GSPO and GMPO
   have GRPO's direction and CISPO and SAPO token-mean's: the step is taken once for each);
3. on the evaluation batch (answers sampled from the policy before the step), the expected
   length of wrong answers, of correct answers and the accuracy after the step, by importance
   weights w = pi_theta'(y) / pi_theta(y) computed in float32 (self-normalised:
   sum w L 1{wrong} / sum w 1{wrong}), against the same sums with w = 1.

Batches are pooled over pairs; standard errors are jackknifed over pairs. This measures the
direction of one update from the real policy, not lengths over a whole training run (a run of
each arm over 3 seeds takes hours here: docs/lecture-reproduced.md says so).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from posttrain.losses.advantages import ADVANTAGES, AdvantageInputs, AdvantageParams
from posttrain.config.commands import ConfigError
from posttrain.experiments.common import Progress, jackknife, sample_batch
from posttrain.rollout.forward import group_chunks, sequence_logprobs
from posttrain.losses.aggregation import AGGREGATIONS, aggregate
from posttrain.losses.common import masked
from posttrain.losses.policy import POLICY_LOSSES, PolicyInputs
from posttrain.config.presets import PRESETS, AlgorithmConfig

CLAIM = ("GRPO's 1/|o| aggregation pushes long wrong answers down less per token than short ones, "
         "so wrong answers grow; token-mean and Dr. GRPO's constant remove the bias (§7)")
# answers that vary in length: no stop string and room to ramble; 1-digit addition so a group's
# answers differ in correctness and every arm has wrong answers to push down
OVERRIDES = ["--data.difficulty", "1", "--data.eval_size", "20", "--rollout.max_new_tokens", "64",
             "--rollout.stop", ""]
REPEATS = 6             # pairs of batches (update, evaluation): about 2 minutes each
KEEP_FREED_MEMORY = False   # answer lengths vary from batch to batch
MIN_REPEATS = 2         # the jackknife needs 2
# arm -> (preset, changes): each preset as it ships, and GRPO with the token-mean aggregation
ARMS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}), "grpo_token_mean": ("grpo", {"aggregation": "token_mean"}),
    "dr_grpo": ("dr_grpo", {}), "gspo": ("gspo", {}), "gmpo": ("gmpo", {}),
    "cispo": ("cispo", {}), "sapo": ("sapo", {})}
# the L2 length of every arm's step: small enough that log pi of an answer moves by a few
# hundredths (the record's mean_abs_delta_logp: 0.027), where importance weights stay near 1.
# The length of one AdamW step at the recipe's lr (lr x sqrt(parameters) = 0.23) taken along the
# raw gradient moved log pi of an answer by about 17 nats in a trial: no weight can be read there.
STEP_L2 = 1e-3
REFERENCE = "dr_grpo"   # each arm's change is also given against this one's, on the same answers
SUMS = ("n_wrong", "len_wrong", "n_correct", "len_correct", "n")   # per evaluation batch, w-weighted


def arm_algorithm(arm: str) -> AlgorithmConfig:
    """The arm's preset with its changes and no KL term (the bias is the aggregation's)."""
    preset, changes = ARMS[arm]
    return replace(PRESETS[preset], **changes, kl_in="none", kl_coef=0.0)


def token_weights(algo: AlgorithmConfig, rewards_P_G: Tensor, mask_B_T: Tensor,
                  logp_B_T: Tensor, max_len: float) -> Tensor:
    """W_it = -dL/d log pi(y_it) at pi_theta = pi_old: the weight of each token's grad log pi in
    the arm's update (its advantage, objective and aggregation)."""
    adv = ADVANTAGES[algo.advantage](AdvantageInputs(rewards_P_G, mask_B_T),
                                     AdvantageParams(algo.eps, algo.scale_by_std)).adv_B_T
    logp = logp_B_T.detach().clone().requires_grad_(True)
    x = PolicyInputs(logp, logp_B_T.detach(), adv, mask_B_T, rewards_P_G.shape[1])
    term = POLICY_LOSSES[algo.policy_loss](x, algo.objective_params())
    loss = aggregate(term.loss_B_T, AGGREGATIONS[algo.aggregation](mask_B_T, max_len))
    (grad,) = torch.autograd.grad(loss, logp)
    return -grad * mask_B_T


def length_slope(weights_B_T: Tensor, mask_B_T: Tensor, wrong_B: Tensor,
                 scale_B: Tensor) -> tuple[Tensor, Tensor]:
    """log |o_i| and log (mean |W_it| over the answer's tokens / |scale_i|) of each wrong answer
    the update weighs (a wrong answer in a group whose answers all fail has W = 0 and is left
    out). The scale is the answer's reward minus its group's mean, so what is left is the weight
    the aggregation (and objective) gives a token apart from how far the answer is from its
    group's mean; GRPO's division by the group's spread stays in (a per-group factor, which is
    why a flat aggregation's slope reads -0.01 rather than 0 on real batches)."""
    lengths = mask_B_T.sum(-1)
    per_token = weights_B_T.abs().sum(-1) / lengths.clamp_min(1) / scale_B.abs().clamp_min(1e-12)
    keep = wrong_B & (weights_B_T.abs().sum(-1) > 0) & (lengths > 0)
    return lengths[keep].log(), per_token[keep].log()


def least_squares_slope(x: Tensor, y: Tensor) -> float | None:
    """The slope of y against x (None with fewer than 2 distinct x)."""
    if len(x) < 2 or float(x.std()) == 0:
        return None
    xc = x.double() - x.double().mean()
    return float((xc * (y.double() - y.double().mean())).sum() / (xc ** 2).sum())


@torch.no_grad()
def float32_sequence_logp(model, batch, cfg) -> Tensor:
    """log pi(y_i) of each answer in float32 (small differences between two weights must not
    drown in bf16 rounding)."""
    rollout, out = batch.rollout, []
    for rows in group_chunks(len(batch.rewards_B), rollout.group_size, cfg.optim.micro_batch_size):
        logp = sequence_logprobs(model, rollout, rows, cfg.rollout.temperature).logp
        out.append(masked(logp, batch.loss_mask_B_T[rows]).sum(-1).double())
    return torch.cat(out)


def weighted_sums(batch, w_B: Tensor) -> Tensor:
    """SUMS of the evaluation batch under importance weights w (w = 1: the policy before)."""
    lengths = batch.loss_mask_B_T.sum(-1).double()
    correct = batch.correct_B.bool()
    wrong = ~correct
    return torch.stack([(w_B * wrong).sum(), (w_B * lengths * wrong).sum(), (w_B * correct).sum(),
                        (w_B * lengths * correct).sum(), w_B.sum()])


def step_along(model, distance: float) -> None:
    """theta += distance * g / |g| with g the parameters' .grad (then cleared); no step where
    g = 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))) if params else 0.0
    for p in params:   # (no gradient: a batch with no signal, every group all-equal; no step)
        if norm > 0:
            p.data.add_(p.grad, alpha=distance / norm)
        p.grad = None


def same_weights_as(weights: dict[str, Tensor], arm: str) -> str | None:
    """An earlier arm whose per-token weights equal `arm`'s (None: a direction of its own). At
    pi_theta = pi_old several objectives have the same gradient: GSPO and GMPO GRPO's, CISPO and
    SAPO token-mean's; they part only once the ratio moves."""
    w = weights[arm]
    scale = float(w.abs().max()) or 1.0
    for other, v in weights.items():
        if other == arm:
            return None
        if torch.allclose(v, w, rtol=1e-5, atol=1e-6 * scale):
            return other
    return None


def measure_pair(run, saved: list[Tensor], distance: float) -> tuple[dict, Tensor]:
    """One update batch and one evaluation batch: each arm's weights, slope data and the
    evaluation sums after its step (the weights restored after each; an arm whose weights equal
    an earlier one's reuses its step); the sums before."""
    cfg, model = run.cfg, run.learner.model
    update, evaluate = sample_batch(run), sample_batch(run)
    rows = torch.arange(len(update.rewards_B))
    logp = sequence_logprobs(model, update.rollout, rows, cfg.rollout.temperature,
                             autocast=cfg.model.autocast).logp
    mask, rewards_P_G = update.loss_mask_B_T, update.rewards_P_G.float()
    adv_B = rewards_P_G - rewards_P_G.mean(1, keepdim=True)
    before = float32_sequence_logp(model, evaluate, cfg)
    weights = {arm: token_weights(arm_algorithm(arm), rewards_P_G, mask, logp,
                                  float(cfg.rollout.max_new_tokens)) for arm in ARMS}
    arms: dict[str, dict] = {}
    for arm, w in weights.items():
        twin = same_weights_as(weights, arm)
        slope = length_slope(w, mask, ~update.correct_B.bool(), adv_B.flatten())
        if twin is not None:
            arms[arm] = {**arms[twin], "slope": slope, "same_step_as": twin}
            continue
        (w * logp).sum().backward(retain_graph=True)
        step_along(model, distance)
        delta = float32_sequence_logp(model, evaluate, cfg) - before
        for p, s in zip(model.parameters(), saved):
            p.data.copy_(s)
        arms[arm] = {"sums": weighted_sums(evaluate, delta.exp()), "slope": slope,
                     "mean_abs_delta": float(delta.abs().mean()), "same_step_as": None}
    return arms, weighted_sums(evaluate, torch.ones_like(before))


def pooled(sums_S: Tensor) -> dict[str, Tensor]:
    """Mean length of wrong and correct answers and the accuracy from SUMS totalled over pairs
    ((S,), or (K, S) for K sets of totals)."""
    s = sums_S
    return {"len_wrong": s[..., 1] / s[..., 0], "len_correct": s[..., 3] / s[..., 2],
            "accuracy": s[..., 2] / s[..., 4]}


def leave_one_out(sums_K_S: Tensor) -> Tensor:
    """(K, S): the sums over all pairs but pair k."""
    return sums_K_S.sum(0) - sums_K_S


def pooled_change(after_K_S: Tensor, before_K_S: Tensor) -> dict[str, tuple[float, float] | None]:
    """Each pooled quantity after minus before, with its jackknife SE over pairs (None where the
    batches hold no answer of that kind)."""
    after, before = pooled(after_K_S.sum(0)), pooled(before_K_S.sum(0))
    after_k, before_k = pooled(leave_one_out(after_K_S)), pooled(leave_one_out(before_K_S))
    out: dict[str, tuple[float, float] | None] = {}
    for key in after:
        delta, se = float(after[key] - before[key]), jackknife(after_k[key] - before_k[key])
        out[key] = (delta, se) if math.isfinite(delta) and math.isfinite(se) else None
    return out


def arm_summary(after_K_S: Tensor, before_K_S: Tensor, reference_K_S: Tensor, slope_x: Tensor,
                slope_y: Tensor, abs_delta: list[float]) -> dict:
    """The change of each pooled quantity after the arm's step, and its difference from the
    reference arm's change on the same evaluation answers (paired: most of the sampling noise
    cancels), with jackknife SEs over pairs; the slope of the per-token weight of wrong answers
    against their length; the mean |delta log pi| of an answer."""
    out = {"weight_length_slope": least_squares_slope(slope_x, slope_y),
           "wrong_answers_weighed": len(slope_x),
           "mean_abs_delta_logp": sum(abs_delta) / len(abs_delta)}
    for prefix, other in (("delta", before_K_S), ("vs_reference", reference_K_S)):
        for key, value in pooled_change(after_K_S, other).items():
            out[f"{prefix}_{key}"], out[f"{prefix}_{key}_se"] = value if value else (None, None)
    return out


def check_sampling(cfg) -> None:
    """The importance weights need answers drawn from pi itself: every answer kept, the whole
    distribution (no nucleus), the trainer's own numbers."""
    if cfg.rollout.top_p < 1 or cfg.algo.dynamic_sampling or cfg.algo.overlong == "filter":
        raise ConfigError("experiment length-bias reads importance weights pi'/pi on answers "
                          "drawn from pi: run it with rollout.top_p 1, no dynamic_sampling and "
                          "no overlong filter")


def run(run, out, repeats: int, progress: Progress) -> dict:
    cfg, model = run.cfg, run.learner.model
    check_sampling(cfg)
    saved = [p.detach().clone() for p in model.parameters()]
    distance = STEP_L2
    data: dict[str, dict[str, list]] = {a: {"sums": [], "x": [], "y": [], "d": [], "twin": []}
                                        for a in ARMS}
    before = []
    for _ in progress.range(repeats, "length-bias: pair of batches"):
        arms, sums = measure_pair(run, saved, distance)
        before.append(sums)
        for arm, m in arms.items():
            data[arm]["sums"].append(m["sums"])
            data[arm]["x"].append(m["slope"][0])
            data[arm]["y"].append(m["slope"][1])
            data[arm]["d"].append(m["mean_abs_delta"])
            data[arm]["twin"].append(m["same_step_as"])
    before_K_S = torch.stack(before)
    base = {k: float(v) if math.isfinite(float(v)) else None
            for k, v in pooled(before_K_S.sum(0)).items()}
    reference = torch.stack(data[REFERENCE]["sums"])
    arms = {arm: arm_summary(torch.stack(d["sums"]), before_K_S, reference, torch.cat(d["x"]),
                             torch.cat(d["y"]), d["d"]) for arm, d in data.items()}
    for arm, d in data.items():   # the arm whose step it shared in every pair, if any
        arms[arm]["same_step_as"] = d["twin"][0] if len(set(d["twin"])) == 1 else None
    scatter = {arm: {"log_length": torch.cat(d["x"]).tolist(), "log_weight": torch.cat(d["y"]).tolist()}
               for arm, d in data.items()}
    pair_sums = {arm: torch.stack(d["sums"]).tolist() for arm, d in data.items()}
    return {"arms": arms, "before": base, "reference": REFERENCE, "pairs": len(before),
            "answers_per_batch": cfg.batch_size,
            "step_l2": distance, "max_new_tokens": cfg.rollout.max_new_tokens,
            "wrong_answer_weights": scatter, "sums": list(SUMS),
            "pair_sums": {"before": before_K_S.tolist(), **pair_sums}}


def plot(numbers: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    arms = numbers["arms"]
    names = list(arms)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    for arm in ("grpo", "grpo_token_mean", "dr_grpo"):
        s = numbers["wrong_answer_weights"].get(arm)
        if s and s["log_length"]:
            x = torch.tensor(s["log_length"]).exp()
            y = torch.tensor(s["log_weight"]).exp()
            axes[0].scatter(x, y / y.mean(), s=8, alpha=0.6, label=arm)
    axes[0].set_xscale("log")
    axes[0].set_yscale("log")
    for axis in (axes[0].xaxis, axes[0].yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    axes[0].set_xlabel("length of the wrong answer (tokens)")
    axes[0].set_title("per-token push-down of wrong answers\n(per unit advantage, relative to the "
                      "arm's mean)", fontsize=10)
    if axes[0].collections:
        axes[0].legend(fontsize=8)
    ref = numbers.get("reference", REFERENCE)
    for ax, key, title in ((axes[1], "delta", "change of the mean length of wrong answers"),
                           (axes[2], "vs_reference", f"the same, minus {ref}'s on the same answers")):
        shown = [(i, arms[a][f"{key}_len_wrong"], 2 * arms[a][f"{key}_len_wrong_se"])
                 for i, a in enumerate(names) if arms[a][f"{key}_len_wrong"] is not None]
        if shown:
            xs, ys, es = zip(*shown)
            ax.errorbar(xs, ys, yerr=es, fmt="o", capsize=4)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(range(len(names)), names, rotation=25)
        ax.set_title(f"{title}\nafter one step of L2 {numbers['step_l2']:g} (tokens, 2 SE)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
