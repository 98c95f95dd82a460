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
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.sampling.batch import ScoredBatch
from posttrain.config.commands import TrainConfig
from posttrain.rl.critic import Critic
from posttrain.model.distributed import World, global_aggregation_weights, global_max
from posttrain.rollout.base import seed_key
from posttrain.rollout.forward import group_chunks, micro_rows, sequence_logprobs
from posttrain.losses.aggregation import AGGREGATIONS
from posttrain.rl.learner import PolicyLearner
from posttrain.rl.token_records import TokenTrace
from posttrain.rl.loss_terms import (Metrics, MicroBatch, UpdateTerms, policy_terms, update_terms,
                                     value_terms)

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

def optimizer_step(learner: PolicyLearner, any_rows: bool, metrics: Metrics) -> bool:
    """Average the gradients over ranks, clip them to max_grad_norm, step Adam and the schedule
    (skipped on a non-finite gradient: run/learner.py). Returns whether it stepped."""
    if not any_rows:   # keep the optimizer step (Adam momentum, decay) as it would be
        for p in learner.model.parameters():
            # (FSDP: a padding pass already holds the other ranks' reduced shards)
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    norm, stepped = learner.optimizer_step()
    if stepped:
        metrics.update("policy/grad_norm", norm)
    return stepped


def micro_batch_loss(learner: PolicyLearner, batch: ScoredBatch, micro: MicroBatch,
                     terms: UpdateTerms, *, train_policy: bool = True) -> Tensor:
    """One micro-batch's loss: the policy's terms on its forward (one pass, which also gives a
    shared value head its hidden states) and, PPO, the value model's terms. Without
    `train_policy` (the critic's warm-up) the policy forward runs only for a shared head."""
    cfg, critic = learner.cfg, learner.critic
    loss, hidden, fwd = torch.zeros(()), None, None
    shared_head = critic is not None and critic.shared
    if train_policy or shared_head:
        fwd = sequence_logprobs(
            learner.model, batch.rollout, micro.rows, cfg.rollout.temperature, with_entropy=True,
            autocast=cfg.model.autocast, keep_logits=terms.distill is not None,
            keep_hidden=shared_head, entropy_grad=terms.entropy_coef > 0)
        hidden = fwd.hidden
    if train_policy:
        loss = policy_terms(batch, micro, fwd, terms, cfg, learner.teachers)
    if critic is not None:
        loss = loss + value_terms(critic, batch, micro, hidden, cfg)
    return loss


@dataclass
class UpdateCounts:
    """What an update went through: rows seen (all passes, and the first minibatch's), rows
    skipped for having no signal, minibatch updates and optimizer steps taken."""
    rows: int = 0
    first: int = 0
    skipped: int = 0
    updates: int = 0
    steps: int = 0


def update_policy(learner: PolicyLearner, batch: ScoredBatch, *, train_policy: bool = True,
                  tokens: TokenTrace | None = None) -> dict[str, float]:
    """Epochs x minibatches of clipped updates on `batch` and its advantages (`batch.adv_B_T`);
    the critic (PPO) learns on the same minibatches from `batch.returns_B_T`. With
    train_policy=False (critic warm-up) only the critic is updated. Returns the metrics, read
    from the device once; `tokens` receives the per-token values of its rows (token_records)."""
    cfg, critic, world = learner.cfg, learner.critic, learner.world
    check_update_inputs(batch, critic)
    G = batch.rollout.group_size
    terms = update_terms(batch, cfg, learner.algo, learner.teachers,
                         draw_seed(cfg.seed, learner.scheduler, world))
    signal = rows_with_signal(batch.adv_B_T, G, terms, critic, world)
    metrics, n = Metrics(tokens), UpdateCounts()
    learner.model.train()
    if critic is not None:
        critic.train()
    for rows_mb in minibatch_rows(len(batch.rewards_B) // G, G, cfg, learner.generator, world):
        weights, value_weights, kept, micros = minibatch_plan(learner, batch, rows_mb, signal)
        n.skipped += len(rows_mb) - len(kept)
        for idx in micros:
            padding = idx is None   # the same collectives, no gradient and no metrics
            micro = (padding_micro(batch) if padding else
                     MicroBatch(rows_mb[kept[idx]], weights[kept[idx]],
                                None if critic is None else value_weights[kept[idx]], metrics,
                                first_update=n.updates == 0))
            loss = micro_batch_loss(learner, batch, micro, terms, train_policy=train_policy)
            (loss * 0.0 if padding else loss).backward()
            n.rows += 0 if padding else len(micro.rows)
            n.first += 0 if padding or n.updates else len(micro.rows)
        if train_policy:
            n.steps += optimizer_step(learner, len(kept) > 0, metrics)
        learner.optimizer.zero_grad(set_to_none=True)   # warm-up: a shared body's value grads dropped
        if critic is not None:
            metrics.update("critic/grad_norm", critic.step())
        n.updates += 1
    return finish_metrics(metrics, n, train_policy, learner.scheduler)


def draw_seed(seed: int, scheduler, world: World) -> int:
    """An objective's random draws (Clip-Cov): a function of the seed, the optimizer steps so
    far and the rank."""
    return seed_key(seed, getattr(scheduler, "last_epoch", 0)) * 4096 + world.rank


def padding_micro(batch: ScoredBatch) -> MicroBatch:
    """A zero-weight pass over the first group (FSDP: a rank with fewer micro-batches)."""
    rows = torch.arange(batch.rollout.group_size)
    zeros = torch.zeros_like(batch.loss_mask_B_T[rows])
    return MicroBatch(rows, zeros, zeros, Metrics())


def minibatch_plan(learner: PolicyLearner, batch: ScoredBatch, rows_mb: Tensor, signal: Tensor
                   ) -> tuple[Tensor, Tensor | None, Tensor, list[Tensor | None]]:
    """A minibatch's aggregation weights (over the whole minibatch, so its micro-batches sum to
    its loss; several ranks: normalised over the global minibatch, see
    global_aggregation_weights), the value loss's token-mean weights, the rows with a signal, and
    the micro-batches of whole groups over them."""
    cfg, world = learner.cfg, learner.world
    mask, G = batch.loss_mask_B_T[rows_mb], batch.rollout.group_size
    weights = global_aggregation_weights(AGGREGATIONS[learner.algo.aggregation], mask,
                                         response_budget(cfg, batch), world)
    value_weights = (global_aggregation_weights(AGGREGATIONS["token_mean"], mask, 1.0, world)
                     if learner.critic is not None else None)
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
                         "(rl/advantage.py::compute_advantages) sets it")
    if critic is not None and (batch.old_values_B_T is None or batch.returns_B_T is None):
        raise ValueError("update_policy: a critic needs batch.old_values_B_T and batch.returns_B_T "
                         "(rl/advantage.py::compute_advantages sets them when a value model is configured)")


def finish_metrics(metrics: Metrics, n: UpdateCounts, train_policy: bool,
                   scheduler) -> dict[str, float]:
    """The update's metrics as floats (one transfer), normalised as they are logged: per-row
    means over the rows seen, per-step values over the optimizer steps."""
    row_sums, update_sums, maxima = metrics.read()
    mismatch = row_sums.pop("_mismatch", None)
    out = {k: v / max(n.rows, 1) for k, v in row_sums.items()}
    out.update({k: v / max(n.updates, 1) for k, v in update_sums.items() if not k.startswith("_")})
    for key in [k for k in update_sums if k.startswith("_kl@")]:   # MOPD: per teacher, per token
        d = key[len("_kl@"):]
        out[f"distill/reverse_kl_exact@{d}"] = update_sums[key] / max(update_sums[f"_tokens@{d}"], 1)
    out.update(maxima)
    if mismatch is not None:   # mean |log pi_trainer - log pi_sampler| of the first update's tokens
        out["rollout/logp_mismatch"] = mismatch / max(n.first, 1)
    if train_policy:
        out.setdefault("policy/ratio_max", 0.0)   # (every group skipped: nothing moved)
    out["policy/skipped_rows_frac"] = n.skipped / max(n.skipped + n.rows, 1)
    out["optim/lr"] = scheduler.get_last_lr()[0]
    if train_policy:   # optimizer steps skipped for a non-finite gradient (weights untouched)
        out["optim/steps"], out["optim/nonfinite_steps"] = n.updates, n.updates - n.steps
        out["policy/grad_norm"] = out.get("policy/grad_norm", 0.0) * n.updates / max(n.steps, 1)
    return out
