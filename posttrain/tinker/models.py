"""The models a Tinker server trains: one base model (its weights shared and frozen) and one LoRA
adapter per training client, each with its own AdamW state, step count and seed. A client's
forward-backward sees only its own adapter and accumulates gradients only into it until its
`optim_step`, also when it runs in one batch with other clients' (futures.py): each row goes
through its own client's adapter (peft's mixed-adapter forward, with gradients).

    forward_backward:  logp_t = log pi(target_t | tokens_<=t)  for every position t of a datum,
                       loss = sum over datums and positions of the loss's per-token term
                       (losses.py); backward unless forward_only. Returns each datum's logp and
                       {"loss:sum": loss}.
    optim_step:        AdamW with the request's lr, betas, eps and weight decay; the gradient
                       clipped to `grad_clip_norm` (0: not clipped) and dropped when not finite
                       (run/learner.step_if_finite, the guard every posttrain learner uses).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

from posttrain.losses.common import token_logprobs
from posttrain.model.distributed import SINGLE
from posttrain.run.learner import step_if_finite
from posttrain.tinker.losses import check_config, check_inputs, check_loss, needed_inputs
from posttrain.tinker.wire import ForwardBackward, WireError

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class TrainingRun:
    """One training client: its adapter (by name in the shared PeftModel) and optimizer."""
    model_id: str
    lora: dict[str, Any]                 # rank, seed, train_attn, train_mlp, train_unembed
    params: list[Tensor]
    optimizer: torch.optim.AdamW
    steps: int = 0
    skipped: int = 0
    created: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter(self) -> str:
        return adapter_name(self.model_id)


def adapter_name(model_id: str) -> str:
    """peft adapter names may not hold ':' or '.'."""
    return "run_" + "".join(c if c.isalnum() else "_" for c in model_id)


def lora_config(lora: dict[str, Any]):
    """The peft LoraConfig of Tinker's LoRA settings (alpha = rank: a scale of 1, no dropout)."""
    from peft import LoraConfig
    targets = [*(ATTN if lora.get("train_attn", True) else ()),
               *(MLP if lora.get("train_mlp", True) else ())]
    if lora.get("train_unembed", True):
        targets.append("lm_head")
    if not targets:
        raise WireError("lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")
    return LoraConfig(r=int(lora["rank"]), lora_alpha=int(lora["rank"]), lora_dropout=0.0,
                      target_modules=targets)


class Models:
    """The base model and every training client's adapter on it."""

    def __init__(self, base, tokenizer, name: str, aliases: tuple[str, ...] = ()) -> None:
        self.base, self.tokenizer, self.name = base, tokenizer, name
        self.names = {name, *aliases}      # what a client may call the base model
        self.peft = None                   # the PeftModel, made with the first adapter
        self.runs: dict[str, TrainingRun] = {}

    def create(self, model_id: str, lora: dict[str, Any], state: dict[str, Tensor] | None = None) -> TrainingRun:
        """A new adapter (initialised from `lora["seed"]`, or set to `state`) and its AdamW."""
        from peft import get_peft_model, set_peft_model_state_dict
        if int(lora.get("rank", 0)) < 1:
            raise WireError(f"lora_config rank={lora.get('rank')!r}: a rank of at least 1")
        config, name = lora_config(lora), adapter_name(model_id)
        with torch.random.fork_rng():
            torch.manual_seed(int(lora.get("seed") or 0))
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        if state is not None:
            set_peft_model_state_dict(self.peft, state, adapter_name=name)
        params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        run = TrainingRun(model_id, dict(lora), params, torch.optim.AdamW(params, lr=1e-5))
        self.runs[model_id] = run
        return run

    def run(self, model_id: str) -> TrainingRun:
        if model_id not in self.runs:
            raise WireError(f"model_id {model_id!r} is not a training client of this server")
        return self.runs[model_id]

    @contextmanager
    def use(self, adapter: str | None) -> Iterator[Any]:
        """The model computing with `adapter` (None: the base model alone, adapters off)."""
        if adapter is None:
            with self.peft.disable_adapter() if self.peft is not None else nullcontext():
                yield self.model()
            return
        self.peft.set_adapter(adapter)
        run = self.runs_by_adapter().get(adapter)
        for p in run.params if run is not None else ():   # (set_adapter may freeze them)
            p.requires_grad_(True)
        yield self.peft

    def runs_by_adapter(self) -> dict[str, TrainingRun]:
        return {r.adapter: r for r in self.runs.values()}

    def model(self):
        return self.peft if self.peft is not None else self.base

    @contextmanager
    def use_all(self, adapters: list[str]) -> Iterator[tuple[Any, list[str] | None]]:
        """The model computing rows of several adapters at once, and the adapter names to give
        its forward (None: one adapter, set as the active one; several: peft's mixed-adapter
        forward, each row through its own adapter, every one of them trainable)."""
        if len(set(adapters)) == 1:
            with self.use(adapters[0]) as model:
                yield model, None
            return
        runs = self.runs_by_adapter()
        for name in set(adapters):
            for p in runs[name].params:
                p.requires_grad_(True)
        yield self.peft, adapters

    def error_of(self, req: ForwardBackward) -> WireError | None:
        """What is wrong with a forward_backward request, in one line (None: nothing), found
        before it runs in a batch with other clients' requests."""
        vocab = self.base.get_output_embeddings().weight.shape[0]
        limit = getattr(self.base.config, "max_position_embeddings", None)
        try:
            self.run(req.model_id)
            check_loss(req.loss_fn)
            check_config(req.loss_fn, req.config)
            for i, d in enumerate(req.data):
                check_datum(i, d, needed_inputs(req.loss_fn))
                check_inputs(req.loss_fn, d.inputs)
                check_tokens(i, d, vocab, limit)
        except ValueError as e:      # (WireError, and the losses' own checks)
            return e if isinstance(e, WireError) else WireError(str(e))
        return None

    def forward_backward(self, reqs: list[ForwardBackward]) -> list[tuple[list[Tensor], dict[str, float]] | Exception]:
        """`batch_forward_backward`, and where the batch fails partway: the gradients it added
        taken back, then each request alone, so that only a failing request fails."""
        runs = {r.model_id: self.run(r.model_id) for r in reqs}
        saved = {id(p): (p, None if p.grad is None else p.grad.clone())
                 for run in runs.values() for p in run.params}
        try:
            return self.batch_forward_backward(reqs)
        except Exception as e:
            for p, grad in saved.values():
                p.grad = grad
            if len(reqs) == 1:
                return [e]
        return [self.forward_backward([r])[0] for r in reqs]

    def batch_forward_backward(self, reqs: list[ForwardBackward]) -> list[tuple[list[Tensor], dict[str, float]]]:
        """Each request's datums' target log-probs and {"loss:sum": ...}; gradients added to its
        client's adapter unless `forward_only` (the same for every request of a batch). Requests
        of several clients run as one batch, each row through its own client's adapter: the
        gradient of the sum of their losses is, in each adapter, that adapter's own."""
        adapters = [self.run(r.model_id).adapter for r in reqs]
        rows = [(k, d) for k, r in enumerate(reqs) for d in r.data]
        loss_fns = [check_loss(r.loss_fn) for r in reqs]
        logp: list[list[Tensor]] = [[] for _ in reqs]
        totals = [0.0] * len(reqs)
        with self.use_all(adapters) as (model, names), torch.set_grad_enabled(not reqs[0].forward_only):
            for part in micro_batches(rows):    # (the gradient of a sum: summed part by part)
                part_logp = datum_logprobs(model, [d for _, d in part], self.tokenizer.pad_token_id,
                                           names and [names[k] for k, _ in part])
                losses = [loss_fns[k](lp, d.inputs, reqs[k].config).sum()
                          for (k, d), lp in zip(part, part_logp)]
                if not reqs[0].forward_only:
                    torch.stack(losses).sum().backward()
                for k in sorted({k for k, _ in part}):
                    mine = [j for j, (kj, _) in enumerate(part) if kj == k]
                    logp[k] += [part_logp[j].detach() for j in mine]
                    totals[k] += float(torch.stack([losses[j] for j in mine]).sum().detach())
        return [(lp, {"loss:sum": total}) for lp, total in zip(logp, totals)]

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step of the client's adapter with the request's settings."""
        run = self.run(model_id)
        for group in run.optimizer.param_groups:
            group.update(lr=float(adam.get("learning_rate", 1e-4)),
                         betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                         eps=float(adam.get("eps", 1e-12)),
                         weight_decay=float(adam.get("weight_decay", 0.0)))
        clip = float(adam.get("grad_clip_norm", 0.0)) or math.inf
        norm, stepped = step_if_finite(run.params, run.optimizer, None, clip, SINGLE)
        run.optimizer.zero_grad(set_to_none=True)
        run.steps += int(stepped)
        run.skipped += int(not stepped)
        return {"grad_norm:mean": float(norm), "skipped:sum": float(not stepped)}


def check_datum(i: int, d, needed: tuple[str, ...]) -> None:
    """Every input the loss reads is there, one value per position of the datum."""
    if not d.tokens:
        raise WireError(f"datum {i} has an empty model input")
    for name in needed:
        if name not in d.inputs:
            raise WireError(f"datum {i} has no loss_fn_inputs {name!r} (has {sorted(d.inputs)})")
    for name, t in d.inputs.items():
        if t.reshape(-1).shape[0] != len(d.tokens):
            raise WireError(f"datum {i}: loss_fn_inputs {name!r} has {t.numel()} values for "
                            f"{len(d.tokens)} input tokens (one per position)")


def check_tokens(i: int, d, vocab: int, limit: int | None) -> None:
    """Token ids inside the vocabulary; a datum within the model's positions."""
    ids = [*d.tokens, *d.inputs["target_tokens"].reshape(-1).long().tolist()]
    if min(ids) < 0 or max(ids) >= vocab:
        raise WireError(f"datum {i}: a token id is outside the model's vocabulary (0..{vocab - 1})")
    if limit and len(d.tokens) > limit:
        raise WireError(f"datum {i} has {len(d.tokens)} tokens: over the model's {limit} positions")


MICRO_BATCH_TOKENS = 4096   # padded tokens a forward holds at once (its logits: tokens x vocabulary)


def micro_batches(rows: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
    """The (request, datum) rows in order, in groups of at most MICRO_BATCH_TOKENS padded tokens."""
    parts, part, longest = [], [], 0
    for row in rows:
        longest_with = max(longest, len(row[1].tokens))
        if part and longest_with * (len(part) + 1) > MICRO_BATCH_TOKENS:
            parts.append(part)
            part, longest_with = [], len(row[1].tokens)
        part.append(row)
        longest = longest_with
    return parts + ([part] if part else [])


def datum_logprobs(model, data: list, pad_id: int, adapters: list[str] | None = None) -> list[Tensor]:
    """log pi(target_t | tokens_<=t) for every position of every datum, one padded forward (row
    i through adapter `adapters[i]` where given)."""
    n = max(len(d.tokens) for d in data)
    ids = torch.full((len(data), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(data), n), dtype=torch.long)
    targets = torch.zeros((len(data), n), dtype=torch.long)
    for i, d in enumerate(data):
        ids[i, :len(d.tokens)] = torch.tensor(d.tokens)
        mask[i, :len(d.tokens)] = 1
        targets[i, :len(d.tokens)] = d.inputs["target_tokens"].reshape(-1).long()
    extra = {"adapter_names": adapters} if adapters is not None else {}
    logits = model(input_ids=ids, attention_mask=mask, **extra).logits.float()
    logp = token_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).reshape(ids.shape)
    return [logp[i, :len(d.tokens)] for i, d in enumerate(data)]
