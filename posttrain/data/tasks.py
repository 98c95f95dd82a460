"""Verifiable tasks: procedurally generated problems with a checkable answer, plus user files.

Every built-in task has a difficulty knob, an infinite training stream that is a pure function of
(seed, index) (so a checkpoint resumes it exactly by storing the index), and a held-out evaluation
set drawn from a fixed seed and excluded from training.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from posttrain.util.registry import Registry


@dataclass(frozen=True)
class Problem:
    prompt: str                         # the user message (chat template applied later)
    answer: str                         # ground truth for the verifier
    meta: dict[str, Any] = field(default_factory=dict)   # task details / a file row's other columns
    domain: str = "default"
    # a conversational prompt (TRL's format: [{"role": "user", "content": ...}, ...]): encoded as
    # these messages; `prompt` then holds the last user message's text
    messages: tuple[dict[str, str], ...] | None = None


@dataclass
class Task:
    """A problem source plus how to check an answer."""

    name: str
    make_problem: Callable[[random.Random], Problem]
    verifier: str = "math"              # 'math' (math-verify), 'exact', or 'countdown'
    key: Callable[[Problem], Any] = lambda p: p.prompt   # identity used to keep eval out of train
    eval_problems: list[Problem] = field(default_factory=list)
    train_pool: list[Problem] | None = None  # file tasks: a finite pool, cycled by index
    environment: str = "single_turn"    # the environment `env.name: auto` picks (posttrain/envs)

    def build_eval(self, size: int, seed: int) -> None:
        if self.train_pool is not None and self.eval_problems:
            return  # file tasks come with their own held-out split
        rng = random.Random(f"eval-{seed}")
        seen: set = set()
        problems: list[Problem] = []
        attempts = 0
        while len(problems) < size:
            p = self.make_problem(rng)
            attempts += 1
            if self.key(p) in seen:
                if attempts > 100 * size:
                    raise ValueError(f"task {self.name!r} cannot produce {size} distinct problems")
                continue
            seen.add(self.key(p))
            problems.append(p)
        self.eval_problems = problems
        self._eval_keys = seen

    def train_problem(self, seed: int, index: int) -> Problem:
        """Problem number `index` of the training stream: never one of the held-out problems."""
        if self.train_pool is not None:
            order = random.Random(f"{seed}-{index // len(self.train_pool)}").sample(
                range(len(self.train_pool)), len(self.train_pool))
            return self.train_pool[order[index % len(self.train_pool)]]
        keys = getattr(self, "_eval_keys", set())
        rng = random.Random(f"train-{seed}-{index}")
        for _ in range(1000):
            p = self.make_problem(rng)
            if self.key(p) not in keys:
                return p
        raise ValueError(f"task {self.name!r}: the held-out set covers the whole problem space")


TASKS: Registry[Callable[[int], Task]] = Registry("task")


# ---------------------------------------------------------------------------------------------
# Integer arithmetic
# ---------------------------------------------------------------------------------------------

def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def has_carry(a: int, b: int) -> bool:
    """Whether adding a and b carries in any column (the weak spot the issue asks to report)."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


@TASKS.register("addition")
def addition_task(difficulty: int = 2) -> Task:
    """a + b with `difficulty`-digit operands (2: a, b in 10..99)."""
    if difficulty < 1:
        raise ValueError(f"data.difficulty={difficulty} must be >= 1 digit")

    def make(rng: random.Random) -> Problem:
        a, b = _operand(rng, difficulty), _operand(rng, difficulty)
        return Problem(f"What is {a} + {b}?", str(a + b), {"a": a, "b": b, "carry": has_carry(a, b)})
    return Task("addition", make)


@TASKS.register("subtraction")
def subtraction_task(difficulty: int = 2) -> Task:
    """a - b with `difficulty`-digit operands and a >= b (2: 10..99), so the result is >= 0."""
    if difficulty < 1:
        raise ValueError(f"data.difficulty={difficulty} must be >= 1 digit")

    def make(rng: random.Random) -> Problem:
        a, b = sorted((_operand(rng, difficulty), _operand(rng, difficulty)), reverse=True)
        return Problem(f"What is {a} - {b}?", str(a - b),
                       {"a": a, "b": b, "borrow": any(x < y for x, y in zip(_digits(a), _digits(b)))})
    return Task("subtraction", make)


def _digits(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


@TASKS.register("multiplication")
def multiplication_task(difficulty: int = 2) -> Task:
    """a * b with `difficulty`-digit operands (2: a, b in 10..99); the calculator environment's
    task (docs/environments.md): SmolLM2-135M-Instruct alone gets almost none right."""
    if difficulty < 1:
        raise ValueError(f"data.difficulty={difficulty} must be >= 1 digit")

    def make(rng: random.Random) -> Problem:
        a, b = _operand(rng, difficulty), _operand(rng, difficulty)
        return Problem(f"What is {a} * {b}?", str(a * b), {"a": a, "b": b})
    return Task("multiplication", make)


@TASKS.register("guess_number")
def guess_number_task(difficulty: int = 10) -> Task:
    """Find a secret integer in 1..difficulty from 'Higher.' / 'Lower.' replies (the
    'guess_number' environment: several turns, reward 1 when found). The held-out set is the
    same secrets drawn from another seed (there are only `difficulty` problems)."""
    if difficulty < 2:
        raise ValueError(f"data.difficulty={difficulty}: guess_number needs a range of at least 2")

    def make(rng: random.Random) -> Problem:
        secret = rng.randint(1, difficulty)
        return Problem(f"I am thinking of an integer from 1 to {difficulty}. Guess it: answer with "
                       "one number, and I will tell you if my number is higher or lower.",
                       str(secret), {"secret": secret})
    # a key equal to nothing: every secret may appear in both splits (the episodes differ)
    return Task("guess_number", make, verifier="none", environment="guess_number",
                key=lambda p: object())


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@TASKS.register("arithmetic")
def arithmetic_task(difficulty: int = 2) -> Task:
    """Two-step integer expressions `a op b op c` with + - *, operands of `difficulty` digits."""
    def make(rng: random.Random) -> Problem:
        a, b, c = (_operand(rng, difficulty) for _ in range(3))
        o1, o2 = rng.choice("+-*"), rng.choice("+-")
        value = eval_arithmetic(f"{a} {o1} {b} {o2} {c}")
        return Problem(f"What is {a} {o1} {b} {o2} {c}?", str(int(value)), {"ops": o1 + o2})
    return Task("arithmetic", make)


# ---------------------------------------------------------------------------------------------
# Countdown: reach a target with given numbers and + - * /
# ---------------------------------------------------------------------------------------------

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def eval_arithmetic(expr: str) -> Fraction:
    """Exact value of an expression of integers, + - * / and parentheses; anything else raises.
    Hand-written (ast walk) because `eval` on model output is unsafe."""
    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError("division by zero")
            return Fraction(_BIN[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"not allowed in an arithmetic expression: {ast.dump(node)[:40]}")
    if len(expr) > 200:
        raise ValueError("expression too long")
    return walk(ast.parse(expr.strip(), mode="eval"))


def countdown_numbers_used(expr: str) -> list[int]:
    return sorted(n.value for n in ast.walk(ast.parse(expr, mode="eval"))
                  if isinstance(n, ast.Constant) and isinstance(n.value, int))


@TASKS.register("countdown")
def countdown_task(difficulty: int = 3) -> Task:
    """Combine `difficulty` numbers (1..25), each used once, with + - * / to reach the target."""
    if difficulty < 2:
        raise ValueError(f"data.difficulty={difficulty}: countdown needs at least 2 numbers")

    def make(rng: random.Random) -> Problem:
        while True:
            nums = [rng.randint(1, 25) for _ in range(difficulty)]
            expr = str(nums[0])
            for n in nums[1:]:
                expr = f"({expr} {rng.choice('+-*/')} {n})"
            try:
                value = eval_arithmetic(expr)
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and 0 < value <= 1000:
                break
        shown = sorted(nums)
        prompt = (f"Using the numbers {shown}, each exactly once, and + - * / with parentheses, "
                  f"write an expression equal to {int(value)}.")
        return Problem(prompt, str(int(value)), {"numbers": shown, "solution": expr})
    return Task("countdown", make, verifier="countdown", key=lambda p: p.prompt)


class MixedTask(Task):
    """Several tasks interleaved (problem i comes from task i mod k); each problem's domain is its
    task's name and it carries its own verifier, so one run can train (MOPD) on all of them."""

    def __init__(self, tasks: list[Task]) -> None:
        super().__init__("+".join(t.name for t in tasks), tasks[0].make_problem)
        self.tasks = tasks

    def _tag(self, task: Task, p: Problem) -> Problem:
        return Problem(p.prompt, p.answer, {**p.meta, "verifier": task.verifier}, task.name)

    def build_eval(self, size: int, seed: int) -> None:
        k = len(self.tasks)
        self.eval_problems = []
        for j, task in enumerate(self.tasks):
            task.build_eval(size // k + (j < size % k), seed)
            self.eval_problems += [self._tag(task, p) for p in task.eval_problems]

    def train_problem(self, seed: int, index: int) -> Problem:
        task = self.tasks[index % len(self.tasks)]
        return self._tag(task, task.train_problem(seed, index // len(self.tasks)))


def make_task(name: str, difficulty: int) -> Task:
    return TASKS[name](difficulty)
