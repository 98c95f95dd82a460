"""Algorithms as presets (docs/algorithms.md §2-§8, §11): `AlgorithmConfig` names the parts of a
step (an advantage, a policy objective, an aggregation, where the KL goes, ...) by their registry
keys, and each preset is a `replace` of a few fields of GRPO's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from posttrain.losses.advantages import ADVANTAGES, NEEDS_GROUP, NEEDS_VALUES
from posttrain.util.checks import check_choice, check_range
from posttrain.util.errors import ConfigError
from posttrain.losses.aggregation import AGGREGATIONS
from posttrain.losses.distill import DISTILL_LOSSES
from posttrain.losses.kl import KL_ESTIMATORS
from posttrain.losses.policy import POLICY_LOSSES, ObjectiveParams


@dataclass(frozen=True)
class AlgorithmConfig:
    """How a scored batch becomes a gradient: the parts of docs/algorithms.md §2-§8 to combine."""

    advantage: str = "group"            # key of advantages.ADVANTAGES
    scale_by_std: bool = True           # GRPO divides by the group std; Dr. GRPO does not (§7)
    eps: float = 1e-6                   # added to the std in the GRPO advantage
    # key of losses.policy.POLICY_LOSSES: clipped (PPO/GRPO/DAPO), vanilla (REINFORCE), and the
    # others of docs/algorithms.md §3 and §11 (an unknown name is refused with the list)
    policy_loss: str = "clipped"
    clip_low: float = 0.2               # ratio may fall to 1 - clip_low (gmpo: log-ratio to -clip_low)
    clip_high: float = 0.2              # ratio may rise to 1 + clip_high (> clip_low: Clip-Higher)
    dual_clip: float | None = None      # bound on the loss of negative-advantage tokens (c > 1)
    sapo_tau_pos: float = 1.0           # sapo: gate temperature for positive advantages
    sapo_tau_neg: float = 1.05          # sapo: gate temperature for negative advantages
    cov_frac: float = 2e-4              # clip_cov / kl_cov: share of tokens picked by covariance
    cov_low: float = 1.0                # clip_cov: covariance band the detached tokens come from
    cov_high: float = 5.0               # clip_cov: upper end of that band
    kl_cov_coef: float = 1.0            # kl_cov: weight of |log pi - log pi_old| on the picked tokens
    dppo_delta_low: float = 0.2         # dppo_tv / dppo_kl: how far a token with A < 0 may fall from mu
    dppo_delta_high: float = 0.2        # dppo_tv / dppo_kl: how far a token with A > 0 may rise from mu
    # dppo_tv / dppo_kl: cap C of each token's weight min(pi / mu, C) (null: none). 10 is the
    # reference implementation's (sail-sg/Stable-RL, verl/trainer/ppo/core_algos.py, the DPPO loss:
    # clip_ratio_c 10.0): a cap near 1 truncates most of the weight of the tokens that moved up and
    # biases the gradient towards the sampler's distribution; the mask bounds the step instead
    dppo_ratio_cap: float | None = 10.0
    entropy_coef: float = 0.0           # entropy bonus: minus coef x the entropy at each token
    aggregation: str = "seq_mean_token_mean"  # key of losses.aggregation.AGGREGATIONS
    kl_in: Literal["loss", "reward", "none"] = "loss"  # where the KL to pi_ref goes (§5 vs §6)
    kl_estimator: str = "k3"            # key of losses.kl.KL_ESTIMATORS
    kl_coef: float = 0.04               # beta; 0 builds no reference model at all
    dynamic_sampling: bool = False      # DAPO: refill the batch instead of training on all-equal groups
    max_refill_rounds: int = 4          # extra generation rounds dynamic sampling may use per step
    overlong: Literal["none", "filter", "shape"] = "none"  # DAPO truncated-response handling
    overlong_buffer: int = 8            # 'shape': tokens before the limit where the penalty ramps up
    overlong_penalty: float = 1.0       # 'shape': penalty reached at the limit
    gamma: float = 1.0                  # GAE discount (§5)
    lam: float = 0.95                   # GAE lambda (§5)
    whiten_advantages: bool = False     # PPO: (A - mean) / std over the batch's tokens (§5)
    reward_weight: float = 0.0          # distillation: mix in the verifiable reward's group advantage
    # distillation: 'sampled' = -(logp_S - logp_T) of the sampled tokens as a dense advantage
    # (cheap, any teacher); 'exact' = full-vocabulary reverse KL at every position as the loss
    # (lower variance, needs the teacher's logits in the update: one more forward per micro-batch);
    # 'forward' = full-vocabulary forward KL(teacher || student) at the student's positions, whose
    # gradient does not vanish where the student is confidently wrong; keeps more entropy (MOPD in
    # docs/distillation.md: no faster than 'exact' there)
    distill_loss: str = "sampled"       # key of losses.distill.DISTILL_LOSSES

    def objective_params(self) -> ObjectiveParams:
        """The hyper-parameters the policy objectives read (losses.policy.ObjectiveParams)."""
        return ObjectiveParams(
            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
            sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg, cov_frac=self.cov_frac,
            cov_low=self.cov_low, cov_high=self.cov_high, kl_cov_coef=self.kl_cov_coef,
            dppo_delta_low=self.dppo_delta_low, dppo_delta_high=self.dppo_delta_high,
            dppo_ratio_cap=self.dppo_ratio_cap)

    def validate(self, group_size: int) -> None:
        check_choice("algorithm.advantage", self.advantage, ADVANTAGES.names())
        check_choice("algorithm.policy_loss", self.policy_loss, POLICY_LOSSES.names())
        check_choice("algorithm.aggregation", self.aggregation, AGGREGATIONS.names())
        check_choice("algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS.names())
        check_choice("algorithm.kl_in", self.kl_in, ("loss", "reward", "none"))
        check_choice("algorithm.overlong", self.overlong, ("none", "filter", "shape"))
        check_choice("algorithm.distill_loss", self.distill_loss, DISTILL_LOSSES.names())
        check_range("algorithm.clip_low", self.clip_low, 0.0, 1.0)
        check_range("algorithm.clip_high", self.clip_high, 0.0)
        check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        check_range("algorithm.entropy_coef", self.entropy_coef, 0.0)
        check_range("algorithm.cov_frac", self.cov_frac, 0.0, 1.0, lo_open=True)
        for name in ("dppo_delta_low", "dppo_delta_high"):
            check_range(f"algorithm.{name}", getattr(self, name), 0.0, lo_open=True)
        if self.dppo_ratio_cap is not None:
            check_range("algorithm.dppo_ratio_cap", self.dppo_ratio_cap, 1.0)
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            check_range(f"algorithm.{name}", getattr(self, name), 0.0, lo_open=True)
        if self.kl_in == "loss" and self.kl_estimator == "k1" and self.kl_coef > 0:
            raise ConfigError("algorithm.kl_estimator='k1' with kl_in='loss': k1's gradient in the "
                              "loss is grad log pi, zero in expectation on-policy, so the penalty "
                              "would pull nowhere; use k2 or k3_st (gradient of KL(pi || pi_ref)), "
                              "k3 (GRPO's), or kl_in='reward'")
        check_range("algorithm.eps", self.eps, 0.0)
        check_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        check_range("algorithm.lam", self.lam, 0.0, 1.0)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or null)")
        if self.kl_in == "reward" and self.advantage not in NEEDS_VALUES:
            raise ConfigError("algorithm.kl_in='reward' folds the KL into per-token rewards, which "
                              f"only a token-level estimator uses; advantage={self.advantage!r} "
                              "sees one score per response. Use kl_in='loss' or 'none'")
        needs_group = self.advantage in NEEDS_GROUP and (
            self.advantage != "group" or self.scale_by_std)
        if needs_group and group_size < 2:
            raise ConfigError(f"algorithm.advantage={self.advantage!r} compares the answers to one "
                              f"prompt: rollout.group_size={group_size} must be >= 2")
        if self.dynamic_sampling and self.advantage not in NEEDS_GROUP | {"group_mean"}:
            raise ConfigError("algorithm.dynamic_sampling drops groups whose rewards are all equal; "
                              f"it needs a group advantage, not {self.advantage!r}")


# docs/algorithms.md §2, §6, §7. Each preset is a `replace` of a few fields of GRPO.
GRPO = AlgorithmConfig()


PRESETS: dict[str, AlgorithmConfig] = {
    # REINFORCE with a batch-mean baseline: one on-policy update per batch, sum over the tokens.
    "reinforce": replace(GRPO, advantage="batch_mean", policy_loss="vanilla",
                         aggregation="seq_mean_token_sum", kl_in="none", kl_coef=0.0),
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline, PPO-style ratio clipping for reuse.
    "rloo": replace(GRPO, advantage="rloo", kl_in="none", kl_coef=0.0),
    # GRPO (Shao et al. 2024): group-normalised advantage, 1/|o_i| aggregation, k3 KL in the loss.
    "grpo": GRPO,
    # DAPO (Yu et al. 2025): token-mean, Clip-Higher, dynamic sampling, overlong shaping, no KL.
    "dapo": replace(GRPO, clip_high=0.28, aggregation="token_mean", kl_in="none", kl_coef=0.0,
                    dynamic_sampling=True, overlong="shape"),
    # Dr. GRPO (Liu et al. 2025): no std, constant length normaliser, no KL.
    "dr_grpo": replace(GRPO, scale_by_std=False, aggregation="seq_mean_token_sum_norm",
                       kl_in="none", kl_coef=0.0),
    # On-policy distillation (§8): the student samples, the teacher scores the same tokens, the
    # negated sampled reverse KL is a dense per-token advantage through the clipped PG loss.
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): a value model, GAE, per-token KL to pi_ref
    # folded into the reward (k1 = log pi_old - log pi_ref, the score on the last token),
    # whitened advantages, clipped surrogate over several epochs of minibatches (set in optim).
    "ppo": replace(GRPO, advantage="gae", kl_in="reward", kl_estimator="k1", kl_coef=0.05,
                   aggregation="token_mean", gamma=1.0, lam=0.95, whiten_advantages=True),
    "opd": replace(GRPO, advantage="reverse_kl", aggregation="token_mean", kl_in="none",
                   kl_coef=0.0),
    # The field's current objectives (docs/algorithms.md §11), on GRPO's group advantage, no KL.
    # GSPO (Zheng et al. 2025): sequence-level length-normalised ratio, clipped per sequence.
    "gspo": replace(GRPO, policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, kl_in="none", kl_coef=0.0),
    # CISPO (MiniMax-M1 2025): the clipped IS weight as a constant on every token's log-prob.
    "cispo": replace(GRPO, policy_loss="cispo", clip_low=1.0, clip_high=4.0, aggregation="token_mean",
                     kl_in="none", kl_coef=0.0),
    # SAPO (Gao et al. 2025): a soft sigmoid gate instead of the hard clip.
    "sapo": replace(GRPO, policy_loss="sapo", aggregation="token_mean", kl_in="none", kl_coef=0.0),
    # GMPO (Zhao et al. 2025): geometric mean of token ratios, log-ratio clip +-0.4.
    "gmpo": replace(GRPO, policy_loss="gmpo", clip_low=0.4, clip_high=0.4, kl_in="none", kl_coef=0.0),
    # TOPR (Le Roux et al. 2025): REINFORCE on good answers, truncated sequence IS on bad ones.
    "topr": replace(GRPO, policy_loss="topr", aggregation="seq_mean_token_sum", kl_in="none", kl_coef=0.0),
}
