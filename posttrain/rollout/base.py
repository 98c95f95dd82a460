"""The contract between generation and training.

A backend (in-process transformers today; a vLLM engine or a remote server later) takes token ids
of P prompts and returns G sampled responses for each, with the log-probability of every sampled
token under the policy that generated it (`pi_old`, docs/algorithms.md §3). The trainer never needs to
know which backend produced a `Rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
from torch import Tensor


SEED_PRIME = 1_000_003


def seed_key(seed, k):
    """The one seed rule: a key derived from `seed` for its k-th use (a prompt's index, an
    episode's turn, an update's optimizer step), as `seed * 1_000_003 + k` (a prime, so keys of
    different seeds and k do not collide in practice). Ints or int64 tensors alike."""
    return seed * SEED_PRIME + k


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 24
    temperature: float = 1.0   # logp are recorded at this temperature, as the trainer computes them
    top_p: float = 1.0         # nucleus sampling; logp are the nucleus's, renormalised (as vLLM's)
    greedy: bool = False       # evaluation: argmax decoding
    stop: tuple[str, ...] = ()  # stop strings: the response ends with the token that completes one
    max_episode_tokens: int | None = None   # multi-turn: the whole episode's tokens (policy + environment)


@dataclass
class Rollout:
    """B = P * G responses; response i belongs to prompt i // G.

    Prompts are left-padded and responses right-padded, so `cat([prompt, response], 1)` puts every
    response's first token at the same column and the trainer can slice response positions.
    """

    prompt_ids_B_L: Tensor      # (B, L) long, left-padded with pad_token_id
    prompt_mask_B_L: Tensor     # (B, L) 1 on real prompt tokens
    response_ids_B_T: Tensor    # (B, T) long, right-padded
    response_mask_B_T: Tensor   # (B, T) float, 1 on generated tokens (EOS included)
    logp_B_T: Tensor            # (B, T) float32 log pi_old(y_t | x, y_<t) at the sampling temperature
    truncated_B: Tensor         # (B,) bool: stopped by max_new_tokens, not by EOS or a stop string
    group_size: int
    # multi-turn episodes: 1 on the tokens the policy wrote, 0 on those the environment wrote
    # (tool results, feedback: context, never trained on); None: every response token is the policy's
    policy_mask_B_T: Tensor | None = None

    @property
    def policy_tokens_B_T(self) -> Tensor:
        """(B, T) float: 1 on the response tokens the policy sampled."""
        if self.policy_mask_B_T is None:
            return self.response_mask_B_T
        return self.response_mask_B_T * self.policy_mask_B_T

    def policy_ids(self) -> list[list[int]]:
        """Each response's tokens the policy sampled, in order (TRL's `completion_ids`; an
        episode's turns joined, the environment's tokens left out)."""
        keep = self.policy_tokens_B_T.bool().tolist()
        return [[t for t, k in zip(row, mask) if k]
                for row, mask in zip(self.response_ids_B_T.tolist(), keep)]

    @property
    def lengths_B(self) -> Tensor:
        return self.response_mask_B_T.sum(-1)

    @property
    def longest_turn_B(self) -> Tensor:
        """The most tokens the policy wrote in one turn (a single-turn response: its length):
        what `max_new_tokens` limits, whatever the environment wrote in between."""
        if self.policy_mask_B_T is None:
            return self.lengths_B
        run = best = torch.zeros_like(self.lengths_B)
        for col in self.policy_tokens_B_T.unbind(-1):   # runs of consecutive policy tokens
            run = (run + 1) * col
            best = torch.maximum(best, run)
        return best

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device`."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def select(self, rows: Tensor) -> Rollout:
        """Keep responses `rows` (whole groups, for dynamic sampling)."""
        return Rollout(self.prompt_ids_B_L[rows], self.prompt_mask_B_L[rows],
                       self.response_ids_B_T[rows], self.response_mask_B_T[rows],
                       self.logp_B_T[rows], self.truncated_B[rows], self.group_size,
                       None if self.policy_mask_B_T is None else self.policy_mask_B_T[rows])


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of different prompt and response widths (dynamic sampling refills)."""
    if len(parts) == 1:
        return parts[0]
    L = max(p.prompt_ids_B_L.shape[1] for p in parts)
    T = max(p.response_ids_B_T.shape[1] for p in parts)

    def pad(x: Tensor, width: int, value, left: bool) -> Tensor:
        extra = width - x.shape[1]
        if extra == 0:
            return x
        fill = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
        return torch.cat([fill, x] if left else [x, fill], dim=1)

    return Rollout(
        torch.cat([pad(p.prompt_ids_B_L, L, pad_id, True) for p in parts]),
        torch.cat([pad(p.prompt_mask_B_L, L, 0, True) for p in parts]),
        torch.cat([pad(p.response_ids_B_T, T, pad_id, False) for p in parts]),
        torch.cat([pad(p.response_mask_B_T, T, 0, False) for p in parts]),
        torch.cat([pad(p.logp_B_T, T, 0.0, False) for p in parts]),
        torch.cat([p.truncated_B for p in parts]),
        parts[0].group_size,
        None if all(p.policy_mask_B_T is None for p in parts) else
        torch.cat([pad(p.policy_tokens_B_T, T, 0.0, False) for p in parts]),
    )


class RolloutEngine(Protocol):
    """What every caller of an engine uses. Built in one place, `rollout.make_engine`, by the
    ENGINES registry (`rollout.backend`): a new engine is a module and one registration."""

    model: Any            # the policy it samples from in this process (None: it holds a copy elsewhere)
    runs_episodes: bool   # `generate` takes `respond=` and runs a multi-turn episode in one call

    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams,
                 generator: torch.Generator | None = None, seeds: Tensor | None = None) -> Rollout:
        """Sample `group_size` responses for each prompt (token ids, chat template applied);
        `seeds`, one int64 per response, make each response depend on its own seed only.
        An engine that `runs_episodes` also takes `respond=` (rollout/hf.py) and runs multi-turn
        episodes in one call; for the others rollout/episodes.py calls `generate` once per turn."""
        ...

    def sync_weights(self) -> None:
        """Make the engine sample from the trainer's current weights (no-op when they are shared)."""
        ...

    def for_evaluation(self) -> "RolloutEngine":
        """The engine held-out evaluation samples with: the trainer's weights in their own
        precision (an in-process engine sampling from a bf16 copy gives one over the policy)."""
        ...

    def close(self) -> None:
        """Stop what the engine started (vLLM's engine processes, launched servers); no-op in
        process."""
        ...


class PublishesWeights(Protocol):
    """An engine that samples ahead of the trainer (sampling/sources.py): a version of the weights
    is written while it samples, and loaded between two of its batches."""

    def publish(self) -> Any: ...          # write the trainer's weights as the next version
    def load(self, written: Any) -> None: ...      # sample from that version from now on
    def discard(self, written: Any) -> None: ...   # a version it will never load


def runs_episodes(engine) -> bool:
    """Whether `engine` runs a multi-turn episode in one `generate` (an engine written before
    the declaration runs them turn by turn)."""
    return bool(getattr(engine, "runs_episodes", False))


def evaluation_engine(engine) -> RolloutEngine:
    """`engine.for_evaluation()`, or the engine itself where it declares none."""
    build = getattr(engine, "for_evaluation", None)
    return build() if build is not None else engine


def close_engine(engine) -> None:
    """Stop what `engine` started: its `close()`, where it has one (an engine written before
    `close` was part of the contract has nothing to stop)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def async_core_split(rollout_cfg, n_cores: int | None = None, has_cuda: bool | None = None
                     ) -> tuple[int, int] | None:
    """Asynchronous training on a CPU (`rollout.async_cpu_split`): the trainer's threads and the
    first core of the engines', the lower half of the cores for the trainer and the upper for
    vLLM (which binds its threads to them), so the two do not spin on each other's cores. None:
    no split (synchronous, CUDA, or under 2 cores)."""
    import os
    n = n_cores or os.cpu_count() or 1
    cuda = torch.cuda.is_available() if has_cuda is None else has_cuda
    if not (rollout_cfg.max_staleness and rollout_cfg.async_cpu_split) or cuda or n < 2:
        return None
    return n // 2, n // 2
