"""reasoning-gym's procedural tasks as a data source (optional: pip install 'posttrain[gym]').

    posttrain train --data.task reasoning_gym:leg_counting --data.task_options '{max_animals: 3}'

Problems are generated offline from the library (no download): the held-out set from
`data.eval_seed`, the training pool (`data.train_size` problems) from another seed with every
question of the held-out set removed, so the two are disjoint. Answers are scored by the task's own
`score_answer` (verifier 'reasoning_gym'): a response is correct when it scores 1.
"""

from __future__ import annotations

import ast
import functools
import re
from fractions import Fraction
from typing import Any

from posttrain.data.tasks import Problem, Task


def _library():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("data.task='reasoning_gym:NAME' needs the optional package reasoning-gym: "
                         "pip install 'posttrain[gym]'") from None
    return reasoning_gym


def reasoning_gym_task(name: str, options: dict[str, Any], eval_size: int, eval_seed: int,
                       train_size: int) -> Task:
    rg = _library()
    try:
        held = rg.create_dataset(name, seed=eval_seed, size=max(eval_size, 1), **options)
    except (KeyError, ValueError, TypeError, AssertionError) as e:
        known = sorted(getattr(rg.factory, "DATASETS", {}))
        raise ValueError(f"data.task='reasoning_gym:{name}' with data.task_options={options}: "
                         f"{type(e).__name__}: {e}" + (f"; tasks: {known[:60]}" if name not in known else "")) from None
    eval_problems = [_problem(name, entry) for entry in held][:eval_size]
    seen = {p.prompt for p in eval_problems}
    pool = [p for p in (_problem(name, e) for e in
                        rg.create_dataset(name, seed=eval_seed + 1, size=train_size, **options))
            if p.prompt not in seen]
    if not pool:
        raise ValueError(f"reasoning_gym:{name}: every training problem is in the held-out set; "
                         "raise data.train_size or widen data.task_options")
    return Task(f"reasoning_gym:{name}", lambda rng: pool[0], verifier="reasoning_gym",
                eval_problems=eval_problems, train_pool=pool)


def _problem(name: str, entry: dict[str, Any]) -> Problem:
    return Problem(entry["question"], str(entry["answer"]),
                   {"reasoning_gym": name, "entry": entry})


@functools.cache
def _scorer(name: str):
    return _library().create_dataset(name, seed=0, size=1).score_answer


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def candidates(text: str) -> list[str]:
    """What a response may mean as its answer: the text, an <answer> tag's content, the last line,
    the last number (small models write a sentence around the answer)."""
    text = text.strip()
    out = [text]
    out += [m.strip() for m in _ANSWER_TAG.findall(text)[-1:]]
    if text:
        out.append(text.splitlines()[-1].strip().rstrip("."))
    numbers = _NUMBER.findall(text)
    if numbers:
        out.append(numbers[-1])
    return list(dict.fromkeys(c for c in out if c))


# Tasks whose `score_answer` hands the answer to Python's `eval` (reasoning-gym 0.1.x: a "python
# list" answer format) or to sympy's `parse_expr` (which evaluates Python, builtins included).
# Every scorer already runs in the reward sandbox (rewards/pool.py); this gate is a second layer:
# an answer reaches these scorers only when it is a plain literal / plain arithmetic.
EVAL_SCORERS = frozenset({"spiral_matrix", "string_insertion", "binary_matrix", "n_queens"})
SYMPY_SCORERS = frozenset({"puzzle24", "countdown", "polynomial_multiplication",
                           "simple_integration", "intermediate_integration"})
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Load,
                  ast.UnaryOp, ast.USub, ast.UAdd, ast.Name)
MAX_EVAL_ANSWER = 20_000   # characters: a literal this long is no answer to these tasks
MAX_SYMPY_ANSWER = 2_000
MATH_FUNCTIONS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan",
                            "sinh", "cosh", "tanh", "exp", "log", "ln", "sqrt", "Abs"})
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div)


def safe_for_eval(text: str) -> bool:
    """Is `eval(text)` harmless? True for text that is not Python at all (eval raises
    SyntaxError) and for literals (numbers, strings, lists, tuples, sets, dicts, signs) and bare
    names (a look-up, which calls nothing; "ABBA" is an answer to string_insertion): no calls,
    attributes, subscripts, operators (`9**9**9**9` hangs) or comprehensions."""
    if len(text) > MAX_EVAL_ANSWER:
        return False
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return True
    return all(isinstance(node, _LITERAL_NODES) for node in ast.walk(tree))


def safe_for_sympy(text: str) -> bool:
    """Is sympy's `parse_expr(text)` harmless? Only arithmetic that Python itself parses (sympy
    rewrites its tokens before it evaluates them, so text Python cannot parse is refused too):
    numbers of at most 30 digits, names without underscores, + - * /, calls of the math
    functions above, and powers whose exponent is a small constant (its value at most 16 in
    size, `3/2` allowed) of a base that holds no power (`9**9**9**9` hangs sympy,
    `((9**16)**16)**16` and `9**(16/(1/16))` too)."""
    if len(text) > MAX_SYMPY_ANSWER:
        return False
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    try:
        return _arithmetic(tree.body)
    except RecursionError:
        return False


def _arithmetic(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float) and len(str(node.value)) <= 30
    if isinstance(node, ast.Name):
        return "_" not in node.id
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd)) and _arithmetic(node.operand)
    if isinstance(node, ast.Call):
        return (isinstance(node.func, ast.Name) and node.func.id in MATH_FUNCTIONS
                and not node.keywords and all(map(_arithmetic, node.args)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return (_small_exponent(node.right) and _arithmetic(node.left)
                and not any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow)
                            for n in ast.walk(node.left)))
    return isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC) and \
        _arithmetic(node.left) and _arithmetic(node.right)


def _small_exponent(node: ast.AST) -> bool:
    """A constant exponent of at most 16 in size: 3, -2, 3/2 (its value, not its pieces:
    16/(1/16) is 256)."""
    value = _constant(node, depth=0)
    return value is not None and abs(value) <= 16


def _constant(node: ast.AST, depth: int) -> Fraction | None:
    """The exact value of a small constant expression of numbers, signs and / (None: not one)."""
    if depth > 4:
        return None
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= 16:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _constant(node.operand, depth + 1)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        num, den = _constant(node.left, depth + 1), _constant(node.right, depth + 1)
        return None if num is None or not den else num / den
    return None


def gate(name: str, entry: dict[str, Any]):
    """The check an answer must pass before task `name`'s scorer sees it (None: no check);
    a composite task is checked as the task its entry came from."""
    if name == "composite":
        name = entry.get("metadata", {}).get("source_dataset", name)
    if name in EVAL_SCORERS:
        return safe_for_eval
    if name in SYMPY_SCORERS:
        return safe_for_sympy
    return None


def gym_correct(completion: str, problem: Problem) -> bool:
    """The task's own `score_answer` gives one of the response's candidate answers full marks.
    For the tasks that evaluate the answer (`eval`, `parse_expr`), only candidates that pass the
    task's gate are scored. (Called in a reward worker, in the reward sandbox: rewards/pool.py.)"""
    name = problem.meta["reasoning_gym"]
    score = _scorer(name)
    entry = problem.meta["entry"]
    check = gate(name, entry)
    for c in candidates(completion):
        if check is not None and not check(c):
            continue
        try:
            if float(score(answer=c, entry=entry)) >= 1.0:
                return True
        except Exception:  # noqa: BLE001 - a scorer that chokes on a strange answer: not correct
            continue
    return False
