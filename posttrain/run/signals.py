"""A run's checkpoint cadence and its stop signals (run/lifecycle.py's loop reads them between
steps): `Lifecycle` says when to save and when to stop, the same on every rank, and gives a step
that cannot finish `checkpoint.stop_grace_s` after SIGINT / SIGTERM before it is abandoned
(`StepAbandoned`, raised in the main thread)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from posttrain.model.distributed import SINGLE, World, global_max

log = logging.getLogger(__name__)


class StepAbandoned(KeyboardInterrupt):
    """The step in flight is given up: it did not finish within checkpoint.stop_grace_s of a
    stop signal, or a second signal came. (A KeyboardInterrupt, so that no `except Exception`
    on the way swallows it; lifecycle.Steps catches it.)"""


class Lifecycle:
    """A run's checkpoint policy and its stop flag. Use as a context manager: inside it, SIGINT
    and SIGTERM ask the run to stop after the current step; a step still running `grace_s`
    after the signal, or at a second signal, is abandoned (StepAbandoned in the main thread),
    and `on_abandon(signum)` is called (lifecycle.Steps: arm_hard_exit)."""

    def __init__(self, every_steps: int = 0, every_minutes: float | None = None,
                 world: World = SINGLE, grace_s: float | None = None,
                 on_abandon: Callable[[int], None] | None = None) -> None:
        self.every_steps, self.every_minutes, self.world = every_steps, every_minutes, world
        self.stop_signal: str | None = None   # the signal that asked to stop, once one did
        self.grace_s, self.on_abandon = grace_s, on_abandon
        self._last_save = time.monotonic()
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._expired = False    # the grace ran out: the next signal handled abandons the step
        self._saving = False
        self._closed = False
        self.deadline: float | None = None   # the first signal's time + grace_s

    # -- signals ---------------------------------------------------------------------------
    def __enter__(self) -> "Lifecycle":
        if threading.current_thread() is threading.main_thread():   # (handlers live there only)
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:   # (a grace timer firing now sends nothing more)
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._closed:
            return
        if self.stop_signal is not None and not self._expired:   # a second signal: stop now
            self._abandon(signum, f"a second {name}")
        if self._expired:   # (the grace timer's own signal; a checkpoint being written finishes)
            if not self._saving:
                raise StepAbandoned(f"the step did not finish within checkpoint.stop_grace_s="
                                    f"{self.grace_s:g} s of {self.stop_signal}")
            return
        self.stop_signal = name
        self.deadline = None if self.grace_s is None else time.monotonic() + self.grace_s
        log.warning("%s received: the run finishes this step, saves a checkpoint and exits (a step "
                    "still running after checkpoint.stop_grace_s=%s s, or at a second signal, is "
                    "abandoned and the last checkpoint kept)", name, self.grace_s)
        if self.grace_s is not None and threading.current_thread() is threading.main_thread():
            self._timer = threading.Timer(self.grace_s, self._grace_over, args=(signum,))
            self._timer.daemon = True
            self._timer.start()

    def _abandon(self, signum: int, why: str) -> None:
        """(A second signal, in the main thread.) Give up the step at once."""
        if self.on_abandon is not None:
            self.on_abandon(signum)
        raise StepAbandoned(f"{why} after {self.stop_signal}")

    def _grace_over(self, signum: int) -> None:
        """(The grace timer's thread.) Interrupt the main thread: its handler abandons the step.
        A real signal, not interrupt_main: it wakes a wait blocked in the kernel."""
        with self._lock:
            if self._closed:
                return
            self._expired = True
            log.warning("the step in flight did not finish within checkpoint.stop_grace_s=%g s: "
                        "it is abandoned", self.grace_s)
            if self.on_abandon is not None:
                self.on_abandon(signum)
            signal.pthread_kill(threading.main_thread().ident, signum)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint is being written: the grace running out does not interrupt it (a second
        signal does; the write is atomic, so the previous checkpoint stays)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    # -- the policy ------------------------------------------------------------------------
    def after_step(self, step: int) -> tuple[bool, bool]:
        """(save a checkpoint now, stop now) after optimizer step `step`, the same on every rank."""
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        by_time = (self.every_minutes is not None
                   and time.monotonic() - self._last_save >= self.every_minutes * 60)
        stop = self.stop_signal is not None
        if self.world.distributed:   # one all-reduce: any rank's signal or clock decides for all
            flags = global_max(float(by_steps or by_time) + 2.0 * stop, self.world)
            return flags >= 1, flags >= 2
        return by_steps or by_time or stop, stop

    def stop_agreed(self) -> bool:
        """Whether a stop signal has come to any rank (every rank gets the same answer)."""
        stop = self.stop_signal is not None
        return global_max(float(stop), self.world) >= 1 if self.world.distributed else stop

    def saved(self) -> None:
        """A checkpoint was written: the minutes count from now."""
        self._last_save = time.monotonic()
