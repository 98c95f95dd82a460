"""Synthetic preference pairs from the verifiable tasks (docs/algorithms.md §1: reward models learn
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

# Half correct > wrong, a quarter each of the two style kinds. Held-out pairs cycle through the
# pattern below so that any prefix keeps these shares. (Training on 70% correct > wrong instead
# measured 88.0% held-out against 89.0%: the close mistakes do not yield to more of the same data.)
TRAIN_SHARES = (("correct>wrong", 0.5), ("concise>rambling", 0.25), ("answer>no_answer", 0.25))
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


def expression(problem: Problem) -> str:
    """'What is 12 + 34?' -> '12 + 34' (the built-in arithmetic tasks' prompts)."""
    text = problem.prompt.strip()
    if not (text.startswith("What is ") and text.endswith("?")):
        raise ValueError(f"synthetic preferences need 'What is <expression>?' prompts with a "
                         f"numeric answer (tasks 'addition', 'arithmetic'); got {text!r}")
    return text[len("What is "):-1]


def plausible_mistake(answer: int, rng: random.Random, problem: Problem) -> int:
    """A wrong result of the kinds SmolLM2 writes, never the right one.

    The mix follows the wrong answers in the default GRPO run's samples (see docs/ppo-rlhf.md):
    carry slips (off by ten) are the most common, then results that are far off (a wrong
    operation, a digit-wise sum without carries, reversed digits, a random number); off-by-one
    and off-by-two answers are rare.
    """
    a, b = problem.meta.get("a"), problem.meta.get("b")
    far = [answer + 100, answer - 100, rng.randint(max(answer // 2, 0), 2 * answer + 10),
           int(str(abs(answer))[::-1]) if abs(answer) >= 10 else answer + 37]
    if a is not None and b is not None:
        width = len(str(max(a, b)))
        far += [abs(a - b), a * b,
                int("".join(str((int(x) + int(y)) % 10)
                            for x, y in zip(f"{a:0{width}d}", f"{b:0{width}d}")))]
    family = rng.choices(["carry", "far", "near"], weights=[0.4, 0.5, 0.1])[0]
    candidates = {"carry": [answer + 10, answer - 10], "near": [answer + 1, answer - 1, answer + 2],
                  "far": far}[family]
    wrong = [c for c in candidates if c != answer and c >= 0]
    return rng.choice(wrong) if wrong else answer + 10


_TERSE = _CONCISE[:2]   # "{c}", "The answer is {c}.": no working shown


def preference_pair(problem: Problem, kind: str, rng: random.Random,
                    terse_wrong_share: float = 0.0) -> dict[str, Any]:
    e, c = expression(problem), problem.answer
    style = rng.choice(_CONCISE)
    if kind == "correct>wrong":
        w = plausible_mistake(int(c), rng, problem)
        chosen, rejected = style.format(e=e, c=c), style.format(e=e, c=w)
        # Iterated RLHF adds the policy's own hacks as rejected answers; a policy trained on a
        # reward model that never saw a terse wrong answer beside a worded right one drifted to
        # bare numbers ("100" to every question). Same-wording pairs stay the majority: they are
        # the only ones where correctness is all that differs.
        if terse_wrong_share > 0 and rng.random() < terse_wrong_share:
            w = plausible_mistake(int(c), rng, problem)
            rejected = rng.choice(_TERSE).format(e=e, c=w)
    elif kind == "concise>rambling":
        chosen = style.format(e=e, c=c)
        rejected = f"{rng.choice(_FILLER)} {rng.choice(_CONCISE[1:]).format(e=e, c=c)}"
    elif kind == "answer>no_answer":
        chosen, rejected = style.format(e=e, c=c), rng.choice(_NO_ANSWER)
    else:
        raise ValueError(f"unknown preference kind {kind!r}")
    return {"prompt": problem.prompt, "chosen": chosen, "rejected": rejected, "kind": kind}


def synthetic_preferences(task: Task, n: int, seed: int = 0, held_out: bool = False,
                          terse_wrong_share: float = 0.0) -> list[dict[str, Any]]:
    """`n` pairs on training problems (or on the held-out problems, cycled, if held_out: those
    always keep one wording for both answers, so held-out accuracy measures one thing)."""
    rng = random.Random(f"preferences-{seed}-{held_out}")
    kinds = [k for k, share in TRAIN_SHARES for _ in range(round(share * 100))]
    rows = []
    for i in range(n):
        problem = (task.eval_problems[i % len(task.eval_problems)] if held_out
                   else task.train_problem(seed, i))
        kind = _HELD_OUT_CYCLE[i % len(_HELD_OUT_CYCLE)] if held_out else rng.choice(kinds)
        rows.append(preference_pair(problem, kind, rng, 0.0 if held_out else terse_wrong_share))
    return rows
