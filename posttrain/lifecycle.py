"""When a run saves itself and when it stops, shared by `train` and the sft / dpo / reward-model
stages: a checkpoint every N optimizer steps and every M minutes of wall time, one when SIGINT or
SIGTERM arrives (the step in flight finishes first, then the run exits cleanly with the command
that resumes it), one when `max_minutes` ends the run, and `--resume auto` to find the run a
command would continue.

The signal handler only sets a flag; the loop reads it between steps, so a checkpoint is never
written from inside a half-done step. Under torchrun every rank agrees on "save now" and "stop
now" through one all-reduce of two numbers per step.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from posttrain.checkpoint import latest_checkpoint
from posttrain.distributed import SINGLE, World, global_max

log = logging.getLogger(__name__)


class Lifecycle:
    """A run's checkpoint policy and its stop flag. Use as a context manager: inside it, SIGINT
    and SIGTERM ask the run to stop after the current step (a second SIGINT aborts at once)."""

    def __init__(self, every_steps: int = 0, every_minutes: float | None = None,
                 world: World = SINGLE) -> None:
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.world = world
        self.stop_signal: str | None = None   # the signal that asked to stop, once one did
        self._last_save = time.monotonic()
        self._previous: dict[int, Any] = {}

    # -- signals ---------------------------------------------------------------------------
    def __enter__(self) -> "Lifecycle":
        if threading.current_thread() is threading.main_thread():   # (handlers live there only)
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt   # the second Ctrl-C: the user does not want to wait
        self.stop_signal = name
        log.warning("%s received: the run finishes this step, saves a checkpoint and exits "
                    "(Ctrl-C again to abort without saving)", name)

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

    def saved(self) -> None:
        """A checkpoint was written: the minutes count from now."""
        self._last_save = time.monotonic()


def resume_command(command: str, run_dir: Path) -> str:
    return f"posttrain {command} --resume {run_dir}"


def _same_config(saved: dict[str, Any], config: dict[str, Any]) -> bool:
    """Equal as written to config.json (tuples read back as lists), run_dir aside, and the
    records that are not config fields (`_isolation`) aside."""
    config = json.loads(json.dumps(config, default=str))
    return ({k: v for k, v in saved.items() if k != "run_dir" and not k.startswith("_")}
            == {k: v for k, v in config.items() if k != "run_dir"})


def _finished(folder: Path) -> bool:
    """The run ended (summary.json written) other than by a signal: nothing to continue."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return not summary.get("stopped_by")


def find_run_to_resume(config: dict[str, Any], run_dir: str | None,
                       root: Path = Path("runs")) -> Path | None:
    """`--resume auto`: the run folder this config would continue, or None (start afresh).

    With a run_dir: that folder, if it holds a complete checkpoint and the same config. Without
    one: the newest folder under `root` whose config.json equals this config (run_dir aside)
    and which holds a complete checkpoint. A run that finished is not continued."""
    candidates = [Path(run_dir)] if run_dir else sorted(
        (p for p in root.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for folder in candidates:
        saved = folder / "config.json"
        if not saved.is_file() or latest_checkpoint(folder) is None or _finished(folder):
            continue
        try:
            if _same_config(json.loads(saved.read_text()), config):
                return folder
        except json.JSONDecodeError:
            continue
    return None
