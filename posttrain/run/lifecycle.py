"""One run's lifecycle, the same for every command: `start_job` (threads, seed, world, the
checkpoint a resumed run continues from), `open_folder` (config.json, the metrics writer and
trackers), `Steps` (the frame of a command's own loop: time budget, checkpoint cadence, stop
signals) and
`finish_job` / `stop_job` (summary.json). What a command trains lives in its own parts, which
extend `Job`.

Checkpoints: every N optimizer steps, every M minutes of wall time, when `max_minutes` ends the
run, and when SIGINT or SIGTERM arrives: the first signal sets a flag the loop reads between
steps (under torchrun, an all-reduce after the step and one more before the checkpoint
decision make every rank agree), so the step in flight
finishes, is saved (before any evaluation) and the run exits with the command that resumes it.
A step still running `checkpoint.stop_grace_s` after the signal, or at a second signal, is
abandoned (StepAbandoned, raised in the main thread, whose waits signals interrupt): the run
exits with its last checkpoint, summary.json naming the abandoned step. Should it still not end
(a call no signal reaches, a cleanup that hangs), the process ends stop_grace_s later, with
summary.json written and the logs closed (`arm_hard_exit`). `--resume auto` finds the run a
command would continue. (The cadence and the signal handlers: run/signals.py.)
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from posttrain.run.checkpoint import latest_checkpoint, resume_point
from posttrain.model.distributed import SINGLE, World, barrier, global_max, init_world
from posttrain.logs.metrics import MetricsLogger, NullLogger, resume_logs, write_json_atomic
from posttrain.run.optim import seed_everything
from posttrain.run.signals import Lifecycle, StepAbandoned
from posttrain.util.errors import ConfigError

log = logging.getLogger(__name__)
_clock = time.perf_counter   # the training clock of --max_minutes (a test's own clock replaces it)
SAMPLING_COMMANDS = ("eval", "generate", "serve")   # they train nothing; `--run_dir none`: no folder


@dataclass(kw_only=True)
class Job:
    """One command's run, whatever it trains: its config (a `RunOptions`), world, folder and
    writer, the checkpoint it resumed from, and where the loop stands. `train` and the offline
    stages extend it with their models (rl/job.py::RLJob, stages/common.py::OfflineJob)."""

    command: str                          # train, sft, dpo, reward-model, eval, generate
    cfg: Any
    world: World = SINGLE
    run_dir: Path | None = None           # None: `--run_dir none` (eval, generate)
    generator: torch.Generator | None = None
    logger: MetricsLogger | NullLogger = NullLogger()
    show_progress: bool = True
    ckpt: Path | None = None              # the checkpoint folder resumed from
    state: dict[str, Any] | None = None   # ... and its trainer state
    start_step: int = 0                   # optimizer steps (train: batches) already taken
    train_seconds: float = 0.0            # in training steps, this process and before a resume
    steps_done: int = 0                   # the last step taken
    saved_step: int = -1                  # the step of the last checkpoint written
    bar: Any = None                       # the loop's progress bar (a step may set its postfix)
    abandoned_step: int | None = None     # a stop signal's step that could not finish
    hard_exit: Any = None                 # the timer that ends a stopped run whose cleanup hangs
    stop_by: float | None = None          # a stopped run's deadline (time.monotonic()), if any

    @property
    def resumed(self) -> bool:
        return self.ckpt is not None

    def cleanup_wait_s(self, default: float = 60.0) -> float:
        """One wait of a stopped run's cleanup (an engine's close waits twice): half what is left
        until `stop_by` (the grace's end; after an abandoned step, the hard exit's), else `default`."""
        return default if self.stop_by is None else max(self.stop_by - time.monotonic(), 0.0) / 2

    def parts(self) -> dict[str, Any]:
        """The lifecycle's fields, to build a command's extension of Job from this one."""
        return {f.name: getattr(self, f.name) for f in fields(Job)}


def default_run_dir(command: str, cfg) -> Path | None:
    """cfg.run_dir; None: runs/<name>-<time> (train: the preset's name); 'none': no folder."""
    if not cfg.writes_folder:
        return None
    name = getattr(cfg, "preset", command) if command == "train" else command
    return Path(cfg.run_dir or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def start_job(command: str, cfg, resume: str | Path | None = None, show_progress: bool = True,
              threads: int | None = None) -> Job:
    """Threads (cfg.threads, else `threads`: sampling ahead on a CPU takes the lower half of the
    cores), seed, world (torchrun: join the process group), and the newest checkpoint of a
    resumed run that loads. Nothing is written yet; `--run_dir none` is refused where the command
    needs a folder."""
    if not cfg.writes_folder and command not in SAMPLING_COMMANDS:
        raise ConfigError(f"--run_dir none: `posttrain {command}` writes checkpoints and its model "
                          "to a run folder; give it one (or leave --run_dir out)")
    if cfg.threads or threads:   # (the user's --threads wins over the async core split)
        torch.set_num_threads(cfg.threads or threads)
    generator = seed_everything(cfg.seed)
    parallel = getattr(cfg, "parallel", None)
    world = init_world(parallel.strategy) if parallel is not None else SINGLE
    run_dir = Path(resume) if resume else default_run_dir(command, cfg)
    point = resume_point(run_dir) if resume else None
    if resume and point is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir}/checkpoints")
    ckpt, state = point if point is not None else (None, None)
    return Job(command=command, cfg=cfg, world=world, run_dir=run_dir, generator=generator,
               show_progress=show_progress, ckpt=ckpt, state=state)


def make_folder(job: Job) -> None:
    """The run folder (rank 0), once the inputs have loaded: a refused run leaves none."""
    if job.world.main and job.run_dir is not None:
        job.run_dir.mkdir(parents=True, exist_ok=True)
    barrier(job.world)


def open_folder(job: Job, record: dict[str, Any], tensorboard: bool = False) -> None:
    """config.json (`record`: the config and what the command adds to it), and the writer of
    metrics, samples and summary with the trackers; a resumed run's logs cut back to what they
    were at its checkpoint. Rank 0 writes; the other ranks (and `--run_dir none`) write nothing."""
    make_folder(job)
    if not job.world.main or job.run_dir is None:
        return
    job.logger = MetricsLogger(job.run_dir, tensorboard, job.resumed, job.cfg.report_to,
                               job.cfg.to_dict())
    job.logger.write_json("config.json", record)
    if job.state is not None:   # rows a killed run wrote after its checkpoint are redone
        resume_logs(job.logger, job.state)


def out_of_time(job: Job) -> bool:
    minutes = job.cfg.max_minutes
    return minutes is not None and job.train_seconds >= minutes * 60


class Steps:
    """The frame of a command's own training loop: its time budget, progress bar, checkpoint
    cadence and stop signals. The command reads top to bottom:

        with Steps(job, total, "train") as steps:
            for step in steps:                      # ends at `total`, max_minutes or a signal
                with steps.timed(step):             # the training clock (the slowest rank's)
                    ...one step...
                if steps.evaluation_due(step, every):
                    ...evaluate (untimed)...
                if steps.checkpoint_due(step):      # the cadence, a stop signal, max_minutes
                    with steps.saving(step):
                        ...save...
        if steps.stop_signal: ...                   # summary.json says how to continue

    A stopped run saves its finished step before anything else (no evaluation after a signal;
    a signal during one saves at once). `max_minutes` ends the loop early, the last step saved
    so that a longer budget continues from it. A step the signal's grace or a second signal
    abandoned ends the `with` block (StepAbandoned is caught there): `job.abandoned_step`."""

    def __init__(self, job: Job, total: int, desc: str, *, save_last: bool = True) -> None:
        self.job, self.total, self.save_last = job, total, save_last
        cfg = job.cfg
        grace = getattr(cfg.checkpoint, "stop_grace_s", None)   # (inf: None, Timer(inf) fails)
        self.grace = None if grace is None or math.isinf(grace) else grace
        self.lifecycle = Lifecycle(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes,
                                   job.world, self.grace,
                                   lambda signum: arm_hard_exit(job, signum, self.grace))
        self.bar = tqdm(total=total, initial=job.start_step, desc=desc, dynamic_ncols=True,
                        disable=not (job.show_progress and job.world.main))
        self.want_save = self.stop = False

    @property
    def stop_signal(self) -> str | None:
        """The signal that stopped the run, or None."""
        return self.lifecycle.stop_signal

    def __enter__(self) -> "Steps":
        self.job.steps_done, self.job.bar = self.job.start_step, self.bar
        self.lifecycle.__enter__()   # SIGINT / SIGTERM: finish the step, save, stop
        return self

    def __exit__(self, kind, error, tb) -> bool:
        self.lifecycle.__exit__(kind, error, tb)
        self.bar.close()
        job = self.job   # (the cleanup of a stopped run waits no longer than its grace)
        job.stop_by = job.stop_by or self.lifecycle.deadline
        if isinstance(error, StepAbandoned):
            job.abandoned_step = job.steps_done + 1
            kept = job.saved_step if job.saved_step >= 0 else "none written by this process"
            log.warning("%s: step %d abandoned; the run exits with its last checkpoint (step %s)",
                        error, job.abandoned_step, kept)
            return True
        return False

    def __iter__(self) -> Iterator[int]:
        for step in range(self.job.start_step + 1, self.total + 1):
            if self.stop:
                return
            if out_of_time(self.job):
                log.info("max_minutes=%s reached after %d steps", self.job.cfg.max_minutes, step - 1)
                return
            yield step

    @contextmanager
    def timed(self, step: int) -> Iterator[None]:
        """One step on the training clock; then whether the cadence wants a checkpoint and
        whether a stop signal came (the same on every rank)."""
        t0 = _clock()
        yield
        job = self.job
        job.train_seconds += global_max(_clock() - t0, job.world)
        job.steps_done = step
        self.bar.update(1)
        self.want_save, self.stop = self.lifecycle.after_step(step)

    def evaluation_due(self, step: int, every: int) -> bool:
        """Every `every` steps before the last (the command evaluates after its loop); never
        once a stop signal has come (a stopped run is saved, not evaluated)."""
        return bool(every) and step % every == 0 and step < self.total and not self.stop

    def checkpoint_due(self, step: int) -> bool:
        """The cadence (after the last step only with `save_last`), a stop signal (also one
        that came during an evaluation), or max_minutes ending the run after this step. Every
        rank calls it once a step, after any evaluation: it agrees on a stop signal (an
        all-reduce under torchrun) and a stop it finds ends the loop at its next step."""
        self.stop = self.stop or self.lifecycle.stop_agreed()
        last = step == self.total
        out = out_of_time(self.job) and not last
        return (self.want_save and (self.save_last or not last)) or self.stop or out

    @contextmanager
    def saving(self, step: int) -> Iterator[None]:
        """A checkpoint being written: the grace running out lets it finish."""
        with self.lifecycle.saving():
            yield
        self.job.saved_step = step
        self.lifecycle.saved()


def arm_hard_exit(job: Job, signum: int, seconds: float | None) -> None:
    """The last resort once a step is abandoned: if the run has not finished (finish_job)
    `seconds` later, summary.json is written here and the process ends (exit 128 + signum).
    A thread stuck where no signal reaches it cannot be stopped any other way."""
    if seconds is None or job.hard_exit is not None:
        return
    job.stop_by = time.monotonic() + seconds

    def hard_exit() -> None:
        name = signal.Signals(signum).name
        log.error("the stopped run did not end within checkpoint.stop_grace_s=%g s after its step "
                  "was abandoned: the process exits now", seconds)
        if job.world.main and job.run_dir is not None:
            try:
                write_json_atomic(job.run_dir / "summary.json", {
                    "run_dir": str(job.run_dir), "steps": job.steps_done, "stopped_by": name,
                    "abandoned_step": job.steps_done + 1, "hard_exit": True,
                    "resume": resume_command(job.command, job.run_dir)})
            except OSError:
                pass
        closing = threading.Thread(target=job.logger.close, daemon=True)   # (TensorBoard and
        closing.start()                                         # trackers flushed, if they can
        closing.join(min(seconds, 10.0))                        # be within 10 s)
        logging.shutdown()
        os._exit(128 + signum)
    job.hard_exit = threading.Timer(seconds, hard_exit)
    job.hard_exit.daemon = True
    job.hard_exit.start()


def finish_job(job: Job, summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json (a training command's with its steps and training minutes), the writer
    closed; every rank waits."""
    if job.command not in SAMPLING_COMMANDS:
        summary.update(steps=job.steps_done, train_minutes=job.train_seconds / 60)
    job.logger.close()
    job.logger.write_json("summary.json", summary)
    barrier(job.world)
    if job.hard_exit is not None:   # (the run ended: no last resort needed)
        job.hard_exit.cancel()
    return summary


def stop_job(job: Job, signal_name: str, summary: dict[str, Any]) -> dict[str, Any]:
    """A signal stopped the run after its last step (checkpoint written): summary.json says so
    and how to continue; no final model, no final evaluation (a pre-empted job has little time)."""
    summary.update(stopped_by=signal_name, resume=resume_command(job.command, job.run_dir))
    if job.abandoned_step is not None:   # (the steps after the last checkpoint are redone)
        last = latest_checkpoint(job.run_dir) if job.run_dir is not None else None
        summary.update(abandoned_step=job.abandoned_step, checkpoint=last and str(last))
    finish_job(job, summary)
    if job.world.main:
        log.warning("stopped by %s after step %d; continue with: %s", signal_name,
                    job.steps_done, summary["resume"])
    return summary


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
