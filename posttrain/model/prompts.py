"""Prompts as token ids, chat template applied, and left-padded into a batch (the lowest layer:
the sampler, every forward pass, the reward model and every command encode prompts here); and the
tokens of an environment's message in the middle of an episode (`ReplyEncoder`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posttrain.data.tasks import Problem


def prompt_messages(problem: Problem, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat messages of a problem: its own (a conversational row) or one user message, after
    `system_prompt` unless the row brings its own system message."""
    messages = list(problem.messages) if problem.messages else [{"role": "user", "content": problem.prompt}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # newer transformers: BatchEncoding
        out = out["input_ids"]
    return list(out)


def encode_prompts(tokenizer, problems: list[Problem], system_prompt: str | None,
                   chat_template: bool = True, template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[list[int]]:
    """Token ids of each prompt, with the chat template and the generation prompt applied
    (`template_kwargs`: the template's extra arguments, e.g. enable_thinking; `tools`: function
    schemas for templates that render tools)."""
    if not chat_template or tokenizer.chat_template is None:
        return [tokenizer(_plain(p), add_special_tokens=True)["input_ids"] for p in problems]
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    return [_ids(tokenizer.apply_chat_template(prompt_messages(p, system_prompt),
                                               add_generation_prompt=True, tokenize=True, **extra))
            for p in problems]


def _plain(p: Problem) -> str:
    """A prompt for a model without a chat template: the messages' text, one per line."""
    if not p.messages:
        return p.prompt
    return "\n".join(m.get("content", "") for m in p.messages)


class ReplyEncoder:
    """The tokens that follow a policy turn when the environment answers with `message`: the end
    of the assistant's turn as the chat template writes it (minus the EOS the policy already
    wrote), the message, and the next generation prompt.

    Found once per role by rendering a two-message conversation with and without the extra
    message and taking the difference of the texts, so it works with any template that renders
    a conversation as the concatenation of its turns (ChatML, Llama 3, Qwen, Hermes, ...). A
    template that refuses the role (some only accept alternating user/assistant) is reported
    with its own error, never replaced by a made-up format. Without a chat template a message
    is its text on its own lines."""

    _MARK = "\u2063ANSWER\u2063"

    def __init__(self, tokenizer, chat_template: bool = True,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.templated = chat_template and tokenizer.chat_template is not None
        self.kwargs = dict(template_kwargs or {})
        self.eos_text = tokenizer.eos_token or ""
        self._parts: dict[str, tuple[str, str, str]] = {}

    def _render(self, messages, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation, **self.kwargs)

    def _template_parts(self, role: str) -> tuple[str, str, str]:
        """(closing of an assistant turn, text before a `role` message's content, text after
        it up to and including the next generation prompt)."""
        if role not in self._parts:
            base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": self._MARK}]
            before = self._render(base, False)
            try:
                after = self._render(base + [{"role": role, "content": self._MARK}], True)
            except Exception as e:  # noqa: BLE001 - jinja raises whatever the template raises
                raise ValueError(
                    f"the chat template raised on a {role!r} message after an assistant turn "
                    f"({type(e).__name__}: {e}); the environment's replies need a template that "
                    f"renders that role (a tokenizer whose template takes it), or an environment "
                    f"that replies as 'user'") from None
            if not after.startswith(before):
                raise ValueError("the chat template does not render a conversation as the "
                                 "concatenation of its turns; multi-turn episodes need one that does")
            closing = before[before.rindex(self._MARK) + len(self._MARK):]
            head, _, tail = after[len(before):].partition(self._MARK)
            self._parts[role] = (closing, head, tail)
        return self._parts[role]

    def encode(self, message: dict[str, str], policy_wrote_eos: bool) -> list[int]:
        content = message.get("content", "")
        if not self.templated:
            text = f"\n{content}\n"
        else:
            closing, head, tail = self._template_parts(message.get("role", "user"))
            if policy_wrote_eos and self.eos_text and closing.startswith(self.eos_text):
                closing = closing[len(self.eos_text):]
            text = closing + head + content + tail
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_messages(self, messages: list[dict[str, Any]], policy_wrote_eos: bool) -> list[int]:
        """The tokens after a policy turn when the environment answers with several messages
        (tool results, then a user message): rendered after a marked assistant turn, taken from
        the mark on, the same way as `encode` takes one message."""
        if len(messages) == 1:
            return self.encode(messages[0], policy_wrote_eos)
        if not self.templated:
            return self.tokenizer("".join(f"\n{m.get('content', '')}\n" for m in messages),
                                  add_special_tokens=False)["input_ids"]
        self._template_parts(messages[0].get("role", "user"))   # (a role it refuses: its error)
        base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": self._MARK}]
        before, after = self._render(base, False), self._render(base + list(messages), True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render a conversation as the "
                             "concatenation of its turns; multi-turn episodes need one that does")
        text = after[before.rindex(self._MARK) + len(self._MARK):]
        if policy_wrote_eos and self.eos_text and text.startswith(self.eos_text):
            text = text[len(self.eos_text):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def cut(self, content: str, limit: int) -> str:
        """`content` cut to at most `limit` tokens (an environment's long output)."""
        ids = self.tokenizer(content, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return content
        return self.tokenizer.decode(ids[:limit]) + " ...(cut)"


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


def common_prefix_length(prompt_ids: Tensor, prompt_mask: Tensor) -> int:
    """How many leading tokens all these left-padded prompts share, keeping at least one token
    of each prompt outside it (its hidden state predicts the first response token)."""
    lengths = prompt_mask.sum(-1)
    shortest = int(lengths.min())
    if shortest < 2:
        return 0
    cols = (prompt_ids.shape[1] - lengths)[:, None] + torch.arange(shortest - 1,
                                                                   device=prompt_ids.device)
    aligned = prompt_ids.gather(1, cols)                               # each prompt from its start
    return int((aligned == aligned[:1]).all(0).long().cumprod(0).sum())


def after_shared_prefix(prompt_ids: Tensor, prompt_mask: Tensor,
                        k: int) -> tuple[Tensor, int, Tensor]:
    """Layout of left-padded prompts whose k shared leading tokens run once as one row:
    (prefix (1, k), cut, mask). The rest of every prompt lies in `prompt_ids[:, cut:]` (the
    longest prompt's rest starts at `cut`; a shorter one's columns there before its rest hold pad
    or prefix tokens), and `mask` (P, k + L - cut) is the attention mask over [the k prefix tokens,
    those columns]."""
    L, lengths = prompt_ids.shape[1], prompt_mask.sum(-1)
    start = L - int(lengths[0])
    cut = L - int(lengths.max()) + k
    cols = torch.arange(cut, L, device=prompt_mask.device)
    rest = prompt_mask[:, cut:] * (cols[None] >= (L - lengths + k)[:, None])
    mask = torch.cat([torch.ones(len(prompt_ids), k, dtype=prompt_mask.dtype,
                                 device=prompt_mask.device), rest], dim=1)
    return prompt_ids[:1, start:start + k], cut, mask
