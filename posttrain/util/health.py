"""Failures that must be loud: a reward function, verifier, tool or environment that fails on most
of its calls, step after step, stops the run with its first failure's traceback.

Each call of user code or model-facing code is already contained (rewards/pool.py, envs/): a
failure gets the fallback reward or an error message and is counted. That keeps one bad answer
from ending a run, but a function that fails on every call would give every group the fallback
and the run would learn nothing, silently. `FailureWatch` tells the two apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tally:
    """One source's calls and failures over a step, and its first failure's traceback."""

    calls: int = 0
    failures: int = 0
    first_error: str | None = None

    def add(self, failed: bool, error: str | None = None) -> None:
        self.calls += 1
        if failed:
            self.failures += 1
            if self.first_error is None:
                self.first_error = error or "(no traceback: the call timed out or its process died)"

    def merge(self, other: "Tally") -> None:
        self.calls += other.calls
        self.failures += other.failures
        if self.first_error is None:
            self.first_error = other.first_error


def merge_tallies(*parts: dict[str, Tally]) -> dict[str, Tally]:
    out: dict[str, Tally] = {}
    for part in parts:
        for source, tally in part.items():
            out.setdefault(source, Tally()).merge(tally)
    return out


class FailureWatch:
    """Says (`check` returns the message of a FailingSourceError) when a source failed on more
    than half of its calls in each of `patience` consecutive steps (0: never). A step in which
    the source was not called, or mostly worked, resets its count."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.streaks: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def check(self, step: int, tallies: dict[str, Tally]) -> str | None:
        if self.patience <= 0:
            return None
        for source in list(self.streaks):
            if source not in tallies:
                self.streaks.pop(source)
        for source, t in tallies.items():
            if t.calls and t.failures * 2 > t.calls:
                self.streaks[source] = self.streaks.get(source, 0) + 1
                self.first.setdefault(source, t.first_error or "")
            else:
                self.streaks.pop(source, None)
                self.first.pop(source, None)
            if self.streaks.get(source, 0) >= self.patience:
                return (
                    f"{source} failed on {t.failures} of {t.calls} calls at step {step}, and on "
                    f"most of its calls for {self.patience} steps in a row: the run stops (set "
                    f"reward.max_failing_steps 0 to go on regardless). Its first failure:\n"
                    f"{self.first[source].rstrip()}")
        return None
