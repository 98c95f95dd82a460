"""Hostile reward functions for the red-team tests (tests/test_redteam.py), each the kind of thing
a buggy or malicious `module:function` does to the process that calls it."""

import os
import sys
import time


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
    """A return value whose conversion to float writes a file naming the process it ran in."""

    def __init__(self, path):
        self.path = path

    def __float__(self):
        with open(self.path, "w") as f:
            f.write(str(os.getpid()))
        return 1.0


def returns_side_effect(prompt: str, completion: str, answer: str):
    """(The completion names the file: the workers' environment is the fork server's.)"""
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
