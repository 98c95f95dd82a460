"""The value model of PPO: V(x, y_<t) at every response position.  docs/algorithms.md §5.

Two layouts, chosen by `critic.shared_backbone`:

- separate (default): a transformer of its own with a scalar head, initialised from the policy's
  starting weights (or from `critic.path`). It is a Hugging Face `AutoModelForTokenClassification`
  with one label, so it saves and reloads with plain transformers. Memory: a second copy of the
  weights plus their gradients and two Adam moments, i.e. four more copies of the parameters
  (SmolLM2-135M in float32: about +2.2 GB), and one more forward/backward per micro-batch.
- shared: a scalar head on the policy's own last hidden states; the value loss, weighted by
  `critic.vf_coef`, flows into the policy's body. H + 1 more parameters and no extra forward pass,
  at the price of the value and policy gradients pulling on the same weights.

Either way the values come from `forward.response_hidden`, the same prompt-shared forward as the
policy's log-probs, so V_t sits at exactly the position whose hidden state predicts y_t.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification

from posttrain.config.sections import CriticConfig
from posttrain.model.distributed import (SINGLE, World, average_gradients, clip_grad_norm,
                                   full_state_dict, load_optimizer_state, optimizer_state, wrap)
from posttrain.rollout.forward import group_chunks, response_hidden, sequence_logprobs
from posttrain.rollout import Rollout
from posttrain.run.optim import make_adamw

log = logging.getLogger("posttrain")

HEAD_FILE = "value_head.safetensors"


class Critic:
    """V(x, y_<t) for the rows of a rollout, trained on the GAE returns."""

    def __init__(self, cfg: CriticConfig, policy, world: World = SINGLE,
                 resume_from: Path | None = None) -> None:
        """`policy`: the policy before any FSDP wrapping (a separate critic copies its body).
        Under FSDP a separate critic's layers are sharded like the policy's; `resume_from` (a
        checkpoint's critic folder) is loaded before that."""
        self.cfg, self.world = cfg, world
        self.shared = cfg.shared_backbone
        hidden_size = policy.config.hidden_size
        dtype = next(policy.parameters()).dtype
        if self.shared:
            self.model = None
            self.head = nn.Linear(hidden_size, 1).to(dtype)
            nn.init.zeros_(self.head.weight)    # V = 0 at the start: no made-up baseline
            nn.init.zeros_(self.head.bias)
        elif cfg.path:
            self.model = AutoModelForTokenClassification.from_pretrained(
                cfg.path, num_labels=1, dtype=dtype)
            self.head = self.model.score
        else:
            config = policy.config.__class__.from_dict(policy.config.to_dict())
            config.num_labels = 1
            self.model = AutoModelForTokenClassification.from_config(config).to(dtype)
            body = policy.get_decoder().state_dict()
            if hasattr(policy, "peft_config"):   # LoRA policy: start from its frozen base weights
                body = {k.replace(".base_layer", ""): v for k, v in body.items() if "lora_" not in k}
            self.model.base_model.load_state_dict(body)
            nn.init.zeros_(self.model.score.weight)
            nn.init.zeros_(self.model.score.bias)
            self.head = self.model.score
        device = next(policy.parameters()).device
        if self.model is not None:
            self.model.to(device)
        self.head.to(device)
        if resume_from is not None:
            self.load(resume_from)
        if self.model is not None:
            self.model = wrap(self.model, world)      # FSDP2: the value model's layers sharded
        self.optimizer = make_adamw(self.parameters(), cfg.lr, sharded=world.strategy == "fsdp")

    def parameters(self) -> list[nn.Parameter]:
        return list((self.model or self.head).parameters())

    def train(self) -> None:
        (self.model or self.head).train()

    def values(self, rollout: Rollout, rows: Tensor, autocast: str = "none",
               policy_hidden: Tensor | None = None) -> Tensor:
        """V at each response position of `rows` (whole groups): (b, T), with gradients.
        A shared head reads `policy_hidden` from the policy's own forward pass."""
        if self.shared:
            if policy_hidden is None:
                raise ValueError("a value head on the policy's body needs the policy's hidden states")
            hidden = policy_hidden
        else:
            hidden = response_hidden(self.model.base_model, rollout, rows, autocast=autocast)
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    @torch.no_grad()
    def predict(self, rollout: Rollout, micro: int, autocast: str = "none", policy=None,
                temperature: float = 1.0) -> Tensor:
        """V_old for a whole rollout, in micro-batches, zero on masked positions: (B, T)."""
        parts = []
        for rows in group_chunks(len(rollout.truncated_B), rollout.group_size, micro):
            hidden = None
            if self.shared:
                hidden = sequence_logprobs(policy, rollout, rows, temperature, autocast=autocast,
                                           keep_hidden=True).hidden
            parts.append(self.values(rollout, rows, autocast, hidden))
        return torch.cat(parts) * rollout.response_mask_B_T

    def step(self) -> Tensor:
        """Average the replicated gradients over ranks (FSDP already reduced the sharded ones),
        clip them, take an optimizer step; returns the gradient norm (a tensor: no sync)."""
        params = self.parameters()    # (after backward: FSDP2 has re-registered its shards)
        average_gradients(params, self.world)
        norm = clip_grad_norm(params, self.cfg.max_grad_norm, self.world)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def optimizer_state(self) -> dict:
        """The value model's optimizer state, full and keyed by parameter name (resumes on any
        number of ranks; a collective under FSDP)."""
        if self.model is None:
            return self.optimizer.state_dict()
        return optimizer_state(self.model, self.optimizer)

    def load_optimizer_state(self, state: dict) -> None:
        if self.model is None:
            self.optimizer.load_state_dict(state)
        else:
            load_optimizer_state(self.model, self.optimizer, state)

    # -- saving --------------------------------------------------------------------------------
    def save(self, folder: Path, tokenizer=None) -> None:
        """A separate critic as an AutoModelForTokenClassification folder; a shared head as
        value_head.safetensors (to sit beside the policy it reads). Every rank calls this (FSDP
        shards are gathered); rank 0 writes."""
        if self.model is None:
            if self.world.main:
                folder.mkdir(parents=True, exist_ok=True)
                save_file({k: v.detach().contiguous().cpu()
                           for k, v in self.head.state_dict().items()}, folder / HEAD_FILE)
            return
        weights = full_state_dict(self.model, self.world)
        if not self.world.main:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    def load(self, folder: Path) -> None:
        if self.model is None:
            state = load_file(folder / HEAD_FILE)
            self.head.load_state_dict({k: v.to(self.head.weight.device) for k, v in state.items()})
            return
        loaded = AutoModelForTokenClassification.from_pretrained(
            folder, num_labels=1, dtype=next(self.model.parameters()).dtype)
        self.model.load_state_dict(loaded.state_dict())
