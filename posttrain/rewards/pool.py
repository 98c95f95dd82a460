"""Verifiers and user reward functions run in the reward sandbox: nothing an answer makes them do
reaches the trainer.

A verifier reads text the policy wrote, and an RL policy under reward pressure writes whatever
raises its reward: an answer that a scorer hands to `eval` or sympy's `parse_expr`, an exponent
tower that hangs a parser, `exit()`, a program that reads the environment's tokens. So every
verifier call and every user reward call runs in worker processes inside the sandbox
(posttrain/sandbox: bubblewrap with no network, an empty environment, no home and no run folder,
read-only system and Python paths, a syscall filter, bounded memory and processes), driven by the
reward host (rewards/host.py), which this module starts and talks to:

- requests go in as the trainer's own pickles; replies come back as one line of JSON each, read
  with a byte bound and a deadline and checked field by field: the trainer never unpickles or
  runs anything from the sandbox;
- the host enforces each call's timeout and the batch's deadline; this side adds a backstop:
  a host that misses its deadline by 10 s, exits, answers garbage or lets the sandbox's memory
  in all pass `reward.memory_mb` is killed with everything under it, the batch's calls count
  as failed, and the next batch starts a new one;
- a function that cannot be imported inside the sandbox is refused before training starts,
  with the way out (`reward.sandbox off` for functions that need files or the network).

Outcomes: 'ok', 'error' (raised, or returned a non-number), 'nonfinite', 'timeout' or 'crash' (the
worker or the host died); all but 'ok' get the fallback reward and are counted.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.rewards.host import MAX_TRACEBACK, STATUSES
from posttrain.sandbox.launch import Limits, Mode, Spawned, python_executable, spawn
from posttrain.sandbox.procs import kill_tree, tree_memory_mb

START_TIMEOUT_S = 120.0     # the host's imports (math-verify, sympy, reasoning-gym) on a busy machine
BACKSTOP_S = 10.0           # past the host's own deadline
_MEMORY_EVERY_S = 0.25
_BOOT = ("import json, site, sys; c = json.loads(sys.argv[1]); sys.path[:0] = c['sys_path']; "
         "[site.addsitedir(d) for d in c['site_dirs']]; "
         "from posttrain.rewards.host import main; main(c)")
_THREADS_1 = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


@dataclass(frozen=True)
class Outcome:
    """What one call gave: its reward (None unless status is 'ok'), its status, and the
    traceback of a call that raised (plain text, formatted in the worker)."""

    value: float | None
    status: str
    error: str | None = None


class RewardSandboxError(ValueError):
    """The reward sandbox cannot start, or cannot import a reward function."""


def site_dirs() -> list[str]:
    """The folders of installed packages on this interpreter's path (a venv's site-packages)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def code_paths(specs: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(paths to bind read-only, folders to put on the sandbox's sys.path): posttrain's own
    package and each reward function's top-level module, nothing else of their folders."""
    bind, path = [], []
    tops = ["posttrain", *dict.fromkeys(s.partition(":")[0].split(".")[0] for s in specs)]
    for top in tops:
        found = importlib.util.find_spec(top)
        if found is None:
            continue
        places = list(found.submodule_search_locations or []) or [found.origin]
        for place in places:
            if place and os.path.exists(place):
                bind.append(os.path.realpath(place))
                path.append(os.path.dirname(os.path.realpath(place)))
    return list(dict.fromkeys(bind)), list(dict.fromkeys(path))


class RewardPool:
    """The reward host in its sandbox: `workers` processes running verifier and reward-function
    calls, each call limited to `timeout_s` seconds, a batch to `deadline(n)` seconds."""

    def __init__(self, specs: tuple[str, ...], workers: int, timeout_s: float, mode: Mode,
                 memory_mb: int = 4096, max_procs: int = 64) -> None:
        self.specs, self.timeout_s, self.mode = specs, timeout_s, mode
        self.workers = max(1, workers)
        self.limits = Limits(timeout_s=None, memory_mb=memory_mb, max_procs=max_procs)
        self._host: Spawned | None = None
        self._stderr: collections.deque[bytes] = collections.deque(maxlen=64)
        self._finalizer = None
        self.rebuilds = 0           # pools or hosts stopped and started again
        self.leftovers_killed = 0   # processes that calls forked and left behind, killed

    # -- the host ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the host and wait until it has imported every function (RewardSandboxError
        otherwise, naming why and the way out)."""
        if self._host is not None and self._host.proc.poll() is None:
            return
        self._stop_host()
        self._host = self._spawn()
        self._finalizer = weakref.finalize(self, _kill_host, self._host)
        reply, why = self._read_line(START_TIMEOUT_S, 1 << 16)
        if reply is not None and reply.get("ready") is True:
            return
        host, self._host = self._host, None
        _kill_host(host)
        if not host.started():
            why = "bubblewrap could not start the sandbox"
        detail = reply.get("error") if isinstance(reply, dict) and "error" in reply else why
        raise RewardSandboxError(
            f"the reward sandbox ({self.mode}) could not start the reward functions {list(self.specs)}: "
            f"{str(detail)[:600]}{self._stderr_tail()}. A reward function that needs your files, "
            "the network or a GPU must say so: set reward.sandbox off (docs/safety.md)")

    def _spawn(self) -> Spawned:
        bind, path = code_paths(self.specs)
        sites = site_dirs()
        config = {"specs": list(self.specs), "workers": self.workers, "timeout_s": self.timeout_s,
                  "sys_path": path, "site_dirs": sites, "add_cwd": self.mode == "off"}
        if self.mode == "off":   # the user's own interpreter, environment and folder
            argv = [sys.executable, "-c", _BOOT, json.dumps(config)]
            return spawn(argv, "off", self.limits, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=None)
        argv = [python_executable(), "-I", "-B", "-c", _BOOT, json.dumps(config)]
        cwd = tempfile.mkdtemp(prefix="posttrain-rewards-")
        sp = spawn(argv, self.mode, self.limits, ro_paths=[*sites, *bind],
                   env={**_THREADS_1, "HF_HUB_OFFLINE": "1"}, cwd=cwd,
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        threading.Thread(target=_drain, args=(sp.proc.stderr, self._stderr), daemon=True).start()
        return sp

    def _stderr_tail(self) -> str:
        text = b"".join(self._stderr).decode(errors="replace").strip()
        return f"; its last output: {text[-800:]}" if text else ""

    def _read_line(self, timeout_s: float, max_bytes: int) -> tuple[Any, str]:
        """The host's next line as JSON, or (None, why): 'timeout', 'exited', 'too long',
        'memory', 'not JSON'. The sandbox's memory in all is checked while waiting."""
        proc, buf, end, checked = self._host.proc, bytearray(), time.monotonic() + timeout_s, 0.0
        fd = proc.stdout.fileno()
        while b"\n" not in buf:
            now = time.monotonic()
            if now >= end:
                return None, "timeout"
            if now - checked >= _MEMORY_EVERY_S and self.mode != "off":
                checked = now
                if tree_memory_mb(proc.pid) > self.limits.memory_mb:
                    return None, f"its processes used more than {self.limits.memory_mb} MB in all"
            ready, _, _ = select.select([fd], [], [], min(end - now, _MEMORY_EVERY_S))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None, "the host exited"
                buf += chunk
                if len(buf) > max_bytes:
                    return None, "its reply was too long"
        try:
            return json.loads(bytes(buf).split(b"\n", 1)[0]), ""
        except (ValueError, RecursionError):
            return None, "its reply was not JSON"

    def _stop_host(self) -> None:
        if self._host is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            _kill_host(self._host)
            self._host = None

    # -- batches ----------------------------------------------------------------------------------

    def deadline(self, n_calls: int) -> float:
        """Seconds a batch of `n_calls` may take: every call at its full timeout, in waves of
        `workers`, plus time for workers to start."""
        return self.timeout_s * math.ceil(n_calls / self.workers) + 10.0

    def map(self, calls: list[tuple[str, str, dict[str, Any]]]) -> list[Outcome]:
        """An Outcome for each (kind, target, kwargs) in order, kind 'verify' (target: a
        verifier's name) or 'function' (target: a 'module:function' spec); calls run concurrently
        and the whole batch returns within `deadline(len(calls))` seconds (plus the backstop)."""
        if not calls:
            return []
        self.start()
        deadline = self.deadline(len(calls))
        data = pickle.dumps((calls, deadline), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._host.proc.stdin.write(struct.pack(">Q", len(data)) + data)
            self._host.proc.stdin.flush()
        except OSError:   # the host died between batches: a new one, once
            self._stop_host()
            self.rebuilds += 1
            self.start()
            self._host.proc.stdin.write(struct.pack(">Q", len(data)) + data)
            self._host.proc.stdin.flush()
        reply, why = self._read_line(deadline + BACKSTOP_S, len(calls) * (MAX_TRACEBACK + 400) + 4096)
        outcomes = parse_reply(reply, len(calls))
        if outcomes is None:   # no valid answer: the host and its sandbox are killed
            self._stop_host()
            self.rebuilds += 1
            status = "timeout" if why == "timeout" else "crash"
            msg = f"the reward sandbox gave no valid answer ({why or 'malformed reply'}): killed"
            return [Outcome(None, status, msg + self._stderr_tail()) for _ in calls]
        self.rebuilds += reply["rebuilds"]
        self.leftovers_killed += reply["leftovers_killed"]
        return outcomes

    def close(self) -> None:
        self._stop_host()


def parse_reply(reply: Any, n: int) -> list[Outcome] | None:
    """The host's reply checked field by field (None: anything out of shape). A value is a
    finite number only with status 'ok'; a traceback is text, cut to MAX_TRACEBACK."""
    if not isinstance(reply, dict) or not isinstance(reply.get("outcomes"), list):
        return None
    counts = [reply.get(k) for k in ("rebuilds", "leftovers_killed")]
    if not all(type(c) is int and 0 <= c < 1 << 20 for c in counts) or len(reply["outcomes"]) != n:
        return None
    out = []
    for row in reply["outcomes"]:
        if not isinstance(row, list) or len(row) != 3:
            return None
        value, status, error = row
        if status not in STATUSES or not (error is None or isinstance(error, str)):
            return None
        if status == "ok":
            if type(value) not in (int, float) or not math.isfinite(value):
                return None
            value = float(value)
        elif value is not None:
            return None
        out.append(Outcome(value, status, None if error is None else error[:MAX_TRACEBACK]))
    return out


def _drain(pipe, tail: collections.deque) -> None:
    """Keep the last few KB of what the sandbox writes to stderr (for error messages)."""
    try:
        while chunk := pipe.read1(4096):
            tail.append(chunk)
    except (OSError, ValueError):
        pass


def _kill_host(host: Spawned) -> None:
    """Close the host's pipe, give it a moment to stop its workers, then kill what is left."""
    try:
        host.proc.stdin.close()
        host.proc.wait(timeout=1)
    except (OSError, subprocess.TimeoutExpired):
        pass
    kill_tree(host.proc.pid)
    host.proc.wait()
    host.close()
