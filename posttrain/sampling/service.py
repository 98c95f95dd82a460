"""The Sampling service every command composes (train, eval, generate, serve, the experiments):
the engine, environment, reward scorer, prompts and seed policy of setup.py, built one way
(the inputs checked by `sampling_inputs` before any model loads, the engine by
`sampling_engine`; `open_sampling` for the commands that only sample), with the one owner of the
engine's life. `train` reads it as the lecture's loop does:

    batch, metrics = sampling.next(step, timings, tallies)   # sampled now, or ahead
    ...the learner's stages and update...
    sampling.sync(step)                                      # the engine gets the new weights

A step's batch comes from a `BatchSource` (sources.py): `InTurn` or `Ahead`, two implementations
of one declared protocol. `evaluate` answers held-out problems with the engine idle between two
batches; `close` stops the engine, the scorer's sandbox and what the environment started."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from posttrain.config.commands import TrainConfig
from posttrain.data.source import PromptStream, Task, build_task
from posttrain.envs import Environment, close_env, for_tokenizer, make_env
from posttrain.model.distributed import SINGLE, World, full_weights_for_generation
from posttrain.model.loading import load_model
from posttrain.rewards.scorer import Scorer
from posttrain.rollout import (RolloutEngine, close_engine, evaluation_engine, make_engine,
                               vllm_options)
from posttrain.util.health import Tally
from posttrain.sampling.batch import ScoredBatch
from posttrain.sampling.collect import generate_and_score
from posttrain.sampling.evaluation import EvalSettings, evaluate
from posttrain.sampling.setup import SamplingSetup
from posttrain.sampling.sources import BatchSource, make_batch_source

log = logging.getLogger("posttrain")


# -- built one way: the inputs checked before any model loads, then the engine ---------------

def isolation(scorer: Scorer, env: Environment) -> dict[str, str]:
    """Where the model's text is handled: the reward scorers' sandbox, and each tool that runs
    the model's code (docs/safety.md); written to the start line, config.json and summary.json."""
    out = {"rewards": scorer.sandbox or "trainer process (reward.workers 0)"}
    for tool in getattr(env, "tools", ()):
        if tool.sandbox is not None:
            out[f"tool {tool.name}"] = tool.sandbox
    return out


def sampling_inputs(cfg: TrainConfig, check=None, run_dir: Path | None = None,
                    judge: bool = True) -> tuple[Task, Environment, Scorer]:
    """The task (data errors surface here), its environment (unknown environments and tools
    too), then `check()` (the command's own checks: a teacher's folder), then the reward scorer
    with its sandbox started (a function the sandbox cannot import fails here too); where the
    model's text runs is said once. `run_dir`: where the LLM judge keeps its replies; `judge`
    False: no judge (eval and generate score with the verifier alone)."""
    task = build_task(cfg.data, needs_answer=cfg.reward.verifier != "none")
    env = make_env(cfg.env, task)
    if check is not None:
        check()
    scorer = Scorer(cfg.reward, task.verifier, cfg.data.system_prompt, cfg.model.autocast,
                    run_dir=run_dir, judge=judge)
    scorer.start()
    log.info("the model's text runs in: %s",
             ", ".join(f"{k} {v}" for k, v in isolation(scorer, env).items()))
    return task, env, scorer


def sampling_engine(cfg: TrainConfig, path: str | Path, model: Any, tokenizer: Any,
                    world: World = SINGLE) -> RolloutEngine:
    """The engine `rollout.backend` names over `model` (vLLM: loaded from `path`)."""
    return make_engine(cfg.rollout.backend, model, tokenizer, cfg.rollout.autocast,
                       cfg.rollout.weights, **vllm_options(cfg, path, model, world))


def load_sampled_model(cfg: TrainConfig, model: Any = None, tokenizer: Any = None,
                       weights: bool = True) -> tuple[Any, Any, str | Path]:
    """The model `model.path` names (default: the embedded one) and its tokenizer, unless given;
    `weights=False`: the tokenizer only. Returns (model, tokenizer, the folder it came from)."""
    return load_model(cfg.model, model, tokenizer, weights=weights)


@dataclass(kw_only=True)
class Sampling(SamplingSetup):
    """Sampling and scoring for a run; `source` (train) is where each step's batch comes from."""

    source: BatchSource | None = None
    closed: bool = field(default=False, init=False, repr=False)

    def collect(self, timings: Counter, tallies: dict[str, Tally] | None = None
                ) -> tuple[ScoredBatch, dict[str, float]]:
        """One step's batch sampled and scored now (dynamic sampling: refilled)."""
        return generate_and_score(self, timings, tallies)

    def start(self, version: int, in_flight: Path | None = None) -> None:
        """The step source from `version` (the step a resumed run continues from), with a
        checkpoint's batches sampled and not trained on (`in_flight`)."""
        self.source = make_batch_source(self.cfg.rollout, self.collect, self.engine, self.prompts,
                                        version)
        if in_flight is not None:
            self.source.restore(in_flight)

    def next(self, step: int, timings: Counter, tallies: dict[str, Tally]
             ) -> tuple[ScoredBatch, dict[str, float]]:
        return self.source.next(step, timings, tallies)

    @property
    def version(self) -> int:
        """The weights the step about to train holds (a step number)."""
        return self.source.version

    def sync(self, step: int) -> None:
        """Step `step`'s update is done: the engine gets the new weights (vLLM: a push; sampling
        ahead: loaded between two batches)."""
        self.source.after_update(step)

    def paused(self, load_latest: bool = True) -> AbstractContextManager[None]:
        """The engine idle between two batches (an evaluation, a checkpoint)."""
        return self.source.paused(load_latest)

    def save(self, folder: Path) -> None:
        """The batches sampled and not trained on, into a checkpoint (call while paused)."""
        self.source.save(folder)

    def evaluate(self, model, problems: list, settings: EvalSettings) -> dict[str, Any]:
        """Greedy held-out answers by the one evaluator, with the engine in its evaluation form
        (the weights in their own precision) and, under FSDP, the full weights gathered."""
        view = self.view(engine=evaluation_engine(self.engine), generator=None)   # (greedy)
        idle = self.paused() if self.source is not None else nullcontext()
        with full_weights_for_generation(model, self.world), idle:
            return evaluate(view, problems, settings)

    def view(self, **changes: Any) -> SamplingSetup:
        """The setup's parts with `changes` (another engine, no generator), as a plain
        SamplingSetup: it owns nothing, the service still closes the engine."""
        parts = {f.name: getattr(self, f.name) for f in fields(SamplingSetup)}
        return SamplingSetup(**{**parts, **changes})

    def isolation(self) -> dict[str, str]:
        return isolation(self.scorer, self.env)

    def close(self, wait_s: float = 60.0) -> None:
        """The engine (its threads, processes and servers; a stopped run's waits no longer than
        `wait_s`), the reward sandbox and judge, what the environment started. Once: a second
        call (an error after the run closed) does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.source is not None:
            self.source.close(wait_s)
        elif self.engine is not None:
            close_engine(self.engine)
        if self.scorer is not None:
            self.scorer.close(final=True)
        close_env(self.env)


@contextmanager
def open_sampling(job, model: Any = None, tokenizer: Any = None, *,
                  sample: bool = True) -> Iterator[Sampling]:
    """What `eval` and `generate` sample with, stopped however the command ends: the task,
    environment and verifier checked before any model loads, the model `model.path` names
    loaded (`sample` False: its tokenizer only, an environment demonstrates) and its engine
    built. The training prompts are `prompts` (`prompts.task` holds the held-out problems);
    samples draw from the job's generator."""
    cfg = job.cfg
    task, env, scorer = sampling_inputs(cfg, judge=False)
    sampling = Sampling(cfg=cfg, engine=None, tokenizer=None, scorer=scorer, env=env,
                        prompts=PromptStream(task, cfg.seed), world=job.world,
                        generator=job.generator)
    try:
        model, tokenizer, path = load_sampled_model(cfg, model, tokenizer, weights=sample)
        sampling.tokenizer, sampling.env = tokenizer, for_tokenizer(env, tokenizer)
        if sample:
            sampling.engine = sampling_engine(cfg, path, model, tokenizer)
        yield sampling
    finally:
        sampling.close()
