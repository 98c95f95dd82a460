"""One step's scored responses: a `Rollout` plus what the reward and the frozen models add to it.

A `ScoredBatch` is immutable. Each stage after sampling returns a new one with
`dataclasses.replace` (reference, teacher and trainer pi_old log-probs, then the advantages and
PPO's value targets), so the update reads everything from the batch, and `select`, `merge` and
`to` carry every field by its kind (a response-per-row list, a (B, ...) tensor, a rollout), so no
field depends on the order of the calls that filled it and a new field cannot be dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from posttrain.data.tasks import Problem
from posttrain.rollout.base import Rollout, concat_rollouts


@dataclass(frozen=True)
class ScoredBatch:
    rollout: Rollout
    problems: list[Problem]         # one per response (B)
    completions: list[str]
    rewards_B: Tensor               # total reward, shaping included
    correct_B: Tensor
    loss_mask_B_T: Tensor           # response tokens that enter the loss
    ref_logp_B_T: Tensor | None = None
    teacher_logp_B_T: Tensor | None = None
    teacher_view: Rollout | None = None   # the same responses after the teacher's own prompts
    # another engine sampled (vLLM): rollout.logp_B_T are its log-probs, these the trainer's own
    # for the same tokens (ratios, advantages, KL and the truncated IS weights use them)
    trainer_old_logp_B_T: Tensor | None = None
    transcripts: list[str] | None = None  # multi-turn: each whole episode as text (logs)
    reward_parts: list[dict[str, float]] | None = None   # each reward by source (RewardResult.parts_B)
    # the advantages stage (§2-§8): A_t per response token; PPO also V_old and the GAE returns
    # the value model regresses on (§5)
    adv_B_T: Tensor | None = None
    old_values_B_T: Tensor | None = None
    returns_B_T: Tensor | None = None
    token_rewards_B_T: Tensor | None = None   # PPO: the per-token rewards GAE read (§5)
    # asynchronous training: the weight version (a step number) that sampled each response
    # (sampling/sources.py); None: the weights being trained
    version_B: Tensor | None = None
    # the LLM judge: False where it could not score a response (out of the baseline and loss)
    scored_B: Tensor | None = None

    def __post_init__(self) -> None:
        """Every per-token log-prob holds 0 past each response's end and on the tokens an
        environment wrote: what an engine left in the
        padding (another engine's NaN filler) can never reach a ratio, a loss, its gradient
        (where()'s backward multiplies by the local derivative, so NaN would survive a mask) or
        a metric."""
        pad = self.rollout.policy_tokens_B_T == 0
        clean = lambda x: None if x is None else x.masked_fill(pad, 0.0)  # noqa: E731
        object.__setattr__(self, "rollout", replace(self.rollout, logp_B_T=clean(self.rollout.logp_B_T)))
        for name in ("ref_logp_B_T", "teacher_logp_B_T", "trainer_old_logp_B_T"):
            object.__setattr__(self, name, clean(getattr(self, name)))

    @property
    def old_logp_B_T(self) -> Tensor:
        """log pi_old of the sampled tokens as the trainer computes them."""
        return self.rollout.logp_B_T if self.trainer_old_logp_B_T is None else self.trainer_old_logp_B_T

    @property
    def rewards_P_G(self) -> Tensor:
        return self.rewards_B.reshape(-1, self.rollout.group_size)

    @property
    def scored_P_G(self) -> Tensor | None:
        """False where the LLM judge could not score a response (None: every response scored)."""
        return None if self.scored_B is None else self.scored_B.reshape(-1, self.rollout.group_size)

    @property
    def equal_groups(self) -> Tensor:
        """(P,) bool: the groups with no signal (equal_reward_groups)."""
        return equal_reward_groups(self.rewards_P_G, self.scored_P_G)

    def select(self, rows: Tensor) -> ScoredBatch:
        """The responses `rows` (whole groups, for dynamic sampling), every field kept."""
        idx = rows.tolist()

        def pick(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, Rollout):
                return v.select(rows)
            if isinstance(v, Tensor):
                return v[rows]
            return [v[i] for i in idx]
        return replace(self, **{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    def to(self, device) -> ScoredBatch:
        """The same batch with every tensor (rollouts' too) on `device`."""
        return replace(self, **{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


def _to(v: Any, device) -> Any:
    if isinstance(v, Tensor):
        return v.to(device)
    if isinstance(v, Rollout):
        return replace(v, **{f.name: _to(getattr(v, f.name), device) for f in fields(v)})
    return v


def merge(parts: list[ScoredBatch], pad_id: int) -> ScoredBatch:
    """Join batches of different response widths (dynamic sampling refills); every field kept.

    Per-token fields (`*_B_T`) are right-padded with 0 to the widest response; a field must be
    set in every part or in none."""
    if len(parts) == 1:
        return parts[0]
    rollout = concat_rollouts([p.rollout for p in parts], pad_id)
    T = rollout.response_ids_B_T.shape[1]
    joined: dict[str, Any] = {}
    for f in fields(ScoredBatch):
        values = [getattr(p, f.name) for p in parts]
        if all(v is None for v in values):
            joined[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"merge: ScoredBatch.{f.name} is set in some parts and not in others")
        elif f.name == "rollout":
            joined[f.name] = rollout
        elif isinstance(values[0], Rollout):
            joined[f.name] = concat_rollouts(values, pad_id)
        elif f.name.endswith("_B_T"):
            joined[f.name] = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1])) for v in values])
        elif isinstance(values[0], Tensor):
            joined[f.name] = torch.cat(values)
        else:
            joined[f.name] = [x for v in values for x in v]
    return ScoredBatch(**joined)


def equal_reward_groups(rewards_P_G: Tensor, scored_P_G: Tensor | None = None) -> Tensor:
    """(P,) bool: groups whose G rewards are all equal (zero group advantage, no signal); with
    unscorable responses (`scored_P_G` False), groups whose scored rewards are all equal or that
    have fewer than 2 scored (their advantages are 0 too: losses/advantages.py)."""
    if scored_P_G is None:
        return (rewards_P_G == rewards_P_G[:, :1]).all(dim=1)
    inf = torch.tensor(float("inf"), device=rewards_P_G.device)
    high = torch.where(scored_P_G, rewards_P_G, -inf).amax(dim=1)
    low = torch.where(scored_P_G, rewards_P_G, inf).amin(dim=1)
    return (high == low) | (scored_P_G.sum(dim=1) < 2)
