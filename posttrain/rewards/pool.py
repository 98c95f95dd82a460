"""Verifiers and user reward functions run in the reward sandbox: nothing an answer makes them do
reaches the trainer.

A verifier reads text the policy wrote, and an RL policy under reward pressure writes whatever
raises its reward: an answer that a scorer hands to `eval` or sympy's `parse_expr`, an exponent
tower that hangs a parser, `exit()`, a program that reads the environment's tokens. So every
verifier call and every user reward call runs in its own process inside the sandbox
(posttrain/sandbox: bubblewrap with no network, an empty environment, no home and no run folder,
read-only system and Python paths, a syscall filter, bounded memory and processes), forked by the
reward host (rewards/host.py), which this module starts and talks to:

- over two pipes of their own (file descriptors 3 and up): the sandbox's stdin is /dev/null and
  its stdout goes to the stderr this side drains, so no process in the sandbox can write into
  the replies through a shared descriptor;
- requests go in as the trainer's own pickles, written without ever blocking past the batch's
  deadline; replies come back as one line of JSON each, read with a byte bound and the deadline
  and checked field by field: the trainer never unpickles or runs anything from the sandbox;
- the host enforces each call's timeout and the batch's deadline; this side adds a backstop: a
  host that misses its deadline by 10 s, exits, answers garbage or lets the sandbox's memory in
  all pass `reward.memory_mb` is killed with everything under it, the batch's calls count as
  failed, and the next batch starts a new one;
- a function that cannot be imported inside the sandbox is refused before training starts,
  with the way out (`reward.sandbox off` for functions that need files or the network).

Outcomes: 'ok', 'error' (raised, or returned a non-number), 'nonfinite', 'timeout', 'crash' (the
call's process or the host died) or 'memory_limit' (a crash in a batch in which the sandbox's
memory in all passed `reward.memory_mb`: the kernel killed in its cgroup, or the check here did);
all but 'ok' get the fallback reward and are counted.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import pickle
import select
import shutil
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

from posttrain.rewards.host import call_weight, line_limit, parse_outcome
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
    traceback of a call that raised (plain text, formatted in the call's process)."""

    value: float | list | None          # a batch call: a float, None or a status per response
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


@dataclass
class _Host:
    """A started host: its sandbox, this side's ends of its two pipes, its scratch folder."""

    sandbox: Spawned
    requests: int           # write end
    replies: int            # read end
    scratch: str


class RewardPool:
    """The reward host in its sandbox: verifier and reward-function calls, `workers` at a time,
    each limited to `timeout_s` seconds, a batch to `deadline(n)` seconds."""

    def __init__(self, specs: tuple[str, ...], workers: int, timeout_s: float, mode: Mode, *,
                 memory_mb: int = 4096, max_procs: int = 64, verifiers: tuple[str, ...] = ()) -> None:
        self.specs, self.timeout_s, self.mode = specs, timeout_s, mode
        self.verifiers = verifiers      # the verifiers the host warms before any fork
        self.workers = max(1, workers)
        self.limits = Limits(timeout_s=None, memory_mb=memory_mb, max_procs=max_procs,
                             max_files=64 + 2 * self.workers)   # (a pipe per worker)
        self._host: _Host | None = None
        self._stderr: collections.deque[bytes] = collections.deque(maxlen=64)
        self._finalizer = None
        self._lock = threading.Lock()
        self.rebuilds = 0           # hosts stopped and started again
        self.leftovers_killed = 0   # processes that calls left behind, killed

    # -- the host ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the host and wait until it has imported every function (RewardSandboxError
        otherwise, naming why and the way out)."""
        if self._host is not None and self._host.sandbox.proc.poll() is None:
            return
        self._stop_host()
        self._host = self._spawn()
        self._finalizer = weakref.finalize(self, _kill_host, self._host)
        reply, why = self._read_line(START_TIMEOUT_S, 1 << 16)
        if isinstance(reply, dict) and reply.get("ready") is True:
            return
        host = self._host
        started = host.sandbox.proc.poll() is None or host.sandbox.program_ran()
        self._stop_host()
        detail = reply.get("error") if isinstance(reply, dict) and "error" in reply else why
        if not started:
            detail = "bubblewrap could not start the sandbox"
        raise RewardSandboxError(
            f"the reward sandbox ({self.mode}) could not start the verifiers and reward functions "
            f"{list(self.specs)}: {str(detail)[:600]}{self._stderr_tail()}. A reward function that "
            "needs your files, the network or a GPU must say so: set reward.sandbox off "
            "(docs/safety.md)")

    def _spawn(self) -> _Host:
        bind, path = code_paths(self.specs)
        sites = site_dirs()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        config = {"specs": list(self.specs), "verifiers": list(self.verifiers),
                  "workers": self.workers, "timeout_s": self.timeout_s,
                  "sys_path": path, "site_dirs": sites, "add_cwd": self.mode == "off",
                  "request_fd": req_r, "reply_fd": rep_w}
        scratch = tempfile.mkdtemp(prefix="posttrain-rewards-")
        try:
            if self.mode == "off":   # the user's own interpreter, environment and folder
                sp = spawn([sys.executable, "-c", _BOOT, json.dumps(config)], "off", self.limits,
                           stdin=subprocess.DEVNULL, stdout=2, stderr=None,
                           pass_fds=(req_r, rep_w))
            else:
                sp = spawn([python_executable(), "-I", "-B", "-c", _BOOT, json.dumps(config)],
                           self.mode, self.limits, ro_paths=[*sites, *bind],
                           env={**_THREADS_1, "HF_HUB_OFFLINE": "1"}, cwd=scratch,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, pass_fds=(req_r, rep_w))
                threading.Thread(target=_drain, args=(sp.proc.stdout, self._stderr),
                                 daemon=True).start()
        finally:
            os.close(req_r)
            os.close(rep_w)
        os.set_blocking(req_w, False)
        return _Host(sp, req_w, rep_r, scratch)

    def _stderr_tail(self) -> str:
        text = b"".join(self._stderr).decode(errors="replace").strip()
        return f"; its last output: {text[-800:]}" if text else ""

    def _read_line(self, timeout_s: float, max_bytes: int) -> tuple[Any, str]:
        """The host's next line as JSON, or (None, why): 'timeout', 'the host exited', too
        long, too much memory, not JSON. The sandbox's memory in all is checked while waiting."""
        host, buf, end, checked = self._host, bytearray(), time.monotonic() + timeout_s, 0.0
        while b"\n" not in buf:
            now = time.monotonic()
            if now >= end:
                return None, "timeout"
            if now - checked >= _MEMORY_EVERY_S and self.mode != "off":
                checked = now
                if tree_memory_mb(host.sandbox.proc.pid) > self.limits.memory_mb:
                    return None, f"its processes used more than {self.limits.memory_mb} MB in all"
            ready, _, _ = select.select([host.replies], [], [], min(end - now, _MEMORY_EVERY_S))
            if ready:
                chunk = os.read(host.replies, 65536)
                if not chunk:
                    return None, "the host exited"
                buf += chunk
                if len(buf) > max_bytes:
                    return None, "its reply was too long"
        try:
            return json.loads(bytes(buf).split(b"\n", 1)[0]), ""
        except (ValueError, RecursionError):
            return None, "its reply was not JSON"

    def _send(self, data: bytes, timeout_s: float) -> bool:
        """Write a request without ever blocking past `timeout_s` (a host that stopped reading
        cannot hang the trainer); False when it did not go through."""
        end, view = time.monotonic() + timeout_s, memoryview(data)
        while view:
            left = end - time.monotonic()
            if left <= 0 or self._host.sandbox.proc.poll() is not None:
                return False
            _, ready, _ = select.select([], [self._host.requests], [], min(left, 0.5))
            if ready:
                try:
                    view = view[os.write(self._host.requests, view):]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:   # the host is gone (EPIPE)
                    return False
        return True

    def _stop_host(self) -> None:
        if self._host is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            _kill_host(self._host)
            self._host = None

    # -- batches ----------------------------------------------------------------------------------

    def deadline(self, weights: list[int]) -> float:
        """Seconds a batch of calls scoring `weights` responses each may take: every call at its
        full timeout (a batch call's: one per response, host.call_weight), in waves of
        `workers`, plus time for processes to start."""
        waves = math.ceil(sum(weights) / self.workers) + max(weights, default=1) - 1
        return self.timeout_s * waves + 10.0

    def map(self, calls: list[tuple[str, str, dict[str, Any]]]) -> list[Outcome]:
        """An Outcome for each (kind, target, kwargs) in order, kind 'verify' (target: a
        verifier's name), 'function' (target: a 'module:function' spec) or 'batch' (the same, TRL's
        signature: lists of every response, one value each back); calls run concurrently and the
        whole batch returns within `deadline(...)` seconds (plus the backstop)."""
        if not calls:
            return []
        with self._lock:
            return self._map(calls)

    def _map(self, calls) -> list[Outcome]:
        deadline = self.deadline([call_weight(call) for call in calls])
        data = pickle.dumps((calls, deadline), protocol=pickle.HIGHEST_PROTOCOL)
        frame = struct.pack(">Q", len(data)) + data
        self.start()
        if not self._send(frame, deadline):   # a host that died between batches: a new one, once
            self._restart()
            self.start()
            if not self._send(frame, deadline):
                return self._failed(calls, "crash", "the reward sandbox did not take the batch")
        kills = self._host.sandbox.oom_kills()
        reply, why = self._read_line(deadline + BACKSTOP_S, sum(map(line_limit, calls)) + 4096)
        outcomes = parse_reply(reply, len(calls))
        # (read before a restart removes the cgroup: did the kernel kill in it for memory?)
        memory = self._host.sandbox.oom_kills() > kills or why.startswith("its processes used")
        if outcomes is None:   # no valid answer: the host and its sandbox are killed
            self._restart()
            outcomes = self._failed(calls, "timeout" if why == "timeout" else "crash",
                                    f"the reward sandbox gave no valid answer ({why or 'malformed reply'}): killed")
        else:
            self.leftovers_killed += reply["leftovers_killed"]
        return [Outcome(None, "memory_limit", f"killed: the reward sandbox's processes passed "
                        f"reward.memory_mb ({self.limits.memory_mb} MB) in all; {o.error or ''}")
                if memory and o.status == "crash" else o for o in outcomes]

    def _failed(self, calls, status: str, message: str) -> list[Outcome]:
        return [Outcome(None, status, message + self._stderr_tail()) for _ in calls]

    def _restart(self) -> None:
        self._stop_host()
        self.rebuilds += 1

    def close(self) -> None:
        with self._lock:
            self._stop_host()


def parse_reply(reply: Any, n: int) -> list[Outcome] | None:
    """The host's reply checked field by field (None: anything out of shape): `n` outcomes as
    the host checks each call's own (a value is a finite number only with status 'ok'; a
    traceback is text), and a count of leftovers."""
    if not isinstance(reply, dict) or not isinstance(reply.get("outcomes"), list):
        return None
    killed = reply.get("leftovers_killed")
    if type(killed) is not int or not 0 <= killed < 1 << 20 or len(reply["outcomes"]) != n:
        return None
    out = []
    for row in reply["outcomes"]:
        checked = parse_outcome(json.dumps(row).encode()) if isinstance(row, list) else None
        if checked is None:
            return None
        out.append(Outcome(*checked))
    return out


def _drain(pipe, tail: collections.deque) -> None:
    """Keep the last few KB of what the sandbox writes to stdout and stderr (error messages)."""
    try:
        while chunk := pipe.read1(4096):
            tail.append(chunk)
    except (OSError, ValueError):
        pass


def _kill_host(host: _Host) -> None:
    """Kill the host and everything under it while it still holds its pid (found through it,
    its own orphans included), then reap it and close this side's pipes."""
    if host.sandbox.proc.poll() is None:
        kill_tree(host.sandbox.proc.pid)
    host.sandbox.proc.wait()
    for fd in (host.requests, host.replies):
        try:
            os.close(fd)
        except OSError:
            pass
    host.sandbox.close()
    shutil.rmtree(host.scratch, ignore_errors=True)
