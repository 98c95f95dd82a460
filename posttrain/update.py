"""The policy update (docs/algorithms.md §3, §5, §6, §8): one step's batch, epochs x minibatches
of whole groups, each minibatch in micro-batches whose losses sum to the minibatch's loss.

    for each epoch:
        for each minibatch (a random share of the groups):
            weights = AGGREGATIONS[algo.aggregation](mask of the whole minibatch)
            for each micro-batch:                 policy_terms + value_terms, backward
            optimizer_step                         average over ranks, clip, Adam, lr schedule

The terms a step uses are chosen once per update in `UpdateTerms`, from registries, and summed
per token: the policy objective (POLICY_LOSSES: one `PolicyInputs` in, a per-token loss and its
own metrics out), the off-policy correction (OFF_POLICY_CORRECTIONS), an exact distillation loss,
the KL to the reference (KL_ESTIMATORS), the entropy bonus, and the critic's value loss. Metrics stay on the device as tensors (`Metrics`) and reach the host in one transfer
at the end of the update, so a GPU step is not stalled by a sync per micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.batch import ScoredBatch
from posttrain.config import TrainConfig
from posttrain.presets import AlgorithmConfig
from posttrain.critic import Critic
from posttrain.distributed import (SINGLE, World, average_gradients, clip_grad_norm,
                                   global_aggregation_weights, global_max)
from posttrain.errors import NonFiniteError
from posttrain.forward import PolicyForward, group_chunks, sequence_logprobs
from posttrain.losses import (AGGREGATIONS, DISTILL_LOSSES, KL_ESTIMATORS, OFF_POLICY_CORRECTIONS,
                              POLICY_LOSSES, CorrectionFn, DistillLoss, ObjectiveParams,
                              PolicyInputs, PolicyObjective, aggregate, entropy_bonus_loss,
                              kl_penalty_in_loss, masked_mean, ratio_stats, value_loss)
from posttrain.teachers import Teachers
from posttrain.token_records import TokenTrace

log = logging.getLogger("posttrain")


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
    # pi_trainer / pi_engine (§3, losses.OFF_POLICY_CORRECTIONS).
    foreign = cfg.rollout.off_trainer
    other_numbers = foreign or cfg.model.autocast != cfg.rollout.autocast
    if other_numbers and not single_update and batch.trainer_old_logp_B_T is None:
        raise ValueError("several updates on samples whose log-probs are not the trainer's need "
                         "the trainer's own pi_old (batch.trainer_old_logp_B_T; "
                         "trainer.frozen_passes computes it)")
    kl_fn = KL_ESTIMATORS[algo.kl_estimator] if batch.ref_logp_B_T is not None else None
    distill = DISTILL_LOSSES[algo.distill_loss] if teachers is not None else None
    # tis_cap None: no correction (the mismatch is still logged)
    correct = foreign and cfg.rollout.tis_cap is not None
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


def response_budget(cfg: TrainConfig, batch: ScoredBatch) -> float:
    """The most tokens the policy can write in one response: Dr. GRPO's constant normaliser
    L_max (§7). A single turn: max_new_tokens. An episode: its policy tokens over all turns,
    bounded by the turns and by the episode's token budget (environment tokens included)."""
    if batch.rollout.policy_mask_B_T is None:
        return float(cfg.rollout.max_new_tokens)
    return float(min(cfg.env.max_turns * cfg.rollout.max_new_tokens, cfg.env.max_tokens))


def rows_with_signal(adv_B_T: Tensor, group_size: int, terms: UpdateTerms, critic: Critic | None,
                     world: World) -> Tensor:
    """(B,) bool on the host: rows whose forward and backward can change the update.

    A group whose advantages are all 0 (all-equal rewards under a group baseline) adds exactly
    nothing to the loss or its gradient unless a KL, exact-distillation or value term is in the
    loss, so its passes are skipped. The aggregation weights are still computed over the whole
    minibatch, so the update is the same as with those groups in, only cheaper: late in a GRPO
    run most groups are all-correct. (FSDP2: every rank runs the same forwards, whose layers
    gather weights collectively, so nothing is skipped.)"""
    B = adv_B_T.shape[0]
    if (terms.kl_in_loss or terms.distill is not None or terms.entropy_coef > 0 or critic is not None
            or world.strategy == "fsdp"):
        return torch.ones(B, dtype=torch.bool)
    return (adv_B_T.abs().sum(-1).reshape(-1, group_size) > 0).any(-1).repeat_interleave(group_size).cpu()


def minibatch_rows(n_groups: int, group_size: int, cfg: TrainConfig, generator: torch.Generator,
                   world: World) -> Iterator[Tensor]:
    """Row indices of each minibatch, epoch after epoch, drawn as whole groups over the *global*
    batch (rank r holds the n_groups groups numbered r * n_groups onwards), so N ranks split it
    exactly as one process would."""
    offset, n_global = world.rank * n_groups, n_groups * world.size
    for _ in range(cfg.optim.epochs):
        for mb_global in torch.randperm(n_global, generator=generator).chunk(cfg.optim.minibatches):
            mb = mb_global[(mb_global >= offset) & (mb_global < offset + n_groups)] - offset
            yield (mb[:, None] * group_size + torch.arange(group_size)).reshape(-1)


# ---------------------------------------------------------------------------------------------
# One micro-batch
# ---------------------------------------------------------------------------------------------

def policy_terms(batch: ScoredBatch, rows: Tensor, fwd: PolicyForward, w_micro: Tensor,
                 terms: UpdateTerms, cfg: TrainConfig, teachers: Teachers | None,
                 metrics: Metrics, first_update: bool) -> Tensor:
    """The policy's share of one micro-batch's loss (§5-§8, §11): the sum of its per-token terms,
    aggregated; each term's metrics added to `metrics`."""
    m, n = batch.loss_mask_B_T[rows], len(rows)
    old = fwd.logp.detach() if terms.single_update else terms.old_logp_B_T[rows]
    x = PolicyInputs(fwd.logp, old, batch.adv_B_T[rows], m, terms.group_size, terms.generator)
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
        loss_t = loss_t + distill_term(batch, rows, fwd.logits, terms, cfg, teachers, metrics)
    if terms.kl_fn is not None:
        kl_t = terms.kl_fn(fwd.logp, batch.ref_logp_B_T[rows])
        if terms.kl_in_loss:
            loss_t = kl_penalty_in_loss(loss_t, kl_t, terms.kl_coef)
        metrics.rows("policy/kl_ref", masked_mean(kl_t.detach(), m), n)
        metrics.per_token(rows, kl_ref=kl_t)
    if terms.entropy_coef > 0:
        loss_t = loss_t + entropy_bonus_loss(fwd.entropy, terms.entropy_coef)
    loss = aggregate(loss_t, w_micro)
    metrics.update("loss/policy", loss)
    drift_metrics(batch, rows, fwd, old, metrics, first_update)
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


def distill_term(batch: ScoredBatch, rows: Tensor, logits: Tensor, terms: UpdateTerms,
                 cfg: TrainConfig, teachers: Teachers, metrics: Metrics) -> Tensor:
    """The exact (full-vocabulary) distillation loss per token (§8), its KL per teacher domain."""
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


def drift_metrics(batch: ScoredBatch, rows: Tensor, fwd: PolicyForward, old: Tensor, metrics: Metrics,
                  first_update: bool) -> None:
    """Whatever the objective: the drift from pi_old, the entropy, and (first update) the
    sampler's numerics against the trainer's."""
    m, n = batch.loss_mask_B_T[rows], len(rows)
    if first_update:   # the policy has not moved yet: sampler vs trainer numerics only
        diff = fwd.logp.detach() - batch.rollout.logp_B_T[rows]
        metrics.rows("_mismatch", masked_mean(diff.abs(), m), n)
        big = torch.where(m > 0, diff, torch.full_like(diff, -1e9)).max()
        metrics.max("rollout/is_ratio_max", metrics.widen(big).clamp(max=50.0).exp())
    st = ratio_stats(fwd.logp, old, m)
    for name in ("approx_kl_old", "ratio_mean"):
        metrics.rows(f"policy/{name}", getattr(st, name), n)
    metrics.max("policy/ratio_max", st.ratio_max)
    metrics.rows("policy/entropy", masked_mean(fwd.entropy.detach(), m), n)


def value_terms(critic: Critic, batch: ScoredBatch, rows: Tensor, hidden: Tensor | None,
                vw_micro: Tensor, cfg: TrainConfig, metrics: Metrics) -> Tensor:
    """The critic's share of one micro-batch's loss (§5): V regressed on the GAE returns,
    clipped around V_old, times vf_coef."""
    m = batch.loss_mask_B_T[rows]
    values = critic.values(batch.rollout, rows, cfg.model.autocast, hidden if critic.shared else None)
    v_loss_t, v_clipped = value_loss(values, batch.old_values_B_T[rows], batch.returns_B_T[rows],
                                     cfg.critic.clip)
    v_loss = aggregate(v_loss_t, vw_micro)
    metrics.update("loss/value", v_loss)
    metrics.rows("critic/clip_frac", masked_mean(v_clipped.float(), m), len(rows))
    return cfg.critic.vf_coef * v_loss


# ---------------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------------

def step_if_finite(params: list[Tensor], optimizer, scheduler, max_grad_norm: float,
                   world: World) -> tuple[Tensor, bool]:
    """Clip the (averaged) gradients to max_grad_norm and step Adam and the schedule, unless the
    gradient norm is not finite (a NaN or Inf loss, an overflow): then the gradients are dropped
    and weights, optimizer state and schedule stay untouched. Returns (norm, stepped). The
    finiteness test is the step's one host sync; the norm is global, so every rank agrees."""
    norm = clip_grad_norm(params, max_grad_norm, world)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        log.warning("non-finite gradient norm (%s): optimizer step skipped", norm.item())
        return norm, False
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return norm, True


def check_nonfinite_streak(streak: int, limit: int) -> None:
    """Stop after `limit` consecutive skipped steps, with what to try (the weights are those of
    the last good step; the latest checkpoint is intact)."""
    if limit and streak >= limit:
        raise NonFiniteError(
            f"{streak} optimizer steps in a row had a non-finite loss or gradient norm and were "
            "skipped; stopping (the latest checkpoint is intact). Try a lower optim.lr, "
            "model.autocast none, or optim.max_grad_norm; optim.max_nonfinite_steps sets the limit")


def optimizer_step(model, optimizer, scheduler, cfg: TrainConfig, any_rows: bool, world: World,
                   metrics: Metrics) -> bool:
    """Average the gradients over ranks, clip them to max_grad_norm, step Adam and the schedule
    (`step_if_finite`: skipped on a non-finite gradient). Returns whether it stepped."""
    if not any_rows:   # keep the optimizer step (Adam momentum, decay) as it would be
        for p in model.parameters():
            # (FSDP: a padding pass already holds the other ranks' reduced shards)
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    average_gradients(list(model.parameters()), world)
    norm, stepped = step_if_finite(list(model.parameters()), optimizer, scheduler,
                                   cfg.optim.max_grad_norm, world)
    if stepped:
        metrics.update("policy/grad_norm", norm)
    return stepped


def update_policy(model, optimizer, scheduler, batch: ScoredBatch, cfg: TrainConfig,
                  algo: AlgorithmConfig, generator: torch.Generator,
                  teachers: Teachers | None = None, critic: Critic | None = None,
                  train_policy: bool = True, world: World = SINGLE,
                  tokens: TokenTrace | None = None) -> dict[str, float]:
    """Epochs x minibatches of clipped updates on `batch` and its advantages (`batch.adv_B_T`);
    the critic (PPO) learns on the same minibatches from `batch.returns_B_T`. With
    train_policy=False (critic warm-up) only the critic is updated. Returns the metrics, read
    from the device once; `tokens` receives the per-token values of its rows (token_records)."""
    check_update_inputs(batch, critic)
    G, mask = batch.rollout.group_size, batch.loss_mask_B_T
    n_groups = len(batch.rewards_B) // G
    # an objective's random draws: a function of the seed, the optimizer steps so far and the rank
    draw_seed = (cfg.seed * 1_000_003 + getattr(scheduler, "last_epoch", 0)) * 4096 + world.rank
    terms = update_terms(batch, cfg, algo, teachers, draw_seed)
    signal = rows_with_signal(batch.adv_B_T, G, terms, critic, world)
    # the policy forward is needed for its loss, or for the hidden states a shared value head reads
    policy_forward = train_policy or (critic is not None and critic.shared)
    metrics, n_rows, n_first, n_skipped, n_updates, n_steps = Metrics(tokens), 0, 0, 0, 0, 0
    model.train()
    if critic is not None:
        critic.train()
    for rows_mb in minibatch_rows(n_groups, G, cfg, generator, world):
        weights, value_weights, kept, micros = minibatch_plan(batch, rows_mb, signal, cfg, algo,
                                                              critic is not None, world)
        n_skipped += len(rows_mb) - len(kept)
        for micro in micros:
            padding = micro is None   # the same collectives, no gradient and no metrics
            rows = torch.arange(G) if padding else rows_mb[kept[micro]]
            into = Metrics() if padding else metrics
            loss, hidden = torch.zeros(()), None
            if policy_forward:
                fwd = sequence_logprobs(
                    model, batch.rollout, rows, cfg.rollout.temperature, with_entropy=True,
                    autocast=cfg.model.autocast, keep_logits=terms.distill is not None,
                    keep_hidden=critic is not None and critic.shared,
                    entropy_grad=terms.entropy_coef > 0)
                hidden = fwd.hidden
            if train_policy:
                w_micro = torch.zeros_like(mask[rows]) if padding else weights[kept[micro]]
                loss = policy_terms(batch, rows, fwd, w_micro, terms, cfg, teachers, into,
                                    first_update=n_updates == 0)
            if critic is not None:
                vw_micro = torch.zeros_like(mask[rows]) if padding else value_weights[kept[micro]]
                loss = loss + value_terms(critic, batch, rows, hidden, vw_micro, cfg, into)
            (loss * 0.0 if padding else loss).backward()
            n_rows += 0 if padding else len(rows)
            n_first += 0 if padding or n_updates else len(rows)
        if train_policy:
            n_steps += optimizer_step(model, optimizer, scheduler, cfg, len(kept) > 0, world, metrics)
        optimizer.zero_grad(set_to_none=True)   # warm-up: a shared body's value grads dropped
        if critic is not None:
            metrics.update("critic/grad_norm", critic.step())
        n_updates += 1
    out = finish_metrics(metrics, n_rows, n_first, n_skipped, n_updates, train_policy, scheduler)
    if train_policy:   # optimizer steps skipped for a non-finite gradient (weights untouched)
        out["optim/steps"], out["optim/nonfinite_steps"] = n_updates, n_updates - n_steps
        out["policy/grad_norm"] = out.get("policy/grad_norm", 0.0) * n_updates / max(n_steps, 1)
    return out


def minibatch_plan(batch: ScoredBatch, rows_mb: Tensor, signal: Tensor, cfg: TrainConfig,
                   algo: AlgorithmConfig, with_critic: bool, world: World
                   ) -> tuple[Tensor, Tensor | None, Tensor, list[Tensor | None]]:
    """A minibatch's aggregation weights (over the whole minibatch, so its micro-batches sum to
    its loss; several ranks: normalised over the global minibatch, see
    global_aggregation_weights), the value loss's token-mean weights, the rows with a signal, and
    the micro-batches of whole groups over them."""
    mask, G = batch.loss_mask_B_T[rows_mb], batch.rollout.group_size
    weights = global_aggregation_weights(AGGREGATIONS[algo.aggregation], mask,
                                         response_budget(cfg, batch), world)
    value_weights = (global_aggregation_weights(AGGREGATIONS["token_mean"], mask, 1.0, world)
                     if with_critic else None)
    kept = signal[rows_mb].nonzero().squeeze(-1)
    micros: list[Tensor | None] = list(group_chunks(len(kept), G, cfg.optim.micro_batch_size))
    if world.strategy == "fsdp" and world.distributed and len(batch.rewards_B) // G:
        # ranks may hold different shares of a minibatch, but FSDP's forward and backward
        # are collectives: pad with zero-weight passes over this rank's first group
        micros += [None] * (int(global_max(len(micros), world)) - len(micros))
    return weights, value_weights, kept, micros


def check_update_inputs(batch: ScoredBatch, critic: Critic | None) -> None:
    """The stages before the update filled what it reads."""
    if batch.adv_B_T is None:
        raise ValueError("update_policy: batch.adv_B_T is None; the advantages stage "
                         "(trainer.compute_advantages) sets it")
    if critic is not None and (batch.old_values_B_T is None or batch.returns_B_T is None):
        raise ValueError("update_policy: a critic needs batch.old_values_B_T and batch.returns_B_T "
                         "(trainer.compute_advantages sets them when a value model is configured)")


def finish_metrics(metrics: Metrics, n_rows: int, n_first: int, n_skipped: int, n_updates: int,
                   train_policy: bool, scheduler) -> dict[str, float]:
    """The update's metrics as floats (one transfer), normalised as they are logged: per-row
    means over the rows seen, per-step values over the optimizer steps."""
    row_sums, update_sums, maxima = metrics.read()
    mismatch = row_sums.pop("_mismatch", None)
    out = {k: v / max(n_rows, 1) for k, v in row_sums.items()}
    out.update({k: v / max(n_updates, 1) for k, v in update_sums.items() if not k.startswith("_")})
    for key in [k for k in update_sums if k.startswith("_kl@")]:   # MOPD: per teacher, per token
        d = key[len("_kl@"):]
        out[f"distill/reverse_kl_exact@{d}"] = update_sums[key] / max(update_sums[f"_tokens@{d}"], 1)
    out.update(maxima)
    if mismatch is not None:   # mean |log pi_trainer - log pi_sampler| of the first update's tokens
        out["rollout/logp_mismatch"] = mismatch / max(n_first, 1)
    if train_policy:
        out.setdefault("policy/ratio_max", 0.0)   # (every group skipped: nothing moved)
    out["policy/skipped_rows_frac"] = n_skipped / max(n_skipped + n_rows, 1)
    out["optim/lr"] = scheduler.get_last_lr()[0]
    return out
