"""Calling reward functions that may raise, hang, or return garbage, without stopping training."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any


class RewardTimeout(Exception):
    pass


def load_function(spec: str, add_cwd: bool = True) -> Callable[..., Any]:
    """'package.module:function' -> the function; errors name the part that is wrong.
    `add_cwd`: 'mymod:fn' may name mymod.py in the working directory (as TRL's do); the reward
    sandbox passes False (its working directory holds nothing of the user's)."""
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r} must look like 'module:function'")
    module_name, _, attr = spec.partition(":")
    if add_cwd and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def call_with_limits(fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float,
                     n: int | None = None) -> tuple[Any, str, str | None]:
    """Run fn(**kwargs) in this process -> (value, status, traceback of a failure); status is
    'ok', 'unscored', 'error', 'timeout' or 'nonfinite'; `n`: a batch call (TRL's signature) for
    n responses, whose value is `as_rewards`' list. Used only with reward.workers 0
    (rewards/pool.py is the safe path).

    In the main thread a SIGALRM timer interrupts a hang in Python code (the common case: a loop
    or a regex). Elsewhere, or on platforms without SIGALRM, the call runs in a daemon thread that
    is abandoned on timeout: the result is discarded, but that thread cannot be killed. SystemExit
    is a failed call; KeyboardInterrupt (the user's second Ctrl-C) still stops the run.
    """
    try:
        value = call_with_timeout(fn, kwargs, timeout_s)
        if n is not None:
            return as_rewards(value, n), "ok", None
    except RewardTimeout:
        return None, "timeout", None
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - any failure of user code becomes the fallback reward
        return None, "error", traceback.format_exc()[-4000:]
    return (*as_reward(value), None)


def awaited(value: Any) -> Any:
    """An `async def` reward function's result (TRL awaits them): run on an event loop of its
    own; anything else as it is."""
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value
        return asyncio.run(wait())
    return value


def call_with_timeout(fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float) -> Any:
    """fn(**kwargs), or RewardTimeout after `timeout_s` seconds (SIGALRM in the main thread, an
    abandoned daemon thread elsewhere); the function's own exceptions propagate."""
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        return _call_with_alarm(fn, kwargs, timeout_s)
    return _call_in_thread(fn, kwargs, timeout_s)


def as_reward(value: Any) -> tuple[float | None, str]:
    """What a reward function returned, as (float, 'ok'), (None, 'unscored') for None (TRL: not
    this function's to score), (None, 'error') for a non-number, (None, 'nonfinite') for NaN or
    Inf. A one-element list is its element."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if value is None:
        return None, "unscored"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None, "error"
    return (value, "ok") if math.isfinite(value) else (None, "nonfinite")


def as_rewards(values: Any, n: int) -> list[float | None | str]:
    """What a batch call (TRL's signature) returned for `n` responses: one entry each, a float,
    None (unscored) or the status of a bad value ('error', 'nonfinite'). Anything but a sequence
    of `n` raises ValueError (the whole call failed)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise ValueError(f"a batch reward function must return a list of {n} rewards, "
                         f"got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"a batch reward function returned {len(values)} rewards for "
                         f"{n} completions")
    out: list[float | None | str] = []
    for value in list(values):
        reward, status = as_reward(value if not isinstance(value, (list, tuple)) else object())
        out.append(reward if status == "ok" else None if status == "unscored" else status)
    return out


def _call_with_alarm(fn, kwargs, timeout_s):
    def on_alarm(signum, frame):
        raise RewardTimeout()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return awaited(fn(**kwargs))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(fn, kwargs, timeout_s):
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = awaited(fn(**kwargs))
        except Exception as e:  # noqa: BLE001
            box["error"] = e
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout()
    if "error" in box:
        raise box["error"]
    return box["value"]
