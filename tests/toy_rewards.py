"""Reward functions used by the tests through the `module:function` path."""

import time


def first_letter_a_to_e(prompt: str, completion: str, answer: str) -> float:
    """Learnable by a random tiny model: a minority of first tokens qualify at the start."""
    text = completion.lstrip()
    return float(bool(text) and "a" <= text[0].lower() <= "e")


def raises(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("broken reward")


def hangs(prompt: str, completion: str, answer: str) -> float:
    time.sleep(60)
    return 1.0


def not_a_number(prompt: str, completion: str, answer: str) -> float:
    return float("nan")


def even_prompts_only(prompt: str, completion: str, answer: str) -> float:
    """All-equal (0) for prompts whose first operand is odd; informative for the others."""
    a = int(prompt.split()[2])
    return first_letter_a_to_e(prompt, completion, answer) if a % 2 == 0 else 0.0


def verify_then_hang(prompt: str, completion: str, answer: str) -> float:
    """Calls math-verify (whose own signal.alarm(0) cancels an in-process SIGALRM timeout),
    then hangs for 3 s."""
    from math_verify import parse, verify
    verify(parse("1"), parse("1"))
    time.sleep(3)
    return 1.0


def dies(prompt: str, completion: str, answer: str) -> float:
    """Kills its own process, as a segfault in a C extension would."""
    import os
    os._exit(3)


def slow_pid(prompt: str, completion: str, answer: str) -> float:
    """The process that ran the call, after 0.3 s (long enough for the calls to overlap)."""
    import os
    time.sleep(0.3)
    return float(os.getpid())


def segfaults(prompt: str, completion: str, answer: str) -> float:
    """Dies of SIGSEGV, as a C extension's invalid memory access does."""
    import os
    import signal
    os.kill(os.getpid(), signal.SIGSEGV)
    return 1.0


def sleeps_02(prompt: str, completion: str, answer: str) -> float:
    time.sleep(0.2)
    return 1.0


def difficulty_column(prompt: str, completion: str, answer: str, difficulty: str) -> float:
    """Reads a row's extra column: 1 when the row's `difficulty` column is 'easy'."""
    return float(difficulty == "easy")


def trl_style(prompts, completions, level, **kwargs) -> list[float]:
    """TRL's signature: lists, conversational completions as assistant messages, columns too."""
    return [float(isinstance(c, list) and c[0]["role"] == "assistant") + float(lv == 2)
            for c, lv in zip(completions, level)]


# tools for the environment tests (env.tools 'tests.toy_rewards:...')

def tool_raises(x: str) -> str:
    """A tool that always raises."""
    raise RuntimeError("broken tool")


def tool_hangs(x: str) -> str:
    """A tool that never returns."""
    time.sleep(60)
    return "late"


def tool_garbage(x: str) -> object:
    """A tool that returns something that is not text."""
    return {"not": "text"}


def always_one(prompt: str, completion: str, answer: str) -> float:
    """Every answer scores the same: every group is all-equal."""
    return 1.0


def fails_on_bad(prompt: str, completion: str, answer: str) -> float:
    """Raises on the completion 'bad', 1 otherwise (a batch's failures are its own)."""
    if completion == "bad":
        raise ValueError("bad")
    return 1.0


def sees_reasoning_gym(prompt: str, completion: str, answer: str) -> float:
    """1 when reasoning-gym was imported before this call's process started (the host warmed
    the verifier that needs it), 0 when this call would have to import it itself."""
    import sys
    return float("reasoning_gym" in sys.modules)


# TRL-signature functions (one call per batch: lists of every response)

def batch_rank(completions, **kwargs) -> list[float]:
    """Each completion's rank in the whole batch (a function that looks across the batch: called
    one response at a time, every rank would be 0)."""
    order = sorted(completions)
    return [float(order.index(c)) for c in completions]


def ids_and_columns(prompts, completions, completion_ids, level, **kwargs) -> list[float]:
    """The number of tokens the policy sampled, plus 100 x the row's `level` column."""
    return [float(len(ids)) + 100.0 * lv for ids, lv in zip(completion_ids, level)]


def none_for_odd(completions, **kwargs) -> list[float | None]:
    """TRL's None ("not this function's to score") for every second response."""
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def odd_only(completions, **kwargs) -> list[float | None]:
    """Scores exactly the responses none_for_odd leaves (2.0 each)."""
    return [2.0 if i % 2 else None for i in range(len(completions))]


def bad_entries(completions, **kwargs) -> list:
    """A finite reward, NaN, a string and None, in turn."""
    return [[1.0, float("nan"), "x", None][i % 4] for i in range(len(completions))]


def wrong_length(completions, **kwargs) -> list[float]:
    return [1.0] * (len(completions) + 1)


def batch_sleeps_1s(completions, **kwargs) -> list[float]:
    """One second for the whole batch: within reward.timeout_s x the batch's size."""
    time.sleep(1.0)
    return [1.0] * len(completions)
