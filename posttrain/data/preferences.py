"""Synthetic preference pairs from the verifiable tasks (ALGORITHMS.md §1: reward models learn
from comparisons; here the comparisons are made from ground truth, so a reward model's accuracy
and an RLHF run's reward hacking can both be measured against the verifier).

Three kinds of pair, each (prompt, chosen, rejected):
- correct > wrong:      the same wording, once with the right result and once with a plausible
                        mistake (off by one or ten, a dropped carry, a wrong operation);
- concise > rambling:   both correct, one answers directly, one pads with filler first;
- answer > no answer:   a correct answer against a response that never gives one.
Held-out pairs are built on the task's held-out problems, so prompts never overlap training.
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.data.tasks import Problem, Task

KIND_SHARES = (("correct>wrong", 0.5), ("concise>rambling", 0.25), ("answer>no_answer", 0.25))
# held-out pairs cycle through this pattern, so any prefix keeps the shares above
_HELD_OUT_CYCLE = ("correct>wrong", "concise>rambling", "correct>wrong", "answer>no_answer")

_CONCISE = ["{c}", "The answer is {c}.", "{e} = {c}", "{e} = {c}.", "{e} equals {c}.",
            "The result of {e} is {c}.", "To find {e}, we add the numbers: {e} = {c}.",
            "Sure! {e} = {c}."]
_FILLER = ["Let me think about this step by step, because arithmetic deserves care and it is easy "
           "to make a small mistake when working quickly.",
           "This is a classic arithmetic question. Arithmetic is the branch of mathematics that "
           "deals with numbers and the basic operations on them, such as addition.",
           "Great question! Before answering, it is worth remembering that we should line up the "
           "digits and work from the rightmost column to the left, carrying when needed.",
           "To answer this, I will first restate the problem, then consider the place values of "
           "each number, and finally combine them into a single result."]
_NO_ANSWER = ["I'm not sure how to solve this problem.",
              "To calculate this, we need to understand what the operation means. It is one of the",
              "This is a simple calculation, but let me first explain the method we will use in",
              "Arithmetic problems like this can be solved in many ways, for example by counting",
              "I cannot answer that question."]


def _expression(problem: Problem) -> str:
    text = problem.prompt.strip()
    if not (text.startswith("What is ") and text.endswith("?")):
        raise ValueError(f"synthetic preferences need 'What is <expression>?' prompts with a "
                         f"numeric answer (tasks 'addition', 'arithmetic'); got {text!r}")
    return text[len("What is "):-1]


def plausible_mistake(answer: int, rng: random.Random, problem: Problem) -> int:
    """A wrong result a model could plausibly write: never the right one."""
    a, b = problem.meta.get("a"), problem.meta.get("b")
    candidates = [answer + 1, answer - 1, answer + 10, answer - 10, answer + 2, answer + 100,
                  int(str(abs(answer))[::-1]) if abs(answer) >= 10 else answer + 3]
    if a is not None and b is not None:
        candidates += [abs(a - b), a + b - 10 if a + b >= 10 else a + b + 10,
                       int("".join(str((int(x) + int(y)) % 10) for x, y in
                                   zip(f"{a:0{len(str(max(a, b)))}d}", f"{b:0{len(str(max(a, b)))}d}")))]
    wrong = [c for c in candidates if c != answer and c >= 0]
    return rng.choice(wrong) if wrong else answer + 1


def preference_pair(problem: Problem, kind: str, rng: random.Random) -> dict[str, Any]:
    e, c = _expression(problem), problem.answer
    style = rng.choice(_CONCISE)
    if kind == "correct>wrong":
        w = plausible_mistake(int(c), rng, problem)
        chosen, rejected = style.format(e=e, c=c), style.format(e=e, c=w)
    elif kind == "concise>rambling":
        chosen = style.format(e=e, c=c)
        rejected = f"{rng.choice(_FILLER)} {rng.choice(_CONCISE[1:]).format(e=e, c=c)}"
    elif kind == "answer>no_answer":
        chosen, rejected = style.format(e=e, c=c), rng.choice(_NO_ANSWER)
    else:
        raise ValueError(f"unknown preference kind {kind!r}")
    return {"prompt": problem.prompt, "chosen": chosen, "rejected": rejected, "kind": kind}


def synthetic_preferences(task: Task, n: int, seed: int = 0, held_out: bool = False
                          ) -> list[dict[str, Any]]:
    """`n` pairs on training problems (or on the held-out problems, cycled, if held_out)."""
    rng = random.Random(f"preferences-{seed}-{held_out}")
    kinds = [k for k, share in KIND_SHARES for _ in range(round(share * 100))]
    rows = []
    for i in range(n):
        problem = (task.eval_problems[i % len(task.eval_problems)] if held_out
                   else task.train_problem(seed, i))
        kind = _HELD_OUT_CYCLE[i % len(_HELD_OUT_CYCLE)] if held_out else rng.choice(kinds)
        rows.append(preference_pair(problem, kind, rng))
    return rows
