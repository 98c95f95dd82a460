"""On-policy distillation: the sampled reverse KL as an advantage, the exact KLs from logits, and how a
teacher enters the update (`DISTILL_LOSSES`).  §8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from posttrain.losses.common import masked
from posttrain.losses.kl import exact_kl_from_logits
from posttrain.util.registry import Registry


# ---------------------------------------------------------------------------------------------
# On-policy distillation (§8)
# ---------------------------------------------------------------------------------------------

def sampled_reverse_kl(logp_B_T: Tensor, teacher_logp_B_T: Tensor) -> Tensor:
    """Per-token sampled estimate of KL(pi_theta || pi_T) at the student's own tokens.  §8.

        kl_t = log pi_theta(y_t | x, y_<t) - log pi_T(y_t | x, y_<t),    y_t ~ pi_theta

    Unbiased for the exact per-position reverse KL because y_t is drawn from the student.
    """
    return logp_B_T - teacher_logp_B_T


def distillation_advantage(logp_B_T: Tensor, teacher_logp_B_T: Tensor, mask_B_T: Tensor,
                           coef: float = 1.0) -> Tensor:
    """The negated sampled reverse KL as a dense per-token advantage.  §8.

        A_t = -coef * (log pi_theta(y_t) - log pi_T(y_t))     (no gradient through A_t)

    Fed to the usual policy-gradient loss, it pushes each token toward the teacher's preference.
    """
    return -coef * masked(sampled_reverse_kl(logp_B_T, teacher_logp_B_T).detach(), mask_B_T)


def reverse_kl_from_logits(student_logits_N_V: Tensor, teacher_logits_N_V: Tensor,
                           temperature: float = 1.0) -> Tensor:
    """Exact per-position reverse KL(pi_theta || pi_T) over the vocabulary.  §8 (mode-seeking)."""
    return exact_kl_from_logits(student_logits_N_V, teacher_logits_N_V, temperature)


def forward_kl_from_logits(student_logits_N_V: Tensor, teacher_logits_N_V: Tensor,
                           temperature: float = 1.0) -> Tensor:
    """Exact per-position forward KL(pi_T || pi_theta) on the student's own samples.  §8.

        KL_t = sum_v pi_T(v) (log pi_T(v) - log pi_theta(v)),   dKL_t / dz_v = (pi_theta(v) - pi_T(v)) / tau

    (GKD's beta = 0 on on-policy samples; mode-covering.) Where the student is confidently wrong
    (pi_theta(v*) ~ 1, pi_T(v*) ~ 0) the reverse KL's gradient pi_theta (log pi_theta / pi_T - KL)
    vanishes with the student's mass off v*, while this one stays of order one.
    """
    return exact_kl_from_logits(teacher_logits_N_V, student_logits_N_V, temperature)


@dataclass(frozen=True)
class DistillLoss:
    """How a teacher enters the update (§8); the registry key is `algorithm.distill_loss`.

    `in_advantage`: the sampled reverse KL of the student's tokens becomes a dense advantage
    (the teacher's log-probs of the sampled tokens are computed once per batch, before the update).
    `token_loss(logits, teacher_logits, tau) -> (loss_B_T, reverse_kl_B_T)`: a full-vocabulary
    loss per position added to the policy loss, with the exact reverse KL (no gradient) to log;
    the update then runs the teacher on every micro-batch for its logits.
    """

    in_advantage: bool
    token_loss: Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]] | None = None


def _exact_reverse_kl_loss(logits: Tensor, teacher_logits: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    kl = reverse_kl_from_logits(logits, teacher_logits, tau)
    return kl, kl.detach()


def _forward_kl_loss(logits: Tensor, teacher_logits: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    return (forward_kl_from_logits(logits, teacher_logits, tau),
            reverse_kl_from_logits(logits.detach(), teacher_logits, tau))


DISTILL_LOSSES: Registry[DistillLoss] = Registry("distillation loss")
# 'sampled': -(logp_S - logp_T) of the sampled tokens as a dense advantage (cheap, any teacher)
DISTILL_LOSSES.register("sampled")(DistillLoss(in_advantage=True))
# 'exact': the full-vocabulary reverse KL at every position as the loss (lower variance)
DISTILL_LOSSES.register("exact")(DistillLoss(in_advantage=False, token_loss=_exact_reverse_kl_loss))
# 'forward': KL(teacher || student) at the student's positions (its gradient survives where the
# student is confidently wrong); the reverse KL is still logged
DISTILL_LOSSES.register("forward")(DistillLoss(in_advantage=False, token_loss=_forward_kl_loss))
