"""The reward sandbox's own program: verifiers and reward functions scoring the policy's answers,
in worker processes, inside the sandbox (posttrain/sandbox). Plain Python and no torch: it runs
under the sandbox's memory limit. The trainer (rewards/pool.py) starts it and talks to it over
two pipes:

    trainer -> host   a batch of calls and its deadline: an 8-byte length, then a pickle (the
                      trainer's own data; the host trusts it)
    host -> trainer   one line of JSON: {"ready": true} once the functions import, then per
                      batch {"outcomes": [[value, status, traceback], ...], "rebuilds": n,
                      "leftovers_killed": n}

The host never sends a pickle: whatever a call does, even a worker taken over by an answer that
a scorer evaluated, the trainer only ever parses numbers and short strings from it; the worst a
hostile answer can do from inside is give its own batch wrong rewards. The host makes itself
undumpable, so no worker can open its reply pipe through /proc.

Inside, calls run in a `pebble.ProcessPool` (a well-kept pool that terminates a task's process
when its timeout expires and replaces a worker that died; the standard ProcessPoolExecutor can do
neither):

- a timeout is enforced from outside the call: nothing it does (math-verify's own
  `signal.alarm(0)`, a C extension that never returns, `os._exit`, a segfault) cancels it;
- the worker catches every exception, SystemExit and KeyboardInterrupt included, and converts the
  value to a float itself: only `(float | None, status, traceback text)` leaves it;
- the whole batch has one deadline; a call still pending then is cancelled (its worker killed)
  and counted as 'timeout', and a pool that broke (pebble marks it so when a worker's message
  cannot be read) is stopped and rebuilt, so `map` always returns;
- each worker leads its own process group: after every batch, processes that a call forked and
  left behind are killed (a call that ended has no business leaving any).

Workers start from a fork server inside the sandbox, with math-verify and the verifiers already
imported: a new worker (after a kill too) starts in milliseconds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import site
import struct
import sys
import tempfile
import traceback
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from pathlib import Path
from typing import Any, BinaryIO

from pebble import ProcessExpired, ProcessPool

from posttrain.sandbox import seccomp
from posttrain.sandbox.procs import reap_groups, start_time
from posttrain.usercode import as_reward, load_function

_FUNCTIONS: dict[str, Any] = {}   # in a worker: spec -> the function it names
MAX_TRACEBACK = 4000              # characters of a failure's traceback sent back
STATUSES = ("ok", "error", "nonfinite", "timeout", "crash")


# -- in a worker --------------------------------------------------------------------------------

def _load(specs: tuple[str, ...], site_dirs: tuple[str, ...], pid_dir: str) -> None:
    """A worker's start: its own process group (so its leftovers can be found and killed), its
    pid and start time recorded, the functions imported."""
    os.setpgid(0, 0)
    Path(pid_dir, str(os.getpid())).write_text(str(start_time(os.getpid())))
    for d in site_dirs:   # (.pth files: editable installs' import hooks are not inherited)
        site.addsitedir(d)
    for spec in specs:
        _FUNCTIONS[spec] = load_function(spec, add_cwd=False)


def _run(kind: str, target: str, kwargs: dict[str, Any]) -> Any:
    if kind == "verify":   # a verifier by name: its verdict as 1.0 / 0.0
        from posttrain.rewards.verifiers import VERIFIERS
        return float(bool(VERIFIERS[target](**kwargs)))
    fn = _FUNCTIONS.get(target)
    if fn is None:   # a worker that replaced a killed one and has not loaded yet
        fn = _FUNCTIONS[target] = load_function(target, add_cwd=False)
    return fn(**kwargs)


def _call(kind: str, target: str, kwargs: dict[str, Any]) -> tuple[float | None, str, str | None]:
    """In the worker: the call, every exception caught, the value already a float."""
    try:
        value, status = as_reward(_run(kind, target, kwargs))
        return value, status, None
    except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from user code too
        return None, "error", traceback.format_exc()[-MAX_TRACEBACK:]


# -- the pool -----------------------------------------------------------------------------------

def _context():
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["posttrain.rewards.verifiers", "math_verify"])
    return ctx


class WorkerPool:
    """`workers` processes running calls, each limited to `timeout_s` seconds of its own
    running time, a batch to the deadline it is given."""

    def __init__(self, specs: tuple[str, ...], workers: int, timeout_s: float,
                 site_dirs: tuple[str, ...] = ()) -> None:
        self.specs, self.timeout_s, self.site_dirs = specs, timeout_s, site_dirs
        self.workers = max(1, workers)
        self._pool: ProcessPool | None = None
        self._pid_dir = tempfile.TemporaryDirectory(prefix="posttrain-workers-")
        self._leaders: dict[int, int] = {}   # worker pid -> its start time
        self.rebuilds = 0           # pools stopped and started again (broken, or a missed deadline)
        self.leftovers_killed = 0   # processes that calls forked and left behind, killed

    def _started(self) -> ProcessPool:
        if self._pool is not None and not self._pool.active:   # broken (pebble's ERROR state)
            self._restart()
        if self._pool is None:
            self._pool = ProcessPool(max_workers=self.workers, initializer=_load,
                                     initargs=(self.specs, self.site_dirs, self._pid_dir.name),
                                     context=_context())
        return self._pool

    def map(self, calls: list[tuple[str, str, dict[str, Any]]], deadline: float) -> list[tuple]:
        """(value, status, traceback) for each (kind, target, kwargs), within `deadline` s."""
        if not calls:
            return []
        futures = self._schedule(calls)
        done, pending = wait(futures, timeout=deadline)
        outcomes = [_outcome(f) if f in done else (None, "timeout", None) for f in futures]
        for f in pending:
            f.cancel()
        if pending or not self._pool.active:   # a wedged or broken pool is not used again
            self._restart()
        self.leftovers_killed += self._reap()
        return outcomes

    def _schedule(self, calls) -> list:
        for attempt in (0, 1):
            pool = self._started()
            try:
                return [pool.schedule(_call, (kind, target, kwargs), timeout=self.timeout_s)
                        for kind, target, kwargs in calls]
            except RuntimeError:   # pebble: the pool broke, or a worker could not start
                if attempt == 1:
                    raise
                self._restart()
        raise AssertionError("unreachable")

    def _reap(self, leaders_too: bool = False) -> int:
        for p in Path(self._pid_dir.name).iterdir():
            if p.name.isdigit() and int(p.name) not in self._leaders:
                self._leaders[int(p.name)] = int(p.read_text() or -1)
        killed, forget = reap_groups(self._leaders, leaders_too)
        for pid in forget:
            self._leaders.pop(pid, None)
            Path(self._pid_dir.name, str(pid)).unlink(missing_ok=True)
        return killed

    def _restart(self) -> None:
        self.rebuilds += 1
        self.close()

    def close(self) -> None:
        """Stop the workers, then kill whatever they or their calls left behind."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
            self._reap(leaders_too=True)


def _outcome(future) -> tuple:
    try:
        return future.result(timeout=0)
    except (FutureTimeout, CancelledError):
        return None, "timeout", None
    except ProcessExpired as e:
        return None, "crash", f"the worker process died: {e}"
    except Exception as e:  # noqa: BLE001 - pebble's own failure (a broken pool): not ok
        return None, "error", f"{type(e).__name__}: {e}"


# -- the host's loop ----------------------------------------------------------------------------

def read_frame(stream: BinaryIO) -> Any | None:
    """One request from the trainer (None: the trainer closed the pipe)."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack(">Q", head)
    return pickle.loads(stream.read(n))   # the trainer's own data, never the model's


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def main(config: dict[str, Any]) -> None:
    """The host: import the functions, say ready, then answer batches until the trainer closes."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # what user code prints goes to stderr, never into the replies
    seccomp.not_dumpable()
    seccomp.subreaper()   # (a call's setsid'd grandchild stays in the host's tree, to be killed)
    specs = tuple(config["specs"])
    try:
        for spec in specs:
            load_function(spec, add_cwd=config.get("add_cwd", False))
    except Exception as e:  # noqa: BLE001 - reported to the trainer in one line
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}) + "\n")
        return
    pool = WorkerPool(specs, config["workers"], config["timeout_s"], tuple(config["site_dirs"]))
    replies.write(json.dumps({"ready": True}) + "\n")
    while (request := read_frame(sys.stdin.buffer)) is not None:
        calls, deadline = request
        before = pool.rebuilds, pool.leftovers_killed
        outcomes = pool.map(calls, deadline)
        replies.write(json.dumps({"outcomes": outcomes, "rebuilds": pool.rebuilds - before[0],
                                  "leftovers_killed": pool.leftovers_killed - before[1]}) + "\n")
    pool.close()
