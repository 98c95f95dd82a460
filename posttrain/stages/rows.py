"""The rows of the offline stages as token ids, TRL's formats rendered (data/formats.py reads them):
a text response is its tokens and EOS, as it always was; a conversational one is what the chat
template writes after the prompt (TRL's apply_chat_template: the prompt and response rendered,
less the prompt with its generation prompt), through its last EOS: the policy's own prompt
format (model/prompts.py) and the tokens the policy would write. An SFT conversation trains on
its assistant messages only; a standard language-modeling text on all its tokens but the first.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.formats import Demonstration, Text
from posttrain.data.tasks import Problem
from posttrain.model.prompts import prompt_messages
from posttrain.stages.common import encode_prompts_of, response_ids


def _render(tokenizer, messages: list[dict[str, str]], generation: bool) -> str:
    if tokenizer.chat_template is None:
        raise ValueError("conversational rows (chat messages) are rendered by the tokenizer's chat "
                         "template, and this tokenizer has none: give text rows, or a model with one")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _head(prompt: Text, system_prompt: str | None) -> list[dict[str, str]]:
    """The prompt's messages as encode_prompts sends them (`system_prompt` first, unless the
    prompt has its own)."""
    problem = Problem(prompt, "") if isinstance(prompt, str) else Problem("", "", messages=prompt)
    return prompt_messages(problem, system_prompt)


def _after(tokenizer, before: list[dict[str, str]], more: list[dict[str, str]]) -> tuple[str, str]:
    """(the text the template adds for `more` after `before`, the whole rendering)."""
    head = _render(tokenizer, before, True)
    whole = _render(tokenizer, before + more, False)
    if not whole.startswith(head):
        raise ValueError("the chat template applied to the prompt and response does not start with "
                         "the template applied to the prompt alone (with its generation prompt); "
                         f"conversational responses need one that does: {head[-60:]!r} vs "
                         f"{whole[-60:]!r}")
    return whole[len(head):], whole


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _through_eos(ids: list[int], eos: int) -> tuple[list[int], list[int]]:
    """(ids through their last EOS, the rest: the template's text after a turn), or (ids, [])."""
    if eos not in ids:
        return ids, []
    cut = len(ids) - ids[::-1].index(eos)
    return ids[:cut], ids[cut:]


def completion_ids(tokenizer, system_prompt: str | None, prompt: Text, completion: Text,
                   max_len: int) -> list[int]:
    """A response's token ids, EOS-terminated, at most `max_len`: text tokenised, or the
    assistant's messages as the chat template writes them after the prompt, through the last EOS."""
    if isinstance(completion, str):
        return response_ids(tokenizer, completion, max_len)
    text, _ = _after(tokenizer, _head(prompt, system_prompt), list(completion))
    said, _ = _through_eos(_ids(tokenizer, text), tokenizer.eos_token_id)
    return response_ids(tokenizer, "", max_len, said)


def scored_ids(tokenizer, system_prompt: str | None, prompt: Text, completion: Text,
               end_of_turn: bool) -> list[int]:
    """A response as a score-head reward model reads one (rewards/model.py::encode_responses):
    its text's tokens, then the template's end-of-turn tokens if `end_of_turn`. A conversational
    response is its chat-template text less a closing end of turn: a single assistant message
    reads as its content, as the policy's answers are read in RLHF."""
    from posttrain.rewards.model import encode_responses, end_of_turn_ids
    if isinstance(completion, str):
        return encode_responses(tokenizer, [completion], end_of_turn)[0]
    text, _ = _after(tokenizer, _head(prompt, system_prompt), list(completion))
    ids, tail = _ids(tokenizer, text), end_of_turn_ids(tokenizer)
    if ids[-len(tail):] == tail:
        ids = ids[:-len(tail)]
    return ids + (tail if end_of_turn else [])


def _conversation(demo: Demonstration, system_prompt: str | None) -> tuple[list[dict[str, str]], int]:
    """The demonstration's messages as sent (`system_prompt` first unless it has its own), and the
    index of the first message after the prompt."""
    head = _head(demo.messages[:demo.start], system_prompt)
    return head + list(demo.messages[demo.start:]), len(head)


def demo_prompt_ids(tokenizer, cfg: Any, demo: Demonstration) -> list[int]:
    """The prompt of an SFT example as the policy is prompted; a text's first token."""
    if demo.text is not None:
        return _ids(tokenizer, demo.text)[:1]
    prompt = demo.prompt if demo.completion is not None else demo.messages[:demo.start]
    return encode_prompts_of(tokenizer, cfg, [prompt])[0]


def demo_response(tokenizer, cfg: Any, demo: Demonstration,
                  ids: list[int] | None = None) -> tuple[list[int], list[int] | None]:
    """(response ids, loss mask or None for all of them) of an SFT example: a completion's tokens
    (`ids`: the teacher's own) and EOS; the rest of a text; a conversation's remaining turns,
    the mask 1 on the assistant messages through their EOS and 0 on the others and on the
    template's text between turns."""
    if demo.completion is not None:
        return response_ids(tokenizer, demo.completion, cfg.max_len, ids), None
    if demo.text is not None:
        rest = _ids(tokenizer, demo.text)[1:]
        if not rest:
            raise ValueError(f"an sft text of one token ({demo.text!r}) has nothing to train on")
        return response_ids(tokenizer, "", cfg.max_len, rest), None
    body, mask = _turns(tokenizer, *_conversation(demo, cfg.data.system_prompt))
    resp = response_ids(tokenizer, "", cfg.max_len, body)
    return resp, mask[:len(resp)] + [1] * (len(resp) - len(mask))   # (an EOS appended: trained)


def _turns(tokenizer, messages: list[dict[str, str]], start: int) -> tuple[list[int], list[int]]:
    """Token ids after the prompt `messages[:start]` up to the last assistant message, with their
    loss mask: each assistant message is what the template adds for it after the generation
    prompt (through its EOS, mask 1); every other message and the template's text between turns
    is context (mask 0)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    done = _render(tokenizer, messages[:start], True)
    for j in range(start, len(messages)):
        if messages[j]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:j], True)
        said, done_next = _after(tokenizer, messages[:j], [messages[j]])
        if not before.startswith(done):
            raise ValueError("the chat template does not render a conversation as the "
                             "concatenation of its turns; sft on 'messages' needs one that does")
        context = _ids(tokenizer, before[len(done):])
        turn, closing = _through_eos(_ids(tokenizer, said), eos)
        ids += context + turn + closing
        mask += [0] * len(context) + [1] * len(turn) + [0] * len(closing)
        done = done_next
    end = len(mask) - mask[::-1].index(1) if 1 in mask else 0   # (after the last answer: no target)
    return ids[:end], mask[:end]

