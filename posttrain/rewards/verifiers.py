"""Verifiable rewards (RLVR, docs/algorithms.md §1): a rule checks the answer against the truth."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from posttrain.data.tasks import Problem, countdown_numbers_used, eval_arithmetic

if TYPE_CHECKING:   # (torch is not imported here: the reward sandbox imports this module)
    from torch import Tensor

_math_cache: dict[str, object] = {}


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")
_OPERATOR_BETWEEN_TERMS = re.compile(r"[\w})]\s*[-+*/^×÷]\s*[\w\\({]")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_answer(text: str) -> str | None:
    """The answer a response commits to: the last \\boxed{...}, else the last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_correct(completion: str, problem: Problem) -> bool:
    """Is the response's final answer equivalent to the truth?  Compared with math-verify.

    Only the final answer is compared (`final_answer`): handing math-verify the whole text lets it
    evaluate a restated question, so "To find 45 + 81, we need..." counts as 126. That reward hack
    appeared within 10 GRPO steps here. An answer that is itself an unevaluated expression
    ("45+81") is refused unless the truth is an expression too.
    """
    from math_verify import parse, verify

    answer = final_answer(completion)
    if answer is None:
        return False
    if _OPERATOR_BETWEEN_TERMS.search(answer.replace(",", "")) and not \
            _OPERATOR_BETWEEN_TERMS.search(problem.answer):
        return False
    gold = _math_cache.get(problem.answer)
    if gold is None:
        gold = _math_cache[problem.answer] = parse(problem.answer)
    pred = parse(answer if boxed_free(answer) else f"${answer}$")
    return bool(pred) and bool(verify(gold, pred))


def boxed_free(answer: str) -> bool:
    return "\\" not in answer and "{" not in answer


def exact_correct(completion: str, problem: Problem) -> bool:
    """The whole completion, stripped and case-folded, equals the answer."""
    return completion.strip().casefold() == problem.answer.strip().casefold()


_EXPR = re.compile(r"[\d\s()+\-*/]+")


def countdown_correct(completion: str, problem: Problem) -> bool:
    """The last arithmetic expression in the text uses the given numbers once each and hits the target."""
    text = completion.replace("\\times", "*").replace("×", "*").replace("÷", "/")
    text = re.sub(r"=\s*-?\d+(\.\d+)?", " ", text)     # "(3 * 4) * 2 = 24": keep the left side
    candidates = [m.group(0).strip() for m in _EXPR.finditer(text)]
    candidates = [c for c in candidates if any(op in c for op in "+-*/") and any(ch.isdigit() for ch in c)]
    if not candidates:
        return False
    try:
        value = eval_arithmetic(candidates[-1])
        used = countdown_numbers_used(candidates[-1])
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return False
    return used == sorted(problem.meta["numbers"]) and value == int(problem.answer)


def reasoning_gym_correct(completion: str, problem: Problem) -> bool:
    """reasoning-gym's own `score_answer` (data/gym.py; the optional package is imported then)."""
    from posttrain.data.gym import gym_correct
    return gym_correct(completion, problem)


VERIFIERS: dict[str, Callable[[str, Problem], bool]] = {
    "math": math_correct, "exact": exact_correct, "countdown": countdown_correct,
    "reasoning_gym": reasoning_gym_correct,
}

_BARE_NUMBER = re.compile(r"-?[\d,]+(?:\.\d+)?")


def is_bare_answer(completion: str) -> bool:
    """Format check for 'answer with the final number only': the completion is one number,
    optionally boxed and followed by a full stop (`\\boxed{ 12 } .`). Runs in the trainer's
    process on every answer (reward.format_weight), so it peels the text with string methods and
    one pattern that cannot backtrack: the single regex it replaces took 10 s on 2,000 spaces."""
    text = completion.strip()
    if text.startswith("\\boxed{"):
        text = text[len("\\boxed{"):].lstrip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return _BARE_NUMBER.fullmatch(text) is not None


def overlong_penalty(lengths_B: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (docs/algorithms.md §7), added to the reward.

        0                                  if |y| <= L_max - L_buf
        -penalty * (|y| - (L_max - L_buf)) / L_buf     if L_max - L_buf < |y| <= L_max

    A response cut at L_max gets the full -penalty.
    """
    start = max_len - buffer
    over = (lengths_B.float() - start).clamp(min=0, max=buffer)
    return -penalty * over / buffer
