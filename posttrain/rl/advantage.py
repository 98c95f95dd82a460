"""Step 3 of the lecture's loop: the advantage of every response token (docs/algorithms.md §2,
§5, §7, §8) by the preset's estimator (ADVANTAGES): group baselines, RLOO, GAE on PPO's value
model with the KL folded into dense rewards, a teacher's log-probs; whitened on request."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from posttrain.config.presets import AlgorithmConfig
from posttrain.losses.advantages import ADVANTAGES, AdvantageInputs, AdvantageParams, whiten
from posttrain.losses.distill import DISTILL_LOSSES
from posttrain.losses.kl import KL_ESTIMATORS, kl_penalized_rewards
from posttrain.model.distributed import global_sum
from posttrain.rollout.forward import micro_rows
from posttrain.sampling.batch import ScoredBatch
from posttrain.rl.learner import PolicyLearner
from posttrain.sampling.metrics import read_floats
from posttrain.rl.step_metrics import critic_metrics


def compute_advantages(learner: PolicyLearner, batch: ScoredBatch) -> tuple[ScoredBatch, dict[str, float]]:
    """A_t for every response token by the preset's estimator (ADVANTAGES); PPO also gets the
    value model's V_old and the returns it regresses on. Returns the batch carrying them
    (`adv_B_T`, `old_values_B_T`, `returns_B_T`) and the stage's metrics (the critic's)."""
    cfg, algo, critic = learner.cfg, learner.algo, learner.critic
    token_rewards = old_values = None
    metrics: dict[str, float] = {}
    if critic is not None:
        old_values = critic.predict(batch.rollout, micro_rows(cfg.optim, batch.rollout),
                                    cfg.model.autocast, learner.model, cfg.rollout.temperature)
        token_rewards = ppo_token_rewards(batch, algo)
    adv_out = ADVANTAGES[algo.advantage](
        AdvantageInputs(batch.rewards_P_G, batch.loss_mask_B_T, token_rewards_B_T=token_rewards,
                        values_B_T=old_values, old_logp_B_T=batch.old_logp_B_T,
                        teacher_logp_B_T=batch.teacher_logp_B_T,
                        scored_P_G=batch.scored_P_G),
        AdvantageParams(algo.eps, algo.scale_by_std, algo.gamma, algo.lam, algo.reward_weight,
                        not DISTILL_LOSSES[algo.distill_loss].in_advantage))
    batch = replace(batch, adv_B_T=adv_out.adv_B_T, old_values_B_T=old_values,
                    returns_B_T=adv_out.returns_B_T if critic is not None else None,
                    token_rewards_B_T=token_rewards)
    if critic is not None:   # (before whitening: the advantage as GAE computed it)
        metrics.update(read_floats(critic_metrics(batch, token_rewards)))
    if algo.whiten_advantages:
        batch = replace(batch, adv_B_T=whiten(batch.adv_B_T, batch.loss_mask_B_T,
                                              total=lambda t: global_sum(t, learner.world)))
    return batch, metrics


def ppo_token_rewards(batch: ScoredBatch, algo: AlgorithmConfig) -> Tensor:
    """Dense rewards for GAE (§5): -beta * kl_t on every token, the score added on the last one.
    The KL is that of the sampled tokens, log pi_old - log pi_ref with the default k1 estimator."""
    mask = batch.loss_mask_B_T
    if algo.kl_in == "reward" and batch.ref_logp_B_T is not None:
        kl = KL_ESTIMATORS[algo.kl_estimator](batch.old_logp_B_T, batch.ref_logp_B_T)
        return kl_penalized_rewards(batch.rewards_B, kl, mask, algo.kl_coef)
    return kl_penalized_rewards(batch.rewards_B, torch.zeros_like(mask), mask, 0.0)
