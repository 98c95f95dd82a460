"""The reward sandbox's own program: verifiers and reward functions scoring the policy's answers,
each call in a process of its own, inside the sandbox (posttrain/sandbox). Plain Python and no
torch: it runs under the sandbox's memory limit. The trainer (rewards/pool.py) starts it and talks
to it over two pipes passed as file descriptors 3 and up (never stdin or stdout, which the
sandbox's other processes share):

    trainer -> host   a batch of calls and its deadline: an 8-byte length, then a pickle (the
                      trainer's own data; the host trusts it)
    host -> trainer   one line of JSON: {"ready": true} once the functions import, then per
                      batch {"outcomes": [[value, status, traceback], ...], "leftovers_killed": n}

Every call runs in a fresh fork of the host (the functions, math-verify and sympy already
imported: a fork starts in about a millisecond) and sends its outcome back as one line of JSON on
a pipe of its own; the process then exits. Nothing is ever unpickled from a call, so an answer
that takes over the process it is scored in (a scorer that evaluates it) holds that one process
for that one call: it cannot reach the host, other calls or later batches, and the trainer only
ever reads numbers and short strings. The host:

- runs at most `workers` calls at once, each killed at `timeout_s` (a SIGKILL from outside:
  nothing a call does, math-verify's own `signal.alarm(0)` or a C extension that never returns,
  cancels it), the batch ended at its deadline;
- catches every exception in the call, SystemExit and KeyboardInterrupt included, and converts
  the value to a float inside the call's process;
- is a subreaper: after every batch it kills every process left below it (a call's children,
  a grandchild that called `setsid`), so nothing runs between batches;
- makes itself undumpable, so no call can open its pipes through /proc.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from posttrain.sandbox import seccomp
from posttrain.util.usercode import as_reward, as_rewards, awaited, load_function

MAX_TRACEBACK = 4000              # bytes of a failure's traceback sent back
MAX_BATCH = 8192                  # responses in one batch call (TRL's signature)
MAX_LINE = MAX_TRACEBACK + 400 + 32 * MAX_BATCH   # bytes of one call's JSON line
STATUSES = ("ok", "unscored", "error", "nonfinite", "timeout", "crash")
_BAD_VALUES = ("error", "nonfinite")   # a batch call's entry for one response it could not score
_FUNCTIONS: dict[str, Any] = {}   # spec -> the function it names (imported before any fork)


def cut(text: str, limit: int = MAX_TRACEBACK) -> str:
    """The last `limit` bytes of `text` in UTF-8 (a traceback's end says the most)."""
    data = text.encode("utf-8", "replace")
    return data[-limit:].decode("utf-8", "ignore") if len(data) > limit else text


# -- one call, in its own process ---------------------------------------------------------------

def _run(kind: str, target: str, kwargs: dict[str, Any]) -> Any:
    if kind == "verify":   # a verifier by name: its verdict as 1.0 / 0.0
        from posttrain.rewards.verifiers import VERIFIERS
        return float(bool(VERIFIERS[target](**kwargs)))
    return awaited(_FUNCTIONS[target](**kwargs))   # ('function' or 'batch'; async def awaited)


def call_weight(call: tuple[str, str, dict[str, Any]]) -> int:
    """How many responses a call scores: a batch call (TRL's signature) all of its completions,
    and the time of as many calls; any other call one."""
    kind, _, kwargs = call
    return max(1, len(kwargs["completions"])) if kind == "batch" else 1


def line_limit(call: tuple[str, str, dict[str, Any]]) -> int:
    """The most bytes a call's outcome takes in the host's reply (its JSON, a separator)."""
    return MAX_TRACEBACK + 416 + 32 * (call_weight(call) if call[0] == "batch" else 0)


def _call(kind: str, target: str, kwargs: dict[str, Any]) -> tuple[Any, str, str | None]:
    """The call, every exception caught, the value already a float (a batch call: a list of one
    float, None or a bad value's status per completion)."""
    try:
        value = _run(kind, target, kwargs)
        if kind == "batch":
            return as_rewards(value, len(kwargs["completions"])), "ok", None
        value, status = as_reward(value)
        return value, status, None
    except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from user code too
        return None, "error", cut(traceback.format_exc())


def _child(calls: list[tuple[str, str, dict[str, Any]]], out_fd: int, private: list[int]) -> None:
    """In the fork: none of the host's pipes (`private`: the trainer's two, the other
    processes'), its own process group (its leftovers are killed with it), the calls one after
    another, a line of JSON each, and out (never back into the host's code)."""
    try:
        for fd in private:
            os.close(fd)
        os.setpgid(0, 0)
        for call in calls:
            line = json.dumps(list(_call(*call)), ensure_ascii=False).encode()[:MAX_LINE - 1]
            os.write(out_fd, line + b"\n")
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


# -- a batch ------------------------------------------------------------------------------------

@dataclass
class _Share:
    """A process running a share of the batch's calls: the ones still due, in order; the
    current one started at `since`."""

    pid: int
    fd: int
    due: list[int]
    since: float
    data: bytearray = field(default_factory=bytearray)


def parse_outcome(data: bytes) -> tuple[Any, str, str | None] | None:
    """A call's line, checked: (value, status, traceback), or None when it is out of shape."""
    try:
        value, status, error = json.loads(data.decode("utf-8"))
        if status not in STATUSES or not (error is None or isinstance(error, str)):
            return None
        if status == "ok":
            value = _checked(value)
        elif value is not None:
            return None
        return value, status, error
    except (ValueError, TypeError, OverflowError, RecursionError, UnicodeDecodeError):
        return None


def _checked(value: Any) -> float | list:
    """An 'ok' call's value: a finite number, or a batch call's list (at most MAX_BATCH) of
    finite numbers, None (unscored) and bad values' statuses; ValueError for anything else."""
    if type(value) is list:
        if len(value) > MAX_BATCH:
            raise ValueError(f"{len(value)} values in one call")
        return [v if v is None or (type(v) is str and v in _BAD_VALUES) else _finite(v)
                for v in value]
    return _finite(value)


def _finite(value: Any) -> float:
    if type(value) not in (int, float) or value != value or abs(value) == float("inf"):
        raise ValueError(f"not a finite number: {str(value)[:40]!r}")
    return float(value)


class Batch:
    """Runs the calls in `workers` forks of the host, each taking a share and answering a line
    per call; each call within `timeout_s` (a batch call: times its responses), all within the
    deadline; outcomes in call order.
    A share whose call times out, crashes or answers out of shape is killed and what it had
    left goes to a new fork."""

    def __init__(self, calls: list, workers: int, timeout_s: float, deadline_s: float,
                 private: tuple[int, ...] = ()) -> None:
        self.calls, self.workers, self.timeout_s = calls, max(1, workers), timeout_s
        self.limits = [timeout_s * call_weight(call) for call in calls]
        self.private = private   # the trainer's pipes: closed in every fork
        self.end = time.monotonic() + deadline_s
        self.outcomes: list[tuple | None] = [None] * len(calls)
        self.todo = list(range(len(calls)))
        self.running: dict[int, _Share] = {}

    def run(self) -> list[tuple]:
        while self.todo or self.running:
            while self.todo and len(self.running) < self.workers and time.monotonic() < self.end:
                size = -(-len(self.todo) // (self.workers - len(self.running)))
                self._start(self.todo[:size])
                self.todo = self.todo[size:]
            if not self.running:
                break
            self._wait()
        for i in self.todo:                 # never started: the deadline came first
            self.outcomes[i] = (None, "timeout", None)
        return [o if o is not None else (None, "crash", "its process gave no outcome")
                for o in self.outcomes]

    def _start(self, due: list[int]) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child([self.calls[i] for i in due], w, [r, *self.private, *self.running])
        os.close(w)
        self.running[r] = _Share(pid, r, due, time.monotonic())

    def _wait(self) -> None:
        soonest = min(min(s.since + self._limit(s) for s in self.running.values()), self.end)
        ready, _, _ = select.select(list(self.running), [], [], max(0.0, soonest - time.monotonic()))
        for fd in ready:
            self._read(self.running[fd])
        now = time.monotonic()
        for share in list(self.running.values()):
            if now >= share.since + self._limit(share) or now >= self.end:
                self._stop(share, (None, "timeout", None))

    def _limit(self, share: _Share) -> float:
        """The time limit of the call a share is running (its last answered: the default)."""
        return self.limits[share.due[0]] if share.due else self.timeout_s

    def _read(self, share: _Share) -> None:
        chunk = os.read(share.fd, 65536)
        share.data += chunk
        while b"\n" in share.data and share.due:
            line, _, rest = bytes(share.data).partition(b"\n")
            share.data = bytearray(rest)
            outcome = parse_outcome(line)
            if outcome is None:
                return self._stop(share, None)
            self.outcomes[share.due.pop(0)] = outcome
            share.since = time.monotonic()
        if not chunk or len(share.data) > MAX_LINE or (not share.due and share.data):
            self._stop(share, None if share.due or share.data else ())

    def _stop(self, share: _Share, outcome: tuple | None) -> None:
        """End a share's process; its current call gets `outcome` (None: a crash; (): it had
        none left), the calls after it go back to the queue."""
        _kill_group(share.pid)
        os.waitpid(share.pid, 0)
        os.close(share.fd)
        del self.running[share.fd]
        if share.due:
            self.outcomes[share.due[0]] = outcome or (
                None, "crash", "its process died, or wrote something that is not an outcome")
            self.todo = share.due[1:] + self.todo


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def kill_leftovers() -> int:
    """Kill every process below the host (it is a subreaper: orphans of calls come to it) and
    reap them; how many there were."""
    from posttrain.sandbox.procs import descendants
    pids = [p for p in descendants(os.getpid()) if p != os.getpid()]
    for pid in pids:
        _kill_group(pid)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break
    return len(pids)


# -- the host's loop ----------------------------------------------------------------------------

# what a verifier imports only when first called (posttrain/data/gym.py imports reasoning-gym
# lazily: it is optional): imported once here, before any fork, or every call's process imports
# it again (reasoning-gym: one to two seconds, past a short reward.timeout_s on a busy machine)
_LAZY_IMPORTS = {"reasoning_gym": ("reasoning_gym",)}


def warm_up(verifiers: list[str] = ()) -> None:
    """Import and run the verifiers once before any fork: every call's process then starts
    with math-verify's parsers built (they build lazily, tens of milliseconds each time) and
    with the modules the run's `verifiers` import on first use already imported."""
    import importlib
    from posttrain.data.tasks import Problem
    from posttrain.rewards.verifiers import VERIFIERS
    for name in ("math", "countdown"):
        try:
            VERIFIERS[name]("\\boxed{12}", Problem("1 + 11?", "12", {"numbers": [1, 11]}))
        except Exception:  # noqa: BLE001 - a warm-up only
            pass
    for module in (m for name in verifiers for m in _LAZY_IMPORTS.get(name, ())):
        try:
            importlib.import_module(module)
        except ImportError:   # (the call then says that the optional package is missing)
            pass


def read_frame(fd: int) -> Any | None:
    """One request from the trainer (None: the trainer closed the pipe)."""
    head = _read_exactly(fd, 8)
    if head is None:
        return None
    data = _read_exactly(fd, struct.unpack(">Q", head)[0])
    return None if data is None else pickle.loads(data)   # the trainer's own data, never the model's


def _read_exactly(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _reply(fd: int, obj: dict) -> None:
    data = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def main(config: dict[str, Any]) -> None:
    """The host: import the functions, say ready, then answer batches until the trainer closes
    the request pipe."""
    requests, replies = config["request_fd"], config["reply_fd"]
    for fd in (requests, replies):
        os.set_inheritable(fd, False)   # (a call's exec'd program never holds them)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)                    # nothing below the host reads the trainer's pipes
    os.dup2(2, 1)                       # what a call prints goes to stderr
    seccomp.not_dumpable()
    seccomp.subreaper()
    try:
        for spec in config["specs"]:
            _FUNCTIONS[spec] = load_function(spec, add_cwd=config.get("add_cwd", False))
        warm_up(config.get("verifiers", []))
    except Exception as e:  # noqa: BLE001 - reported to the trainer in one line
        _reply(replies, {"error": cut(f"{type(e).__name__}: {e}", 2000)})
        return
    _reply(replies, {"ready": True})
    while (request := read_frame(requests)) is not None:
        calls, deadline = request
        outcomes = Batch(calls, config["workers"], config["timeout_s"], deadline,
                         (requests, replies)).run()
        _reply(replies, {"outcomes": [list(o) for o in outcomes],
                         "leftovers_killed": kill_leftovers()})
