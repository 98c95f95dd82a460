"""What the in-process sampler's loop (rollout/hf.py `HFRolloutEngine`) carries from one
decoding step to the next: `Decoding`, what every row has written and which rows still write,
and `Turns`, the book-keeping of multi-turn episodes run through the same KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

# respond(row, the turn's token ids, 'end' (EOS or a stop string) | 'length') -> the environment's tokens, or None
Respond = Callable[[int, list[int], str], "list[int] | None"]


@dataclass
class Decoding:
    """What HFRolloutEngine's sampling loop carries from step to step: the (B, T) tokens and
    log-probs written so far, each row's length, the rows a stop string ended, the EOS ids, and
    the rows still writing (`active`, in cache order) with their KV cache, attention mask and
    next position; `turns`: the book-keeping of multi-turn episodes (None: single responses)."""

    tokens: Tensor
    logps: Tensor
    lengths: Tensor
    stopped: Tensor
    eos: Tensor
    active: Tensor
    cache: DynamicCache
    attn: Tensor
    next_pos: Tensor
    turns: Turns | None = None

    @classmethod
    def start(cls, T: int, pad_id: int, eos_ids: set[int], cache: DynamicCache, attn: Tensor,
              next_pos: Tensor, *, turns: Turns | None = None) -> Decoding:
        """Before the first step: every row writing, nothing written (T tokens of room)."""
        B, device = attn.shape[0], attn.device
        return cls(tokens=torch.full((B, T), pad_id, dtype=torch.long, device=device),
                   logps=torch.zeros((B, T), dtype=torch.float32, device=device),
                   lengths=torch.full((B,), T, dtype=torch.long, device=device),
                   stopped=torch.zeros(B, dtype=torch.bool, device=device),
                   eos=torch.tensor(sorted(eos_ids), device=device),
                   active=torch.arange(B, device=device), cache=cache, attn=attn,
                   next_pos=next_pos, turns=turns)

    def keep(self, keep: Tensor) -> None:
        """Only the active rows at positions `keep` go on writing (the rest ended)."""
        self.active, self.attn = self.active[keep], self.attn[keep]
        self.next_pos = self.next_pos[keep]
        self.cache.batch_select_indices(keep)


class Turns:
    """Book-keeping of multi-turn episodes inside one sampling loop (HFRolloutEngine.generate):
    where each row's current turn began, the environment tokens still to feed it, and which
    positions the policy wrote."""

    def __init__(self, B: int, T: int, device) -> None:
        self.T = T
        self.start = [0] * B                      # column of each row's current turn
        self.queue: list[list[int]] = [[] for _ in range(B)]   # environment tokens to feed
        self.policy_B_T = torch.ones((B, T), dtype=torch.float32, device=device)
        self.truncated = torch.ones(B, dtype=torch.bool, device=device)   # until an episode ends
        self.forced_now: set[int] = set()         # rows that took an environment token this step

    def force(self, active: Tensor, tok: Tensor, logp: Tensor, t: int) -> tuple[Tensor, Tensor]:
        """Rows with environment tokens queued take the next one instead of their sample."""
        rows = [i for i, r in enumerate(active.tolist()) if self.queue[r]]
        self.forced_now = {int(active[i]) for i in rows}
        if not rows:
            return tok, logp
        tok, logp = tok.clone(), logp.clone()
        idx = torch.tensor(rows, device=tok.device)
        tok[idx] = torch.tensor([self.queue[int(active[i])].pop(0) for i in rows], device=tok.device)
        logp[idx] = 0.0
        self.policy_B_T[active[idx], t] = 0.0
        return tok, logp

    def this_turn(self, window: Tensor, active: Tensor, t: int, pad_id: int) -> Tensor:
        """The last columns of each row, with those before its current turn blanked out."""
        first = t + 1 - window.shape[1]
        cols = torch.arange(first, t + 1, device=window.device)[None, :]
        starts = torch.tensor([self.start[r] for r in active.tolist()], device=window.device)
        return window.masked_fill(cols < starts[:, None], pad_id)

    def cut_by_budget(self, active: Tensor, t: int, tokens: Tensor, respond: Respond) -> None:
        """Rows still writing a turn when the episode's token budget ends: the environment sees
        the cut turn (reason 'length'; a reply has no room and is dropped), as
        the turn loop does (rollout/sessions.py `BookTurns`), so both grade the episode on the same turn."""
        for r in active.tolist():
            if r not in self.forced_now and self.start[r] <= t:
                respond(r, tokens[r, self.start[r]:t + 1].tolist(), "length")

    def end_turns(self, active: Tensor, ended: Tensor, t: int, tokens: Tensor, max_turn_tokens: int,
                  respond: Respond) -> Tensor:
        """Ask the environment about every row whose turn ended at t; return the rows whose
        episode is over (the environment said so, or its next message would not fit)."""
        done = torch.zeros_like(ended)
        for i, (r, end) in enumerate(zip(active.tolist(), ended.tolist())):
            if r in self.forced_now:
                continue                              # the environment is writing this row
            reason = "end" if end else ("length" if t + 1 - self.start[r] >= max_turn_tokens else None)
            if reason is None:
                continue
            reply = respond(r, tokens[r, self.start[r]:t + 1].tolist(), reason)
            if reply is None:
                done[i] = True
                self.truncated[r] = reason == "length"
            elif t + 1 + len(reply) >= self.T:        # no room left for the reply and a turn
                done[i] = True
            else:
                self.queue[r] = list(reply)
                self.start[r] = t + 1 + len(reply)
        return done
