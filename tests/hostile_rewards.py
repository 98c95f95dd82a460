"""Hostile reward functions for the red-team tests (tests/test_redteam.py), each the kind of thing
a buggy or malicious `module:function` does to the process that calls it."""

import os
import sys
import time

try:   # at the module's top, as a reward function's heavy imports belong: the reward host imports
    import reasoning_gym as rg   # the module once, and every call's process is a fork of it
except ImportError:              # (an import inside the function would run again in every call)
    rg = None


class Unpicklable(Exception):
    """An exception whose pickle cannot be read back (pebble's pool breaks on such a result)."""

    def __init__(self, handle):
        super().__init__("unpicklable")
        self.handle = handle

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("cannot unpickle me")


def raises_unpicklable(prompt: str, completion: str, answer: str) -> float:
    raise Unpicklable(lambda: None)


def returns_huge(prompt: str, completion: str, answer: str):
    return [0.0] * 20_000_000     # 160 MB of list, not a number


class SideEffect:
    """A return value whose conversion to float tries to write a file and gives the pid of the
    process it ran in (the trainer's, were it converted there)."""

    def __init__(self, path):
        self.path = path

    def __float__(self):
        try:
            with open(self.path, "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
        return float(os.getpid())


def returns_side_effect(prompt: str, completion: str, answer: str):
    """(The completion names the file.)"""
    return SideEffect(completion)


def forks_and_leaves(prompt: str, completion: str, answer: str) -> float:
    """Leaves a child behind that would sleep for a minute (its command line names it)."""
    if os.fork() == 0:
        try:
            os.execvp("sleep", ["sleep", "61.5"])
        finally:
            os._exit(0)
    return 1.0


def exits(prompt: str, completion: str, answer: str) -> float:
    sys.exit(0)


def never_returns(prompt: str, completion: str, answer: str) -> float:
    while True:
        time.sleep(1)


def writes_pid(prompt: str, completion: str, answer: str) -> float:
    return float(os.getpid())


def forks_then_hangs(prompt: str, completion: str, answer: str) -> float:
    """A child that would outlive the call, then a hang: the worker is killed at the timeout."""
    if os.fork() == 0:
        try:
            os.execvp("sleep", ["sleep", "61.5"])
        finally:
            os._exit(0)
    while True:
        time.sleep(1)


def gym_unguarded(prompt: str, completion: str, answer: str, reasoning_gym: str, entry: dict) -> float:
    """reasoning-gym's own scorer on the answer with posttrain's literal gate left out: what a
    user's reward function that calls `score_answer` itself does. Only the sandbox stands between
    an answer that `parse_expr` or `eval` runs and the machine."""
    scorer = rg.create_dataset(reasoning_gym_name(reasoning_gym, entry), seed=0, size=1)
    return float(scorer.score_answer(answer=completion, entry=entry))


def reasoning_gym_name(name: str, entry: dict) -> str:
    return entry.get("metadata", {}).get("source_dataset", name) if name == "composite" else name


def hogs_memory_in_processes(prompt: str, completion: str, answer: str) -> float:
    """'hog': six processes of 300 MB each (touched, so resident), each under the per-process
    limit, then a long sleep; anything else: 1."""
    if completion != "hog":
        return 1.0
    for _ in range(5):
        if os.fork() == 0:
            break
    block = bytearray(300 << 20)
    block[::4096] = b"x" * len(range(0, 300 << 20, 4096))
    time.sleep(30)
    return 0.0
