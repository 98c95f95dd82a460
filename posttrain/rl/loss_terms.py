"""What one update computes (docs/algorithms.md §3, §5, §6, §8): the loss terms of a step's
update, chosen once per update in `UpdateTerms` from registries, and each micro-batch's share of
the loss, summed per token: the policy objective (POLICY_LOSSES: one `PolicyInputs` in, a
per-token loss and its own metrics out), the off-policy correction (OFF_POLICY_CORRECTIONS), an
exact distillation loss, the KL to the reference (KL_ESTIMATORS), the entropy bonus, and the
critic's value loss. Their metrics stay on the device as tensors (`Metrics`), read in one
transfer at the end of the update (rl/update.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.sampling.batch import ScoredBatch
from posttrain.config.commands import TrainConfig
from posttrain.config.presets import AlgorithmConfig
from posttrain.rl.critic import Critic
from posttrain.rollout.forward import PolicyForward
from posttrain.losses.aggregation import aggregate
from posttrain.losses.common import masked_mean
from posttrain.losses.correction import OFF_POLICY_CORRECTIONS, CorrectionFn, ratio_stats
from posttrain.losses.distill import DISTILL_LOSSES, DistillLoss
from posttrain.losses.kl import KL_ESTIMATORS, entropy_bonus_loss, kl_penalty_in_loss
from posttrain.losses.policy import POLICY_LOSSES, ObjectiveParams, PolicyInputs, PolicyObjective
from posttrain.losses.value import value_loss
from posttrain.rl.teachers import Teachers
from posttrain.rl.token_records import TokenTrace


# ---------------------------------------------------------------------------------------------
# Metrics on the device
# ---------------------------------------------------------------------------------------------

class Metrics:
    """Metric tensors summed where they were computed, read with one host transfer.

    `rows(name, mean, n)` adds a per-row mean weighted by its n rows (logged divided by all rows),
    `update(name, x)` one value per optimizer step (logged averaged over steps), `max` a maximum.
    Sums are float64 (float32 on MPS), the precision the Python floats they replace had."""

    def __init__(self, tokens: TokenTrace | None = None) -> None:
        self.row_sums: dict[str, Tensor] = {}
        self.update_sums: dict[str, Tensor] = {}
        self.maxima: dict[str, Tensor] = {}
        self.tokens = tokens   # per-token values of a few rows (token_records), or None

    def per_token(self, rows: Tensor, **values: Tensor | None) -> None:
        """Per-token values of the micro-batch's traced rows (their last pass is kept)."""
        if self.tokens is not None:
            self.tokens.record(rows, **values)

    @staticmethod
    def widen(x: Tensor) -> Tensor:
        x = x.detach()
        return x.float() if x.device.type == "mps" else x.double()

    def rows(self, name: str, mean: Tensor, n: int) -> None:
        v = self.widen(mean) * n
        self.row_sums[name] = self.row_sums[name] + v if name in self.row_sums else v

    def update(self, name: str, x: Tensor) -> None:
        v = self.widen(x)
        self.update_sums[name] = self.update_sums[name] + v if name in self.update_sums else v

    def max(self, name: str, x: Tensor) -> None:
        v = self.widen(x)
        self.maxima[name] = torch.maximum(self.maxima[name], v) if name in self.maxima else v

    def read(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """(row sums, update sums, maxima) as floats: the update's one device-to-host transfer."""
        groups = (self.row_sums, self.update_sums, self.maxima)
        tensors = [v for g in groups for v in g.values()]
        if not tensors:
            return {}, {}, {}
        device = tensors[0].device
        values = iter(torch.stack([v.to(device) for v in tensors]).tolist())
        return tuple({k: next(values) for k in g} for g in groups)


# ---------------------------------------------------------------------------------------------
# What one update computes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UpdateTerms:
    """The loss terms of one step's update, chosen once from the registries."""
    objective: PolicyObjective                # POLICY_LOSSES[algo.policy_loss]
    params: ObjectiveParams                   # its hyper-parameters
    old_logp_B_T: Tensor                      # the trainer's pi_old
    single_update: bool                       # one epoch, one minibatch: pi_old = pi_theta exactly
    correction: CorrectionFn | None           # another engine sampled: OFF_POLICY_CORRECTIONS (§3)
    tis_cap: float                            # the correction's cap (token_tis, seq_tis)
    is_band: tuple[float, float]              # the ratios it keeps (token_mis, seq_mis, icepop)
    kl_fn: Callable[[Tensor, Tensor], Tensor] | None   # KL_ESTIMATORS[...] when a reference ran
    kl_in_loss: bool
    kl_coef: float
    entropy_coef: float                       # > 0: an entropy bonus in the loss
    distill: DistillLoss | None               # an exact (full-vocabulary) teacher loss, per token
    domains: list[str]
    group_size: int
    generator: torch.Generator                # for objectives that draw (Clip-Cov): the update's own


def frozen_inputs(cfg: TrainConfig, algo: AlgorithmConfig, has_teachers: bool) -> frozenset[str]:
    """The frozen passes (no gradient; trainer.frozen_passes) that the step's terms read, so
    none runs that no term uses (§3, §5, §6, §8):

    - "ref_logp": the KL term (KL_ESTIMATORS), in the loss or folded into PPO's rewards;
    - "teacher_logp": distillation through the advantage (DISTILL_LOSSES[...].in_advantage);
    - "trainer_old_logp": the trainer's own pi_old, when the sampler's numbers are not the
      trainer's (another engine or precision) and a term reads pi_old: the objective's ratio
      and the off-policy correction over several updates (an objective whose declared `reads`
      lack pi_old is refused several updates by the config, so here every objective reads it),
      a teacher's advantage (the advantage stage may read pi_old with any distillation loss), or
      the KL folded into the rewards. A single update takes pi_old = pi_theta from its own
      forward."""
    kl = algo.kl_in != "none" and algo.kl_coef > 0
    needs = {"ref_logp"} if kl else set()
    if has_teachers and DISTILL_LOSSES[algo.distill_loss].in_advantage:
        needs.add("teacher_logp")
    other_numbers = cfg.rollout.off_trainer or cfg.model.autocast != cfg.rollout.autocast
    if other_numbers and (not cfg.optim.single_update or has_teachers
                          or (kl and algo.kl_in == "reward")):
        needs.add("trainer_old_logp")
    return frozenset(needs)


def update_terms(batch: ScoredBatch, cfg: TrainConfig, algo: AlgorithmConfig,
                 teachers: Teachers | None, draw_seed: int = 0) -> UpdateTerms:
    o = cfg.optim
    # With a single update the policy cannot have moved since sampling: pi_old = pi_theta exactly,
    # the ratio is 1 and the recorded log-probs are not needed (§3).
    single_update = o.single_update
    # The sampler was not the trainer's float32 policy (vLLM, the bf16 copy or autocast, a top-p
    # nucleus): its log-probs are not the trainer's. The ratio is taken against the trainer's own
    # pi_old, and each token's policy-gradient term is weighted by rollout.correction of
    # pi_trainer / pi_engine (§3, losses.correction.OFF_POLICY_CORRECTIONS).
    foreign = cfg.rollout.off_trainer
    other_numbers = foreign or cfg.model.autocast != cfg.rollout.autocast
    if other_numbers and not single_update and batch.trainer_old_logp_B_T is None:
        raise ValueError("several updates on samples whose log-probs are not the trainer's need "
                         "the trainer's own pi_old (batch.trainer_old_logp_B_T; "
                         "trainer.frozen_passes computes it)")
    kl_fn = KL_ESTIMATORS[algo.kl_estimator] if batch.ref_logp_B_T is not None else None
    distill = DISTILL_LOSSES[algo.distill_loss] if teachers is not None else None
    # tis_cap None: no correction (the mismatch is still logged)
    # (an objective that weights by pi / mu itself, DPPO, takes no second correction)
    corrects = POLICY_LOSSES.meta(algo.policy_loss).get("corrects", False)
    correct = foreign and cfg.rollout.tis_cap is not None and not corrects
    return UpdateTerms(
        objective=POLICY_LOSSES[algo.policy_loss], params=algo.objective_params(),
        old_logp_B_T=batch.old_logp_B_T, single_update=single_update,
        correction=OFF_POLICY_CORRECTIONS[cfg.rollout.correction] if correct else None,
        tis_cap=cfg.rollout.tis_cap or 1.0, is_band=tuple(cfg.rollout.is_band),
        kl_fn=kl_fn, kl_in_loss=kl_fn is not None and algo.kl_in == "loss", kl_coef=algo.kl_coef,
        entropy_coef=algo.entropy_coef,
        distill=distill if distill is not None and distill.token_loss is not None else None,
        domains=[p.domain for p in batch.problems], group_size=batch.rollout.group_size,
        # (never the run's generator: its minibatch draws must stay the same on every rank)
        generator=torch.Generator().manual_seed(draw_seed))


# ---------------------------------------------------------------------------------------------
# One micro-batch
# ---------------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """One micro-batch of an update: its rows, their aggregation weights (the policy's; the value
    loss's, PPO), where its metrics go, and whether it is in the update's first minibatch."""
    rows: Tensor
    weights: Tensor
    value_weights: Tensor | None
    metrics: Metrics
    first_update: bool = False


def policy_terms(batch: ScoredBatch, micro: MicroBatch, fwd: PolicyForward, terms: UpdateTerms,
                 cfg: TrainConfig, teachers: Teachers | None) -> Tensor:
    """The policy's share of one micro-batch's loss (§5-§8, §11): the sum of its per-token terms,
    aggregated by the micro-batch's weights; each term's metrics added to its `metrics`."""
    rows, metrics = micro.rows, micro.metrics
    m, n = batch.loss_mask_B_T[rows], len(rows)
    old = fwd.logp.detach() if terms.single_update else terms.old_logp_B_T[rows]
    x = PolicyInputs(fwd.logp, old, batch.adv_B_T[rows], m, terms.group_size, terms.generator,
                     behaviour_logp_B_T=batch.rollout.logp_B_T[rows])
    term = terms.objective(x, terms.params)
    for name, value in term.metrics.items():
        metrics.rows(name, value, n)
    if metrics.tokens is not None:
        metrics.per_token(rows, logp=fwd.logp, logp_old=old, ratio=torch.exp(fwd.logp.detach() - old),
                          clip=term.clipped_B_T, entropy=fwd.entropy)
    loss_t = term.loss_B_T
    if terms.correction is not None:
        loss_t = loss_t * correction_weights(batch, rows, old, terms, metrics)
    if terms.distill is not None:   # §8: the full-vocabulary reverse KL is itself the loss
        loss_t = loss_t + distill_term(batch, micro, fwd.logits, terms, cfg, teachers)
    if terms.kl_fn is not None:
        kl_t = terms.kl_fn(fwd.logp, batch.ref_logp_B_T[rows])
        if terms.kl_in_loss:
            loss_t = kl_penalty_in_loss(loss_t, kl_t, terms.kl_coef)
        metrics.rows("policy/kl_ref", masked_mean(kl_t.detach(), m), n)
        metrics.per_token(rows, kl_ref=kl_t)
    if terms.entropy_coef > 0:
        loss_t = loss_t + entropy_bonus_loss(fwd.entropy, terms.entropy_coef)
    loss = aggregate(loss_t, micro.weights)
    metrics.update("loss/policy", loss)
    drift_metrics(batch, micro, fwd, old)
    return loss


def correction_weights(batch: ScoredBatch, rows: Tensor, old: Tensor, terms: UpdateTerms,
                       metrics: Metrics) -> Tensor:
    """Per-token weights correcting for another engine's samples (§3), with their metrics."""
    m, n = batch.loss_mask_B_T[rows], len(rows)
    w = terms.correction(old, batch.rollout.logp_B_T[rows], m, terms.tis_cap, terms.is_band)
    metrics.rows("rollout/tis_weight_mean", masked_mean(w, m), n)
    metrics.rows("rollout/tis_capped_frac", masked_mean((w >= terms.tis_cap).float(), m), n)
    metrics.rows("rollout/is_masked_frac", masked_mean((w == 0).float(), m), n)
    metrics.per_token(rows, is_weight=w)
    return w


def distill_term(batch: ScoredBatch, micro: MicroBatch, logits: Tensor, terms: UpdateTerms,
                 cfg: TrainConfig, teachers: Teachers) -> Tensor:
    """The exact (full-vocabulary) distillation loss per token (§8), its KL per teacher domain."""
    rows, metrics = micro.rows, micro.metrics
    m, n = batch.loss_mask_B_T[rows], len(rows)
    temperature = cfg.rollout.temperature
    with torch.no_grad():
        t_logits = teachers.response_logits(batch.teacher_view or batch.rollout, rows, terms.domains,
                                            cfg.model.autocast)
        if cfg.teacher.temperature:   # a sharpened (or flattened) teacher
            t_logits = t_logits * (temperature / cfg.teacher.temperature)
    distill_t, kl_exact = terms.distill.token_loss(logits, t_logits, temperature)
    metrics.rows("distill/reverse_kl_exact", masked_mean(kl_exact, m), n)
    metrics.per_token(rows, kl_teacher_exact=kl_exact)
    row_domains = [terms.domains[int(r)] for r in rows]
    for d in set(row_domains) if len(set(terms.domains)) > 1 else ():
        k = torch.tensor([rd == d for rd in row_domains])
        metrics.update(f"_kl@{d}", (kl_exact[k] * m[k]).sum())
        metrics.update(f"_tokens@{d}", m[k].sum())
    return distill_t


def drift_metrics(batch: ScoredBatch, micro: MicroBatch, fwd: PolicyForward, old: Tensor) -> None:
    """Whatever the objective: the drift from pi_old, the entropy, and (first update) the
    sampler's numerics against the trainer's."""
    rows, metrics = micro.rows, micro.metrics
    m, n = batch.loss_mask_B_T[rows], len(rows)
    if micro.first_update:   # the policy has not moved yet: sampler vs trainer numerics only
        diff = fwd.logp.detach() - batch.rollout.logp_B_T[rows]
        metrics.rows("_mismatch", masked_mean(diff.abs(), m), n)
        big = torch.where(m > 0, diff, torch.full_like(diff, -1e9)).max()
        metrics.max("rollout/is_ratio_max", metrics.widen(big).clamp(max=50.0).exp())
    st = ratio_stats(fwd.logp, old, m)
    for name in ("approx_kl_old", "ratio_mean"):
        metrics.rows(f"policy/{name}", getattr(st, name), n)
    metrics.max("policy/ratio_max", st.ratio_max)
    metrics.rows("policy/entropy", masked_mean(fwd.entropy.detach(), m), n)


def value_terms(critic: Critic, batch: ScoredBatch, micro: MicroBatch, hidden: Tensor | None,
                cfg: TrainConfig) -> Tensor:
    """The critic's share of one micro-batch's loss (§5): V regressed on the GAE returns,
    clipped around V_old, times vf_coef."""
    rows, metrics = micro.rows, micro.metrics
    m = batch.loss_mask_B_T[rows]
    values = critic.values(batch.rollout, rows, cfg.model.autocast, hidden if critic.shared else None)
    v_loss_t, v_clipped = value_loss(values, batch.old_values_B_T[rows], batch.returns_B_T[rows],
                                     cfg.critic.clip)
    v_loss = aggregate(v_loss_t, micro.value_weights)
    metrics.update("loss/value", v_loss)
    metrics.rows("critic/clip_frac", masked_mean(v_clipped.float(), m), len(rows))
    return cfg.critic.vf_coef * v_loss
