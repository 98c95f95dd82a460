"""User reward functions in worker processes: a hang is killed, a crash is survived.

Calls run in a `pebble.ProcessPool` (a well-kept pool that terminates a task's process when its
timeout expires and replaces a worker that died; the standard ProcessPoolExecutor can do
neither). So a timeout is enforced from outside the function: nothing the function does (math-
verify's own `signal.alarm(0)`, a C extension that never returns to Python, `os._exit`, a
segfault) can cancel it or take the trainer down. Calls run in parallel across the workers.
Each outcome is 'ok', 'error' (raised or returned a non-number), 'nonfinite', 'timeout' or
'crash' (the worker process died); all but 'ok' get the fallback reward and are counted.

Workers start from a fork server (never a fork of the trainer, whose torch threads a fork would
copy mid-state) and import the functions once, by their 'module:function' spec. As with any
non-fork multiprocessing, a script that trains must keep its code under
`if __name__ == "__main__":` (the command line and notebooks need nothing).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from posttrain.rewards.safe import as_reward, load_function

_FUNCTIONS: dict[str, Any] = {}   # in a worker: spec -> the function it names


def _load(specs: tuple[str, ...], cwd: str) -> None:
    if cwd not in sys.path:   # the trainer's working directory, as load_function gives it
        sys.path.insert(0, cwd)
    for spec in specs:
        _FUNCTIONS[spec] = load_function(spec)


def _call(spec: str, kwargs: dict[str, Any]) -> Any:
    fn = _FUNCTIONS.get(spec)
    if fn is None:   # a worker that replaced a killed one and has not loaded yet
        fn = _FUNCTIONS[spec] = load_function(spec)
    return fn(**kwargs)


def _context():
    """The fork server, started once per trainer process with torch, math-verify and posttrain's
    rewards already imported: a worker (a new one after a kill too) is a fork of it and starts in
    milliseconds instead of importing them again (a second or two)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["posttrain.rewards"])
    return ctx


class RewardPool:
    """`workers` processes calling the functions named by `specs`, each call limited to
    `timeout_s` seconds of its own running time."""

    def __init__(self, specs: tuple[str, ...], workers: int, timeout_s: float) -> None:
        self.specs, self.timeout_s = specs, timeout_s
        self.workers = max(1, workers)
        self._pool: ProcessPool | None = None

    def _started(self) -> ProcessPool:
        if self._pool is None:
            self._pool = ProcessPool(max_workers=self.workers, initializer=_load,
                                     initargs=(self.specs, os.getcwd()), context=_context())
            # a Scorer dropped without close() (a test, a notebook) still stops its workers
            self._finalizer = weakref.finalize(self, self._pool.stop)
        return self._pool

    def map(self, calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[float | None, str]]:
        """(value, status) for each (spec, kwargs), in order; all calls run concurrently."""
        pool = self._started()
        try:
            futures = [pool.schedule(_call, (spec, kwargs), timeout=self.timeout_s)
                       for spec, kwargs in calls]
        except RuntimeError as e:   # pebble: a worker could not even start
            raise RuntimeError(
                "reward worker processes could not start. A Python script that trains must keep "
                "its code under `if __name__ == \"__main__\":` (each worker imports the script, as "
                "with any multiprocessing start method but fork); or set reward.workers 0 to call "
                "the reward functions in this process") from e
        return [_outcome(f) for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._finalizer.detach()
            self._pool.stop()
            self._pool.join()
            self._pool = None


def _outcome(future) -> tuple[float | None, str]:
    try:
        value = future.result()
    except FutureTimeout:
        return None, "timeout"
    except ProcessExpired:
        return None, "crash"
    except Exception:  # noqa: BLE001 - any failure of user code becomes the fallback reward
        return None, "error"
    return as_reward(value)
