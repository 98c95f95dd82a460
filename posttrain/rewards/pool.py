"""Verifiers and user reward functions in worker processes: nothing they do reaches the trainer.

A verifier reads text the policy wrote, and an RL policy under reward pressure writes whatever
raises its reward: an answer that a scorer hands to `eval`, an exponent tower that hangs a parser,
`exit()`. So every verifier call and every user reward call runs in a `pebble.ProcessPool` (a
well-kept pool that terminates a task's process when its timeout expires and replaces a worker
that died; the standard ProcessPoolExecutor can do neither):

- a timeout is enforced from outside the call: nothing it does (math-verify's own
  `signal.alarm(0)`, a C extension that never returns, `os._exit`, a segfault) cancels it;
- the worker catches every exception, SystemExit and KeyboardInterrupt included, and converts the
  value to a float itself: only `(float | None, status, traceback text)` crosses back, so no
  object of the callee's (an exception that fails to unpickle, a huge result, a `__float__` with
  side effects) is ever unpickled or run in the trainer;
- the whole batch of calls has one deadline; a call still pending then is cancelled (its worker
  killed) and counted as 'timeout', and a pool that broke (pebble marks it so when a worker's
  message cannot be read) is stopped and rebuilt, so `map` always returns;
- each worker leads its own process group: after every batch, processes that a call forked and
  left behind are killed (a call that ended has no business leaving any).

Outcomes: 'ok', 'error' (raised, or returned a non-number), 'nonfinite', 'timeout' or 'crash' (the
worker died); all but 'ok' get the fallback reward and are counted.

Workers start from a fork server (never a fork of the trainer, whose torch threads a fork would
copy mid-state) and import the functions once, by their 'module:function' spec. As with any
non-fork multiprocessing, a script that trains must keep its code under
`if __name__ == "__main__":` (the command line and notebooks need nothing).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
import weakref
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pebble import ProcessExpired, ProcessPool

from posttrain.usercode import as_reward, load_function

_FUNCTIONS: dict[str, Any] = {}   # in a worker: spec -> the function it names
_MAX_TRACEBACK = 4000             # characters of a failure's traceback sent back


@dataclass(frozen=True)
class Outcome:
    """What one call gave: its reward (None unless status is 'ok'), its status, and the
    traceback of a call that raised (plain text, formatted in the worker)."""

    value: float | None
    status: str
    error: str | None = None


def _load(specs: tuple[str, ...], cwd: str, pid_dir: str) -> None:
    """A worker's start: its own process group (so its leftovers can be found and killed), its
    pid recorded for the trainer, the functions imported."""
    os.setpgid(0, 0)
    Path(pid_dir, str(os.getpid())).touch()
    if cwd not in sys.path:   # the trainer's working directory, as load_function gives it
        sys.path.insert(0, cwd)
    for spec in specs:
        _FUNCTIONS[spec] = load_function(spec)


def _run(kind: str, target: str, kwargs: dict[str, Any]) -> Any:
    if kind == "verify":   # a verifier by name: its verdict as 1.0 / 0.0
        from posttrain.rewards.verifiers import VERIFIERS
        return float(bool(VERIFIERS[target](**kwargs)))
    fn = _FUNCTIONS.get(target)
    if fn is None:   # a worker that replaced a killed one and has not loaded yet
        fn = _FUNCTIONS[target] = load_function(target)
    return fn(**kwargs)


def _call(kind: str, target: str, kwargs: dict[str, Any]) -> tuple[float | None, str, str | None]:
    """In the worker: the call, every exception caught, the value already a float."""
    try:
        value, status = as_reward(_run(kind, target, kwargs))
        return value, status, None
    except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from user code too
        return None, "error", traceback.format_exc()[-_MAX_TRACEBACK:]


def _context():
    """The fork server, started once per trainer process with torch, math-verify and posttrain's
    rewards already imported: a worker (a new one after a kill too) is a fork of it and starts in
    milliseconds instead of importing them again (a second or two)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["posttrain.rewards", "math_verify"])
    return ctx


class RewardPool:
    """`workers` processes running verifier and reward-function calls, each call limited to
    `timeout_s` seconds of its own running time, a batch of calls to `deadline(n)` seconds."""

    def __init__(self, specs: tuple[str, ...], workers: int, timeout_s: float) -> None:
        self.specs, self.timeout_s = specs, timeout_s
        self.workers = max(1, workers)
        self._pool: ProcessPool | None = None
        self._pid_dir = tempfile.TemporaryDirectory(prefix="posttrain-workers-")
        self.rebuilds = 0   # pools stopped and started again (a broken pool, a missed deadline)
        self.leftovers_killed = 0   # processes that calls forked and left behind, killed

    def _started(self) -> ProcessPool:
        if self._pool is not None and not self._pool.active:   # broken (pebble's ERROR state)
            self._restart()
        if self._pool is None:
            self._pool = ProcessPool(max_workers=self.workers, initializer=_load,
                                     initargs=(self.specs, os.getcwd(), self._pid_dir.name),
                                     context=_context())
            # a Scorer dropped without close() (a test, a notebook) still stops its workers
            self._finalizer = weakref.finalize(self, _stop_pool, self._pool, self._pid_dir)
        return self._pool

    def deadline(self, n_calls: int) -> float:
        """Seconds a batch of `n_calls` may take: every call at its full timeout, in waves of
        `workers`, plus time for workers to start."""
        return self.timeout_s * math.ceil(n_calls / self.workers) + 10.0

    def map(self, calls: list[tuple[str, str, dict[str, Any]]]) -> list[Outcome]:
        """An Outcome for each (kind, target, kwargs) in order, kind 'verify' (target: a
        verifier's name) or 'function' (target: a 'module:function' spec); calls run concurrently
        and the whole batch returns within `deadline(len(calls))` seconds."""
        if not calls:
            return []
        futures = self._schedule(calls)
        done, pending = wait(futures, timeout=self.deadline(len(calls)))
        outcomes = [_outcome(f) if f in done else Outcome(None, "timeout") for f in futures]
        for f in pending:
            f.cancel()
        if pending or not self._pool.active:   # a wedged or broken pool is not used again
            self._restart()
        self.leftovers_killed += reap(self._pid_dir.name)
        return outcomes

    def _schedule(self, calls) -> list:
        for attempt in (0, 1):
            pool = self._started()
            try:
                return [pool.schedule(_call, (kind, target, kwargs), timeout=self.timeout_s)
                        for kind, target, kwargs in calls]
            except RuntimeError as e:   # pebble: the pool broke, or a worker could not start
                if attempt == 0:
                    self._restart()
                    continue
                raise RuntimeError(
                    "reward worker processes could not start. A Python script that trains must "
                    "keep its code under `if __name__ == \"__main__\":` (each worker imports the "
                    "script, as with any multiprocessing start method but fork); or set "
                    "reward.workers 0 to score in this process") from e
        raise AssertionError("unreachable")

    def _restart(self) -> None:
        self.rebuilds += 1
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._finalizer.detach()
            _stop_pool(self._pool, self._pid_dir)
            self._pool = None

    def close(self) -> None:
        self._shutdown()


def _stop_pool(pool: ProcessPool, pid_dir: tempfile.TemporaryDirectory) -> None:
    """Stop the workers, then kill whatever they or their calls left behind."""
    pool.stop()
    pool.join(timeout=10)
    reap(pid_dir.name, workers_too=True)


def _outcome(future) -> Outcome:
    try:
        value, status, error = future.result(timeout=0)
    except (FutureTimeout, CancelledError):
        return Outcome(None, "timeout")
    except ProcessExpired as e:
        return Outcome(None, "crash", f"the worker process died: {e}")
    except Exception as e:  # noqa: BLE001 - pebble's own failure (a broken pool): not ok
        return Outcome(None, "error", f"{type(e).__name__}: {e}")
    return Outcome(value, status, error)


# -- leftover processes --------------------------------------------------------------------------

def process_groups() -> dict[int, int]:
    """pid -> process group of every process on this machine (Linux /proc; empty elsewhere)."""
    groups = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state ppid pgrp
        groups[int(entry.name)] = int(fields[2])
    return groups


def reap(pid_dir: str, workers_too: bool = False) -> int:
    """Kill the processes left in the workers' groups: forks a call left behind (a worker leads
    its own group, so its group holds only it and what its calls started), and with
    `workers_too` the workers themselves. A dead worker whose group is empty is forgotten.
    Returns the number of processes killed."""
    recorded = {int(p.name) for p in Path(pid_dir).iterdir() if p.name.isdigit()}
    groups = process_groups()
    killed = 0
    for pid, group in groups.items():
        if group in recorded and (workers_too or pid not in recorded):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    alive = set(groups.values()) | set(groups)
    for pid in recorded - alive:
        Path(pid_dir, str(pid)).unlink(missing_ok=True)
    return killed
