"""Forward passes on (prompt + response): the one place a model reads a batch of responses.

The policy's log-probs, the reference's and teachers' log-probs, and the value model's V(x, y_<t)
all come from `response_hidden`: the prefix every prompt shares runs once per micro-batch, the rest
of each prompt once per group of responses, and only response positions reach a head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from transformers import DynamicCache

from posttrain.losses.common import entropy_from_logits, token_logprobs
from posttrain.model.loading import decoder_and_head
from posttrain.model.prompts import after_shared_prefix, common_prefix_length, left_pad
from posttrain.rollout import Rollout
from posttrain.rollout.hf import cache_kwarg

# ---------------------------------------------------------------------------------------------

def pack(tokenizer, prompts: list[list[int]], responses: list[list[int]],
         device: torch.device | str = "cpu", policy_masks: list[list[int]] | None = None) -> Rollout:
    """Prompt ids left-padded, response ids right-padded: the layout the trainer's forward uses
    (`policy_masks`: episodes, 1 on the policy's tokens and 0 on the environment's)."""
    p_ids, p_mask = left_pad(prompts, tokenizer.pad_token_id)
    T = max(len(r) for r in responses)
    r_ids = torch.full((len(responses), T), tokenizer.pad_token_id, dtype=torch.long)
    r_mask = torch.zeros((len(responses), T))
    for i, r in enumerate(responses):
        r_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        r_mask[i, :len(r)] = 1.0
    policy = None
    if policy_masks is not None:
        policy = torch.zeros((len(responses), T))
        for i, m in enumerate(policy_masks):
            policy[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
        policy = policy.to(device)
    return Rollout(p_ids.to(device), p_mask.to(device), r_ids.to(device), r_mask.to(device),
                   torch.zeros_like(r_mask, device=device),
                   torch.zeros(len(responses), dtype=torch.bool, device=device), group_size=1,
                   policy_mask_B_T=policy)


def group_chunks(n_rows: int, group_size: int, max_rows: int) -> list[Tensor]:
    """Split row indices 0..n-1 into micro-batches of whole groups, at most max(max_rows, G) rows."""
    per_chunk = max(max_rows // group_size, 1) * group_size
    return list(torch.arange(n_rows).split(per_chunk)) if n_rows else []


def micro_rows(optim, rollout: Rollout) -> int:
    """Rows per micro-batch of this rollout's forward passes (OptimConfig.micro_rows: at most
    optim.micro_batch_size rows and optim.micro_batch_tokens decoder positions)."""
    return optim.micro_rows(rollout.prompt_ids_B_L.shape[1], rollout.response_ids_B_T.shape[1],
                            rollout.group_size)


def _autocast(device_type: str, mode: str):
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=mode == "bfloat16")


def response_hidden(decoder, rollout: Rollout, rows: Tensor | slice = slice(None), *,
                    autocast: str = "none") -> Tensor:
    """Hidden states that predict each response token of `rows` (whole groups; default: all) of
    `rollout`, i.e. of the state (x, y_<t): (b, T, H).

    Rows come in whole groups of `rollout.group_size` responses to one prompt. The prompt is run
    once per group and its KV cache repeated for the group's responses, with gradients flowing
    through both (the same sharing the sampler uses); the leading tokens all prompts share (a chat
    template's system turn) run once for the whole micro-batch. With G = 4, a 40-token prompt of
    which 30 are shared, and 13-token answers, a micro-batch of 16 groups runs 30 + 16 x 10 +
    64 x 13 = 1022 tokens, against 16 x 40 + 64 x 13 = 1472 with the prompt shared per group only
    and 64 x 53 = 3392 with nothing shared. With autocast='bfloat16' the body runs in bf16 (about
    1.8x faster on an AVX512-BF16 CPU); the result is returned in float32 so heads keep full
    precision.
    The LM head turns these into logits, a value head into V(x, y_<t) (§5).
    """
    G, device_type = rollout.group_size, rollout.prompt_ids_B_L.device.type
    if getattr(decoder, "gradient_checkpointing", False) and decoder.training:
        # recomputation in backward cannot share a KV cache: one full-sequence pass per row
        return _full_sequence_hidden(decoder, rollout, rows, autocast)
    p_ids, p_mask = rollout.prompt_ids_B_L[rows][::G], rollout.prompt_mask_B_L[rows][::G]   # (n, L)
    if p_ids.shape[1] == 1:   # one-token prompts: a masked column in front keeps three passes
        p_ids, p_mask = torch.cat([p_ids, p_ids], 1), torch.cat([torch.zeros_like(p_mask), p_mask], 1)
    L = p_ids.shape[1]
    k = common_prefix_length(p_ids, p_mask)
    # Three passes over one growing KV cache, gradients through all of it: the prefix every
    # prompt shares (a chat template's system turn: 27 of the 40 prompt tokens of the default
    # task) once, each group's rest of the prompt once, then every response. With no shared
    # prefix the first pass takes the first column row by row instead, so the number of decoder
    # calls never depends on the data (FSDP2 ranks must make the same calls).
    cache = DynamicCache()
    with _autocast(device_type, autocast):
        first, cut, mask = _first_pass(decoder, p_ids, p_mask, k, cache)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        prompt_out = decoder(input_ids=p_ids[:, cut:], attention_mask=mask,
                             position_ids=pos[:, mask.shape[1] - (L - cut):], use_cache=True,
                             **{cache_kwarg(decoder): cache})
        hidden = _response_pass(decoder, cache, prompt_out.last_hidden_state, mask,
                                rollout, rows)                              # (b, T, H)
        # The first pass reaches the loss only through its KV cache. FSDP2 gathers a layer's
        # weights for backward when a gradient reaches that layer's *output*, so its output joins
        # the graph with weight 0 (otherwise the last layer's weights are gone in backward); the
        # state taken is a real token's (row 0 of the prefix, or the longest prompt's first one).
        row = 0 if k else int(p_mask.sum(-1).argmax())
        hidden = hidden + 0.0 * first.last_hidden_state[row, :1, :1].sum()
    return hidden.float() if autocast != "none" else hidden


def _response_pass(decoder, cache: DynamicCache, prompt_h: Tensor, mask: Tensor, rollout: Rollout,
                   rows: Tensor | slice) -> Tensor:
    """Every response of `rows` after its group's prompt: the prompt's cache (attention `mask`,
    whose sum is each prompt's length: where its responses' positions start) repeated G times,
    the responses run through it; the states that predict each response token, (b, T, H): the
    prompt's last state, then every response state but the last."""
    G = rollout.group_size
    response_ids, response_mask = rollout.response_ids_B_T[rows], rollout.response_mask_B_T[rows]
    T = response_ids.shape[1]
    last_prompt_h = prompt_h[:, -1:].repeat_interleave(G, 0)             # (b, 1, H)
    cache.batch_repeat_interleave(G)
    r_pos = mask.sum(-1).repeat_interleave(G)[:, None] + torch.arange(T, device=response_ids.device)
    mask = torch.cat([mask.repeat_interleave(G, 0), response_mask.to(mask.dtype)], dim=1)
    resp_h = decoder(input_ids=response_ids, attention_mask=mask, position_ids=r_pos,
                     use_cache=True, **{cache_kwarg(decoder): cache}).last_hidden_state
    return torch.cat([last_prompt_h, resp_h[:, :-1]], dim=1)


def _first_pass(decoder, p_ids: Tensor, p_mask: Tensor, k: int, cache: DynamicCache):
    """The first of response_hidden's passes into `cache`: the `k` tokens every prompt shares,
    once (the cache then repeated for each prompt), or with no shared prefix the first column row
    by row. Returns its output, where the prompts' own tokens start, and their attention mask."""
    if k:
        prefix, cut, mask = after_shared_prefix(p_ids, p_mask, k)
        first = decoder(input_ids=prefix, use_cache=True,
                        position_ids=torch.arange(k, device=p_ids.device)[None],
                        **{cache_kwarg(decoder): cache})
        cache.batch_repeat_interleave(p_ids.shape[0])
        return first, cut, mask
    first = decoder(input_ids=p_ids[:, :1], attention_mask=p_mask[:, :1],
                    position_ids=torch.zeros_like(p_mask[:, :1]), use_cache=True,
                    **{cache_kwarg(decoder): cache})
    return first, 1, p_mask


def _full_sequence_hidden(decoder, rollout: Rollout, rows: Tensor | slice, autocast: str) -> Tensor:
    """The same hidden states from one pass over [prompt, response] per row (no cache)."""
    prompt_ids, prompt_mask = rollout.prompt_ids_B_L[rows], rollout.prompt_mask_B_L[rows]
    response_ids, response_mask = rollout.response_ids_B_T[rows], rollout.response_mask_B_T[rows]
    L, T = prompt_ids.shape[1], response_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with _autocast(prompt_ids.device.type, autocast):
        h = decoder(input_ids=ids, attention_mask=mask, position_ids=pos,
                    use_cache=False).last_hidden_state[:, L - 1:L + T - 1]
    return h.float() if autocast != "none" else h


def response_logits(model, rollout: Rollout, rows: Tensor | slice = slice(None), *,
                    autocast: str = "none") -> Tensor:
    """Logits predicting each response token of `rows` (whole groups; default: all): (b, T, V).
    Only response positions reach the LM head, which runs in float32 even under bf16 autocast,
    so log-probs keep full precision."""
    decoder, head = decoder_and_head(model)
    hidden = response_hidden(decoder, rollout, rows, autocast=autocast)
    with torch.autocast(rollout.prompt_ids_B_L.device.type, enabled=False):
        return head(hidden)


class PolicyForward(NamedTuple):
    logp: Tensor                    # (b, T) log pi(y_t | x, y_<t) at the sampling temperature
    entropy: Tensor | None          # (b, T) entropy of each position's distribution
    logits: Tensor | None           # (b, T, V), when asked for (exact distillation)
    hidden: Tensor | None           # (b, T, H), when asked for (a value head on the policy body)


def sequence_logprobs(model, rollout: Rollout, rows: Tensor, temperature: float, *,
                      with_entropy: bool = False, autocast: str = "none", keep_logits: bool = False,
                      keep_hidden: bool = False, entropy_grad: bool = False) -> PolicyForward:
    """log pi(y_t | x, y_<t) for the response tokens of `rows` (whole groups), at the sampling
    temperature; optionally the entropy of each position's distribution (with its gradient when
    `entropy_grad`: an entropy bonus in the loss), the logits and the hidden states."""
    decoder, head = decoder_and_head(model)
    hidden = response_hidden(decoder, rollout, rows, autocast=autocast)
    with torch.autocast(hidden.device.type, enabled=False):
        logits = head(hidden)
    logp = token_logprobs(logits, rollout.response_ids_B_T[rows], temperature)
    entropy = None
    if with_entropy and entropy_grad:
        entropy = entropy_from_logits(logits, temperature)
    elif with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach(), temperature)
    return PolicyForward(logp, entropy, logits if keep_logits else None,
                         hidden if keep_hidden else None)


@torch.no_grad()
def frozen_logprobs(model, rollout: Rollout, temperature: float, micro: int,
                    autocast: str = "none") -> Tensor:
    """Log-probs under a frozen model (pi_ref, or pi_old recomputed), in micro-batches."""
    parts = []
    for rows in group_chunks(len(rollout.truncated_B), rollout.group_size, micro):
        parts.append(sequence_logprobs(model, rollout, rows, temperature, autocast=autocast).logp)
    return torch.cat(parts) * rollout.response_mask_B_T


