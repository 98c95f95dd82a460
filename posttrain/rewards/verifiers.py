"""Verifiable rewards (RLVR, ALGORITHMS.md §1): a rule checks the answer against the truth."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.data.tasks import Problem, countdown_numbers_used, eval_arithmetic

_math_cache: dict[str, object] = {}


def math_correct(completion: str, problem: Problem) -> bool:
    """Answer equivalence with math-verify (the last answer in the text counts: '41, no, 43' is 43).

    math-verify parses LaTeX and plain expressions and compares them symbolically, so '42',
    '42.0', '$42$' and '\\boxed{42}' all match the gold '42'.
    """
    from math_verify import parse, verify

    gold = _math_cache.get(problem.answer)
    if gold is None:
        gold = _math_cache[problem.answer] = parse(problem.answer)
    pred = parse(completion)
    return bool(pred) and bool(verify(gold, pred))


def exact_correct(completion: str, problem: Problem) -> bool:
    """The whole completion, stripped and case-folded, equals the answer."""
    return completion.strip().casefold() == problem.answer.strip().casefold()


_EXPR = re.compile(r"[\d\s()+\-*/]+")


def countdown_correct(completion: str, problem: Problem) -> bool:
    """The last arithmetic expression in the text uses the given numbers once each and hits the target."""
    text = completion.replace("\\times", "*").replace("×", "*").replace("÷", "/")
    candidates = [m.group(0).strip() for m in _EXPR.finditer(text.split("=")[0] if "=" in text
                                                               else text)]
    candidates = [c for c in candidates if any(op in c for op in "+-*/") and any(ch.isdigit() for ch in c)]
    if not candidates:
        return False
    expr = max(candidates, key=len)
    try:
        value = eval_arithmetic(expr)
        used = countdown_numbers_used(expr)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return False
    return used == sorted(problem.meta["numbers"]) and value == int(problem.answer)


VERIFIERS: dict[str, Callable[[str, Problem], bool]] = {
    "math": math_correct, "exact": exact_correct, "countdown": countdown_correct,
}

_BARE_ANSWER = re.compile(r"^\s*(\\boxed\{)?\s*-?[\d,]+(\.\d+)?\s*\}?\s*\.?\s*$")


def is_bare_answer(completion: str) -> bool:
    """Format check for 'answer with the final number only': the completion is one number."""
    return bool(_BARE_ANSWER.match(completion))


def overlong_penalty(lengths_B: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (ALGORITHMS.md §7), added to the reward.

        0                                  if |y| <= L_max - L_buf
        -penalty * (|y| - (L_max - L_buf)) / L_buf     if L_max - L_buf < |y| <= L_max

    A response cut at L_max gets the full -penalty.
    """
    start = max_len - buffer
    over = (lengths_B.float() - start).clamp(min=0, max=buffer)
    return -penalty * over / buffer
