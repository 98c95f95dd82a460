"""The policy update (docs/algorithms.md §3, §5, §6, §8): one step's batch, epochs x minibatches
of whole groups, each minibatch in micro-batches whose losses sum to the minibatch's loss.

    for each epoch:
        for each minibatch (a random share of the groups):
            weights = AGGREGATIONS[algo.aggregation](mask of the whole minibatch)
            for each micro-batch:                 policy_terms + value_terms, backward
            optimizer_step                         average over ranks, clip, Adam, lr schedule

What each micro-batch's loss is (the terms, chosen once per update) is rl/loss_terms.py's. Metrics
stay on the device as tensors (`Metrics`) and reach the host in one transfer at the end of the
update, so a GPU step is not stalled by a sync per micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import Tensor

from posttrain.rl.batch import ScoredBatch
from posttrain.config.commands import TrainConfig
from posttrain.config.presets import AlgorithmConfig
from posttrain.rl.critic import Critic
from posttrain.model.distributed import (SINGLE, World, average_gradients, clip_grad_norm,
                                   global_aggregation_weights, global_max)
from posttrain.util.errors import NonFiniteError
from posttrain.rollout.forward import group_chunks, micro_rows, sequence_logprobs
from posttrain.losses.aggregation import AGGREGATIONS
from posttrain.rl.teachers import Teachers
from posttrain.rl.token_records import TokenTrace
from posttrain.rl.loss_terms import Metrics, UpdateTerms, policy_terms, update_terms, value_terms

log = logging.getLogger("posttrain")


# ---------------------------------------------------------------------------------------------
# Which rows, in which minibatches
# ---------------------------------------------------------------------------------------------

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


def micro_batch_loss(model, batch: ScoredBatch, rows: Tensor, terms, cfg: TrainConfig,
                     teachers: Teachers | None, critic: Critic | None, policy_forward: bool,
                     train_policy: bool, weights: Tensor, value_weights: Tensor, into,
                     first_update: bool) -> Tensor:
    """One micro-batch's loss: the policy's terms on its forward (one pass, which also gives a
    shared value head its hidden states) and, PPO, the value model's terms."""
    loss, hidden, fwd = torch.zeros(()), None, None
    if policy_forward:
        fwd = sequence_logprobs(
            model, batch.rollout, rows, cfg.rollout.temperature, with_entropy=True,
            autocast=cfg.model.autocast, keep_logits=terms.distill is not None,
            keep_hidden=critic is not None and critic.shared, entropy_grad=terms.entropy_coef > 0)
        hidden = fwd.hidden
    if train_policy:
        loss = policy_terms(batch, rows, fwd, weights, terms, cfg, teachers, into,
                            first_update=first_update)
    if critic is not None:
        loss = loss + value_terms(critic, batch, rows, hidden, value_weights, cfg, into)
    return loss


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
            zeros = torch.zeros_like(mask[rows])
            loss = micro_batch_loss(
                model, batch, rows, terms, cfg, teachers, critic, policy_forward, train_policy,
                zeros if padding else weights[kept[micro]],
                zeros if padding or critic is None else value_weights[kept[micro]],
                Metrics() if padding else metrics, first_update=n_updates == 0)
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
    micros: list[Tensor | None] = list(group_chunks(len(kept), G, micro_rows(cfg.optim, batch.rollout)))
    if world.strategy == "fsdp" and world.distributed and len(batch.rewards_B) // G:
        # ranks may hold different shares of a minibatch, but FSDP's forward and backward
        # are collectives: pad with zero-weight passes over this rank's first group
        micros += [None] * (int(global_max(len(micros), world)) - len(micros))
    return weights, value_weights, kept, micros


def check_update_inputs(batch: ScoredBatch, critic: Critic | None) -> None:
    """The stages before the update filled what it reads."""
    if batch.adv_B_T is None:
        raise ValueError("update_policy: batch.adv_B_T is None; the advantages stage "
                         "(rl/loop.py::compute_advantages) sets it")
    if critic is not None and (batch.old_values_B_T is None or batch.returns_B_T is None):
        raise ValueError("update_policy: a critic needs batch.old_values_B_T and batch.returns_B_T "
                         "(rl/loop.py::compute_advantages sets them when a value model is configured)")


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
