"""Layer 1: every per-token quantity the lecture trains on, as small pure functions on tensors.

Shape suffixes: `_B` responses (B = P * G), `_T` response tokens, `_V` vocabulary, `_N` any
flattened positions. `mask_B_T` is 1 on response tokens and 0 on padding. Nothing here calls
`.item()`: metrics come back as tensors and the trainer syncs once per step.

Sections refer to docs/algorithms.md (`§N`), which states each formula and names the lecture section.

One room per concern; import from the room (`from posttrain.losses.kl import KL_ESTIMATORS`):

- common.py: `masked` / `masked_mean` (every masked sum goes through them), `token_logprobs`,
  `entropy_from_logits`, `sequence_logprob` (§2). Imports none of the rooms below.
- policy.py: the policy objectives (§2, §3, §5, §11) and their registry `POLICY_LOSSES`;
  policy_selective.py: those that choose the tokens a gradient flows through (Clip-Cov, KL-Cov,
  TOPR, DPPO), registered in the same registry.
- correction.py: drift from pi_old (`ratio_stats`) and `OFF_POLICY_CORRECTIONS`, the importance
  weights for another engine's samples (§3, §5).
- aggregation.py: `AGGREGATIONS`, per-token weights, and `aggregate` (§6, §7).
- kl.py: `KL_ESTIMATORS`, the exact KL from logits, the KL in the loss or the reward, the entropy
  bonus (§4-§6, §11).
- value.py: the critic's loss and explained variance (§5).
- distill.py: on-policy distillation and `DISTILL_LOSSES` (§8); reads kl.py.
- preference.py: Bradley-Terry, DPO (§1, §9) and the SFT loss.

The rooms import downward only (common first); this init imports policy_selective.py only, so
that POLICY_LOSSES holds every objective whichever room is imported first.
"""

from posttrain.losses import policy_selective  # noqa: F401  (registers its objectives)
