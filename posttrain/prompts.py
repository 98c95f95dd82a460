"""Prompts as token ids, chat template applied, and left-padded into a batch (the lowest layer:
the sampler, every forward pass, the reward model and every command encode prompts here)."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.data.tasks import Problem


def encode_prompts(tokenizer, problems: list[Problem], system_prompt: str | None,
                   chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt, with the chat template and the generation prompt applied."""
    if not chat_template or tokenizer.chat_template is None:
        return [tokenizer(p.prompt, add_special_tokens=True)["input_ids"] for p in problems]
    out = []
    for p in problems:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": p.prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers: BatchEncoding
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(P, L) ids and mask, padding on the left so every prompt ends at column L-1."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, L - len(p):] = 1
    return ids, mask
