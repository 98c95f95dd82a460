"""Where a step's batch comes from (docs/scaling.md "Asynchronous training").

- `InTurn` (rollout.max_staleness 0, the lecture's loop): sample and score now, update, push the
  new weights; the engine waits while the trainer updates and the trainer while the engine samples.
- `Ahead` (max_staleness K >= 1): a thread keeps the engine (vLLM, in its own processes or
  servers) sampling and scoring the next batches while the trainer updates. After each update the
  trainer writes its weights as a new version and goes on; the engine loads the newest version
  between two batches. Every batch carries the version that sampled it; the trainer takes the
  oldest ready batch, and one more than K versions older than the weights it trains is dropped
  (counted) and its prompts drawn again. The engine holds at most `rollout.ahead` batches ready or
  in flight, which bounds the staleness by construction when `async_ahead` is left at K.

Versions are step numbers: version v is the policy after step v's update (0: the start), so a
batch sampled by version v and trained at step n whose weights are version n - 1 is n - 1 - v
updates stale. Samples are the engine's: the update's importance weights read what sampled them
(`rollout.logp_B_T`, the behaviour policy mu) against the trainer's pi_old (rl/loss_terms.py).

A checkpoint pauses the engine between two batches and saves the batches sampled but not yet
trained on (`in_flight/` in the checkpoint, with their versions): a resumed run trains on exactly
them, then samples on from the saved prompt position.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.sampling.batch import ScoredBatch
from posttrain.data.source import PromptStream
from posttrain.data.tasks import Problem
from posttrain.util.health import Tally
from posttrain.rollout import Rollout, close_engine

log = logging.getLogger("posttrain")

# sample and score one step's batch: (timings, tallies) -> (batch, its metrics)
Collect = Callable[[Counter, dict[str, Tally]], tuple[ScoredBatch, dict[str, float]]]


@dataclass
class Sampled:
    """A batch the engine sampled and scored, waiting for the trainer."""

    batch: ScoredBatch
    metrics: dict[str, float]
    version: int                              # the weights that sampled it (a step number)
    drawn: list[tuple[int, int]]              # its prompts, as the prompt stream drew them
    timings: Counter = field(default_factory=Counter)       # generate, reward (the engine's time)
    tallies: dict[str, Tally] = field(default_factory=dict)


class BatchSource(Protocol):
    """Where a step's batch comes from: `InTurn` (sampled now) or `Ahead` (sampled while the
    trainer updates). `version` is the trainer's weights (a step number)."""

    version: int

    def next(self, step: int, timings: Counter, tallies: dict[str, Tally]
             ) -> tuple[ScoredBatch, dict[str, float]]:
        """The batch step `step` trains on, and its sampling metrics."""

    def after_update(self, step: int) -> None:
        """The update of `step` is done: the engine gets the new weights (now or between two
        batches)."""

    def paused(self, load_latest: bool = True) -> AbstractContextManager[None]:
        """The engine idle between two batches (an evaluation, a checkpoint)."""

    def close(self, wait_s: float = 60.0) -> None:
        """No new batch; the engine, its threads, processes and servers stopped."""

    def save(self, folder: Path) -> None:
        """The batches sampled and not yet trained on, into a checkpoint (call while paused)."""

    def restore(self, folder: Path) -> None:
        """A checkpoint's batches sampled and not trained on: trained on first, or their
        prompts drawn again."""


class InTurn:
    """Sample and score now; after the update, push the weights (rollout.max_staleness 0)."""

    def __init__(self, collect: Collect, engine, prompts: PromptStream, version: int) -> None:
        self.collect, self.engine, self.prompts = collect, engine, prompts
        self.version = version              # the trainer's weights (a step number)
        self.idle_since: float | None = None

    def next(self, step: int, timings: Counter, tallies: dict[str, Tally]):
        t0 = time.perf_counter()
        if self.idle_since is not None:   # the engine waited through the last update and push
            timings["engine_idle"] += t0 - self.idle_since
        batch, metrics = self.collect(timings, tallies)
        self.idle_since = time.perf_counter()
        timings["trainer_wait"] += self.idle_since - t0
        return batch, metrics

    def after_update(self, step: int) -> None:
        self.engine.sync_weights()         # the engine gets the new weights (vLLM: a push)
        self.version = step

    @contextmanager
    def paused(self, load_latest: bool = True) -> Iterator[None]:
        yield                              # (the engine holds the trainer's weights already)

    def close(self, wait_s: float = 60.0) -> None:   # (nothing in flight to wait for)
        close_engine(self.engine)

    def save(self, folder: Path) -> None:   # (nothing sampled ahead)
        pass

    def restore(self, folder: Path) -> None:
        """(An asynchronous run resumed in turn: its batches' prompts are drawn again.)"""
        self.prompts.give_back(prompts_in_flight(folder))


class Ahead:
    """The engine samples ahead of the trainer in a thread (rollout.max_staleness K >= 1)."""

    def __init__(self, collect: Collect, engine, prompts: PromptStream, max_staleness: int,
                 ahead: int, version: int) -> None:
        self.collect, self.engine, self.prompts = collect, engine, prompts
        self.K, self.ahead = max_staleness, ahead
        self.cond = threading.Condition()
        self.ready: deque[Sampled] = deque()
        self.in_flight = False
        self.pauses = 0
        self.closed = False
        self.error: BaseException | None = None
        self.version = version              # the trainer's weights
        self.engine_version = version       # the weights the engine holds
        self.published: tuple[int, Any] | None = None   # the newest version written, not loaded
        self.returned: list[tuple[int, int]] = []       # prompts of dropped batches, to draw again
        self.engine_idle = 0.0              # the engine's waits since the trainer last took a batch
        self.dropped_samples = 0
        self.thread: threading.Thread | None = None

    # -- the engine's side (a thread) ---------------------------------------------------------

    def _room(self) -> bool:
        return self.closed or (not self.pauses and len(self.ready) < self.ahead)

    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    t0 = time.perf_counter()
                    self.cond.wait_for(self._room)
                    self.engine_idle += time.perf_counter() - t0
                    if self.closed:
                        return
                    self.in_flight = True
                sampled = self._sample()
                with self.cond:
                    self.ready.append(sampled)
                    self.in_flight = False
                    self.cond.notify_all()
        except BaseException as e:   # (the trainer raises it at its next batch)
            with self.cond:
                if not self.closed:
                    self.error = e
                self.in_flight = False
                self.cond.notify_all()

    def _sample(self) -> Sampled:
        """Load the newest version written, then sample and score one batch from it."""
        self._load_newest()
        self._return_prompts()
        timings, tallies = Counter(), {}
        self.prompts.drawn = []
        try:
            batch, metrics = self.collect(timings, tallies)
            drawn = self.prompts.drawn
        finally:
            self.prompts.drawn = None
        version = self.engine_version
        batch = replace(batch, version_B=torch.full((len(batch.rewards_B),), version,
                                                    dtype=torch.long))
        return Sampled(batch, metrics, version, drawn, timings, tallies)

    def _load_newest(self) -> None:
        with self.cond:
            newest, self.published = self.published, None
        if newest is not None:
            self.engine.load(newest[1])
            self.engine_version = newest[0]

    def _return_prompts(self) -> None:
        with self.cond:
            returned, self.returned = self.returned, []
        if returned:
            self.prompts.give_back(returned)

    # -- the trainer's side ---------------------------------------------------------------------

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="posttrain-sampling-ahead",
                                           daemon=True)
            self.thread.start()

    def next(self, step: int, timings: Counter, tallies: dict[str, Tally]):
        """The oldest ready batch not more than K versions older than the trainer's weights
        (waiting for one if none is ready); the older ones are dropped and counted."""
        self.start()
        t0 = time.perf_counter()
        dropped = 0
        with self.cond:
            while True:
                self.cond.wait_for(lambda: self.ready or self.error is not None)
                if self.error is not None:
                    raise self.error
                sampled = self.ready.popleft()
                self.cond.notify_all()
                if self.version - sampled.version <= self.K:
                    break
                dropped += 1
                self.dropped_samples += len(sampled.batch.rewards_B)
                self.returned += sampled.drawn
            idle, self.engine_idle = self.engine_idle, 0.0
            waiting = len(self.ready)
        timings["trainer_wait"] += time.perf_counter() - t0
        timings["engine_idle"] += idle
        timings.update(sampled.timings)
        tallies.update(sampled.tallies)
        if dropped:
            log.warning("step %d: %d batch(es) more than %d versions old dropped (their prompts "
                        "are drawn again)", step, dropped, self.K)
        return sampled.batch, {**sampled.metrics, **self.staleness_metrics(sampled, dropped, waiting)}

    def staleness_metrics(self, sampled: Sampled, dropped: int, waiting: int) -> dict[str, float]:
        """The step's staleness (with its histogram over 0..K), drops and the engine's lead."""
        staleness = self.version - sampled.version
        out = {"async/staleness": float(staleness), "async/weight_version": float(sampled.version),
               "async/dropped_batches": float(dropped),
               "async/dropped_samples_total": float(self.dropped_samples),
               "async/ready_batches": float(waiting)}
        for k in range(self.K + 1):
            out[f"async/staleness_{k}"] = float(k == staleness)
        return out

    def after_update(self, step: int) -> None:
        """Write the new weights as version `step`; the engine loads them before its next batch
        (a version written before it that the engine never loaded is removed: at most the one
        it holds, the one waiting and the one being written exist at once)."""
        written = self.engine.publish()
        with self.cond:
            superseded, self.published = self.published, (step, written)
            self.version = step
            self.cond.notify_all()
        if superseded is not None:
            self.engine.discard(superseded[1])

    @contextmanager
    def paused(self, load_latest: bool = True) -> Iterator[None]:
        """The engine idle between two batches (an evaluation, a checkpoint); `load_latest`: it
        holds the trainer's newest weights first."""
        with self.cond:
            self.pauses += 1
            self.cond.wait_for(lambda: not self.in_flight)
        try:
            if load_latest:
                self._load_newest()
            self._return_prompts()
            yield
        finally:
            with self.cond:
                self.pauses -= 1
                self.cond.notify_all()

    def close(self, wait_s: float = 60.0) -> None:
        """Stop the thread (no new batch; the one in flight may finish, within `wait_s`: an
        engine shut down under a request can block), then the engine."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.in_flight, timeout=wait_s)
        close_engine(self.engine)
        if self.thread is not None:
            self.thread.join(timeout=wait_s)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """The batches sampled and not yet trained on (call while `paused`)."""
        folder.mkdir(parents=True, exist_ok=True)
        for i, sampled in enumerate(self.ready):
            save_sampled(sampled, folder / f"batch_{i:03d}")
        (folder / "count.json").write_text(json.dumps({"batches": len(self.ready)}))

    def restore(self, folder: Path) -> None:
        if not (folder / "count.json").is_file():
            return
        n = json.loads((folder / "count.json").read_text())["batches"]
        self.ready.extend(load_sampled(folder / f"batch_{i:03d}") for i in range(n))
        log.info("resumed with %d batch(es) sampled before the checkpoint", n)


def prompts_in_flight(folder: Path) -> list[tuple[int, int]]:
    """The prompts of the batches a checkpoint saved in flight (`Ahead.save`), as drawn."""
    if not (folder / "count.json").is_file():
        return []
    n = json.loads((folder / "count.json").read_text())["batches"]
    return [tuple(d) for i in range(n)
            for d in json.loads((folder / f"batch_{i:03d}" / "batch.json").read_text())["drawn"]]


def make_batch_source(rollout_cfg, collect: Collect, engine, prompts: PromptStream,
                      version: int) -> BatchSource:
    """`InTurn` for rollout.max_staleness 0, else `Ahead` from `version` (the step resumed at)."""
    if rollout_cfg.max_staleness == 0:
        return InTurn(collect, engine, prompts, version)
    return Ahead(collect, engine, prompts, rollout_cfg.max_staleness, rollout_cfg.ahead, version)


# -- a sampled batch on disk (safetensors for its tensors, JSON for the rest) --------------------

_ROLLOUT_TENSORS = [f.name for f in fields(Rollout) if f.name != "group_size"]
_BATCH_TENSORS = ("rewards_B", "correct_B", "loss_mask_B_T", "version_B", "scored_B")


def save_sampled(sampled: Sampled, folder: Path) -> None:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    b, ro = sampled.batch, sampled.batch.rollout
    tensors = {f"rollout.{k}": getattr(ro, k) for k in _ROLLOUT_TENSORS if getattr(ro, k) is not None}
    tensors.update({k: getattr(b, k) for k in _BATCH_TENSORS if getattr(b, k) is not None})
    # (cloned: fields may share memory, e.g. a loss mask that is the response mask)
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()},
              str(folder / "tensors.safetensors"))
    meta = {"group_size": ro.group_size, "version": sampled.version, "drawn": sampled.drawn,
            "metrics": sampled.metrics, "timings": dict(sampled.timings),
            "problems": [problem_dict(p) for p in b.problems], "completions": b.completions,
            "transcripts": b.transcripts, "reward_parts": b.reward_parts}
    (folder / "batch.json").write_text(json.dumps(meta, default=str))


def load_sampled(folder: Path) -> Sampled:
    from safetensors.torch import load_file
    t = load_file(str(folder / "tensors.safetensors"))
    meta = json.loads((folder / "batch.json").read_text())
    ro = Rollout(**{k: t.get(f"rollout.{k}") for k in _ROLLOUT_TENSORS},
                 group_size=meta["group_size"])
    batch = ScoredBatch(ro, [problem_from(d) for d in meta["problems"]], meta["completions"],
                        t["rewards_B"], t["correct_B"], t["loss_mask_B_T"],
                        transcripts=meta["transcripts"], reward_parts=meta["reward_parts"],
                        version_B=t["version_B"], scored_B=t.get("scored_B"))
    return Sampled(batch, meta["metrics"], meta["version"], [tuple(d) for d in meta["drawn"]],
                   Counter(meta["timings"]))


def problem_dict(p: Problem) -> dict[str, Any]:
    return {"prompt": p.prompt, "answer": p.answer, "meta": p.meta, "domain": p.domain,
            "messages": list(p.messages) if p.messages is not None else None}


def problem_from(d: dict[str, Any]) -> Problem:
    messages = tuple(d["messages"]) if d["messages"] is not None else None
    return Problem(d["prompt"], d["answer"], d["meta"], d["domain"], messages)
