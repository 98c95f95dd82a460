"""KL estimators: what each one's value measures and which divergence its gradient descends.

The claim (lecture §6, docs/algorithms.md §6): k1 = log(pi/pi_ref) and k3 = r - 1 - log r
(r = pi_ref/pi) are unbiased for KL(pi || pi_ref) under y ~ pi, k3 with lower variance and never
negative; k2 = (log r)^2 / 2 is biased as a value. Used as a loss on sampled tokens, k1's
gradient is 0 in expectation, k2's is grad KL(pi || pi_ref) and k3's is grad KL(pi_ref || pi)
(the forward KL); k3_st keeps k3's value with k2's gradient.

Method: sample the recipe's batches from the real policy pi; pi_ref is a drifted copy
(every weight tensor plus Gaussian noise of `drift` times its own RMS), at several drifts.
At every response position the exact KL in both directions comes from the full vocabulary.
Each estimator's value on the sampled token is compared with the exact reverse KL there (bias
with its standard error over tokens, spread per token). Its gradient, as a loss summed over the
sampled tokens, is taken with respect to the logits at every response position (the parameters'
gradient is the same Jacobian times it, for every loss alike) and regressed on the exact
reverse and forward KL's gradients at the same positions: g_k ~ a grad KL(pi||ref) + b grad
KL(ref||pi), with jackknife standard errors over answers. Theory: k1 (0, 0), k2 and k3_st
(1, 0), k3 (0, 1). Where the two exact gradients point the same way (small drifts) a and b
cannot be told apart, and their errors say so.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.experiments.common import Progress, jackknife, mean_se, sample_batch
from posttrain.rollout.base import Rollout
from posttrain.rollout.forward import sequence_logprobs
from posttrain.losses.common import token_logprobs
from posttrain.losses.kl import KL_ESTIMATORS, exact_kl_from_logits

CLAIM = ("k1 and k3 are unbiased for KL(pi || pi_ref), k3 with less variance; in the loss k1's "
         "gradient is 0 in expectation, k2's follows the reverse KL, k3's the forward KL (§6)")
OVERRIDES: list[str] = []
REPEATS = 4            # batches of 16 prompts x 4 answers
KEEP_FREED_MEMORY = False   # logits of every batch length T: a tuned heap fragments past 24 GB
MIN_REPEATS = 1
DRIFTS = (0.005, 0.01, 0.02, 0.04, 0.08)
TARGETS = ("reverse", "forward")   # grad KL(pi || pi_ref), grad KL(pi_ref || pi)


def drifted_copy(model, drift: float, seed: int):
    """pi_ref: a copy of `model` whose every weight tensor moved by Gaussian noise of `drift`
    times the tensor's own RMS (tied weights move once)."""
    ref = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            rms = p.float().pow(2).mean().sqrt()
            p.add_((torch.randn(p.shape, generator=g) * drift * rms).to(p.dtype))
    return ref


def value_errors(logp: Tensor, ref_logp: Tensor, exact: Tensor, mask: Tensor) -> dict[str, list[float]]:
    """Per estimator, its value minus the exact reverse KL at every response token."""
    on = mask > 0
    return {name: (KL_ESTIMATORS[name](logp, ref_logp) - exact)[on].tolist()
            for name in KL_ESTIMATORS}


def logit_gradients(logits: Tensor, ref_logits: Tensor, tokens: Tensor, mask: Tensor,
                    temperature: float) -> dict[str, Tensor]:
    """d loss / d logits (B, T, V) of every estimator summed over the sampled tokens, and of the
    exact KL(pi || pi_ref) ('reverse') and KL(pi_ref || pi) ('forward') summed over positions."""
    z = logits.detach().requires_grad_(True)
    logp = token_logprobs(z, tokens, temperature)
    ref_logp = token_logprobs(ref_logits, tokens, temperature)
    losses = {name: (KL_ESTIMATORS[name](logp, ref_logp) * mask).sum() for name in KL_ESTIMATORS}
    losses["reverse"] = (exact_kl_from_logits(z, ref_logits, temperature) * mask).sum()
    losses["forward"] = (exact_kl_from_logits(ref_logits, z, temperature) * mask).sum()
    return {n: torch.autograd.grad(loss, z, retain_graph=True)[0] for n, loss in losses.items()}


def answer_products(grads: dict[str, Tensor]) -> dict[tuple[str, str], Tensor]:
    """Per answer (B,): the inner products the regression and the cosines need."""
    def dot(a: str, b: str) -> Tensor:
        return (grads[a] * grads[b]).sum((1, 2), dtype=torch.float64)
    pairs = [("reverse", "reverse"), ("forward", "forward"), ("reverse", "forward")]
    pairs += [(n, t) for n in KL_ESTIMATORS for t in (*TARGETS, n)]
    return {pair: dot(*pair) for pair in pairs}


def regression(products: dict[tuple[str, str], Tensor], name: str) -> Tensor:
    """(a, b) of g_name ~ a g_reverse + b g_forward, least squares over all positions."""
    rr, ff, rf = (products[p].sum() for p in [("reverse", "reverse"), ("forward", "forward"),
                                             ("reverse", "forward")])
    y = torch.stack([products[(name, "reverse")].sum(), products[(name, "forward")].sum()])
    return torch.linalg.solve(torch.stack([torch.stack([rr, rf]), torch.stack([rf, ff])]), y)


def coefficients(products: dict[tuple[str, str], Tensor], name: str) -> dict[str, float]:
    """The regression's coefficients with jackknife standard errors over answers."""
    full = regression(products, name)
    n = len(products[("reverse", "reverse")])
    keep = torch.ones(n, dtype=torch.bool)
    leave = []
    for i in range(n):
        keep[i] = False
        leave.append(regression({p: v[keep] for p, v in products.items()}, name))
        keep[i] = True
    se = jackknife(torch.stack(leave))
    return {"coef_reverse": float(full[0]), "coef_reverse_se": float(se[0]),
            "coef_forward": float(full[1]), "coef_forward_se": float(se[1])}


def cosine(products: dict[tuple[str, str], Tensor], a: str, b: str) -> float:
    """Cosine of two gradients pooled over all positions."""
    ab = products[(a, b)].sum()
    return float(ab / (products[(a, a)].sum() * products[(b, b)].sum()).sqrt().clamp_min(1e-300))


def summarise(errors: dict[str, list[float]], values: dict[str, list[float]], exact: list[float],
              products: dict[tuple[str, str], Tensor]) -> dict:
    """One drift's row: the exact KL, and for each estimator its bias (with its standard
    error), spread per token, and where its gradient points (regression and cosines)."""
    row = {"exact_reverse_kl": sum(exact) / len(exact), "tokens": len(exact),
           "cos_reverse_forward": cosine(products, "reverse", "forward"), "estimators": {}}
    for name, errs in errors.items():
        bias, se = mean_se(errs)
        row["estimators"][name] = {
            "bias": bias, "bias_se": se, "sd_per_token": _sd(values[name]),
            **{f"cos_grad_{t}": cosine(products, name, t) for t in TARGETS},
            **coefficients(products, name)}
    return row


@dataclass(frozen=True)
class AnswerChunk:
    """A few answers of one batch from pi: their rows of the rollout, sampled tokens and loss
    mask, pi's logits there (no gradient) and the sampling temperature."""

    rollout: Rollout
    rows: Tensor
    tokens: Tensor
    mask: Tensor
    logits: Tensor
    temperature: float


def measure_batch(run, refs: dict, acc: dict, chunk: int = 16) -> None:
    """One batch from pi: every drift's values, exact KLs and logit-gradient products, `chunk`
    answers at a time (a chunk's logits are chunk x T x 49k floats, and a few copies of them)."""
    batch, temperature = sample_batch(run), run.cfg.rollout.temperature
    for start in range(0, len(batch.rewards_B), chunk):
        rows = torch.arange(start, min(start + chunk, len(batch.rewards_B)))
        tokens, mask = batch.rollout.response_ids_B_T[rows], batch.loss_mask_B_T[rows]
        with torch.no_grad():
            logits = sequence_logprobs(run.learner.model, batch.rollout, rows, temperature,
                                       keep_logits=True).logits
        answers = AnswerChunk(batch.rollout, rows, tokens, mask, logits, temperature)
        for d, ref in refs.items():
            measure_drift(ref, answers, acc[d])


def measure_drift(ref, chunk: AnswerChunk, acc: dict) -> None:
    """One drift on one chunk of answers: values against the exact KL, and gradient products."""
    logits, tokens, mask, temperature = chunk.logits, chunk.tokens, chunk.mask, chunk.temperature
    on = mask > 0
    with torch.no_grad():
        ref_logits = sequence_logprobs(ref, chunk.rollout, chunk.rows, temperature,
                                       keep_logits=True).logits
        logp = token_logprobs(logits, tokens, temperature)
        ref_logp = token_logprobs(ref_logits, tokens, temperature)
        exact_t = exact_kl_from_logits(logits, ref_logits, temperature)
    for n, e in value_errors(logp, ref_logp, exact_t, mask).items():
        acc["errors"][n] += e
        acc["values"][n] += KL_ESTIMATORS[n](logp, ref_logp)[on].tolist()
    acc["exact"] += exact_t[on].tolist()
    grads = logit_gradients(logits, ref_logits, tokens, mask, temperature)
    for pair, v in answer_products(grads).items():
        acc["products"].setdefault(pair, []).append(v)


def _sd(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1))


def run(run, out, repeats: int, progress: Progress) -> dict:
    refs = {d: drifted_copy(run.learner.model, d, seed=run.cfg.seed + i) for i, d in enumerate(DRIFTS)}
    acc = {d: {"errors": {n: [] for n in KL_ESTIMATORS}, "values": {n: [] for n in KL_ESTIMATORS},
               "exact": [], "products": {}} for d in DRIFTS}
    measured = 0
    for _ in progress.range(repeats, "kl-estimators: batch"):
        measure_batch(run, refs, acc)
        measured += 1
    rows = {}
    for d, a in acc.items():
        products = {p: torch.cat(v) for p, v in a["products"].items()}
        rows[str(d)] = summarise(a["errors"], a["values"], a["exact"], products)
    return {"drifts": rows, "batches": measured, "answers_per_batch": run.cfg.batch_size}


def plot(numbers: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = numbers["drifts"]
    kl = [rows[d]["exact_reverse_kl"] for d in rows]
    names = list(next(iter(rows.values()))["estimators"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for n in names:
        est = [rows[d]["estimators"][n] for d in rows]
        axes[0].errorbar(kl, [e["bias"] for e in est], yerr=[2 * e["bias_se"] for e in est],
                         marker="o", capsize=3, label=n)
        axes[1].plot(kl, [e["sd_per_token"] for e in est], marker="o", label=n)
        line = axes[2].errorbar(kl, [e["coef_reverse"] for e in est],
                                yerr=[2 * e["coef_reverse_se"] for e in est], marker="o",
                                capsize=3, label=f"{n}: a (reverse)")
        axes[2].errorbar(kl, [e["coef_forward"] for e in est], yerr=[2 * e["coef_forward_se"] for e in est],
                         marker="x", ls="--", capsize=3, color=line[0].get_color(),
                         label=f"{n}: b (forward)")
    axes[0].axhline(0, color="k", lw=0.5)
    axes[0].set_title("bias of the value (mean - exact KL(pi||ref)), 2 SE bars")
    axes[1].set_title("spread of the value per token (sd)")
    axes[1].set_yscale("log")
    axes[2].set_title("g_k ~ a grad KL(pi||ref) + b grad KL(ref||pi), 2 SE")
    axes[2].set_ylim(-0.5, 1.5)
    for ax in axes:
        ax.set_xscale("log"); ax.set_xlabel("exact KL(pi || pi_ref), nats per token"); ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
