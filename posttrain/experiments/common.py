"""What every experiment shares: the run it measures on, a batch from the real sampler and
scorer, a flat gradient, a count sketch of it, mean and spread, and the record it writes."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import math
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from posttrain.sampling.batch import ScoredBatch
from posttrain.config.commands import ConfigError, TrainConfig
from posttrain.experiments import EXPERIMENTS
from posttrain.config.options import DEFAULT_RECIPE, load_config, recipe_path
from posttrain.util.perf import tune_malloc
from posttrain.run.provenance import provenance
from posttrain.rl.job import RLJob, close_sources, start_training
from posttrain.rl.loop import train

log = logging.getLogger("posttrain")


def experiment_module(name: str):
    """The module of experiment `name` (an unknown name is refused with the known ones)."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; known: {', '.join(sorted(EXPERIMENTS))}")
    return importlib.import_module(f"posttrain.experiments.{EXPERIMENTS[name]}")


def experiment_config(module, name: str, overrides: list[str],
                      out: Path | None) -> tuple[TrainConfig, Path]:
    """The default recipe, the experiment's own changes, then the user's (the user's win: a time
    budget only when they give one). The experiment's folder is `out`, else the user's
    --run_dir, else runs/experiments/NAME; its runs go under it (run/, run/ARM)."""
    base = [*module.OVERRIDES, "--max_minutes", "null", *overrides]
    given = load_config(recipe_path(DEFAULT_RECIPE), base).run_dir
    if given is not None and given.lower() == "none":
        raise ConfigError("--run_dir none: an experiment writes its record, figure and runs to a "
                          "folder; give it one (or leave --run_dir out)")
    out = out or (Path(given) if given else Path("runs") / "experiments" / name)
    fixed = ["--run_dir", str(out / "run"), "--tensorboard", "false", "--eval_every", "0"]
    return load_config(recipe_path(DEFAULT_RECIPE), [*base, *fixed]), out


def sample_batch(run: RLJob) -> ScoredBatch:
    """One step's batch as training would draw it: P prompts x G answers, scored."""
    batch, _ = run.sampling.collect(Counter())
    return batch


@dataclass
class Progress:
    """How an experiment shows its progress (bars, or with --no-progress log lines) and its
    --max_minutes: the measurement loops `range` draws end at `deadline` (time.monotonic()),
    and `cut` names the loops cut short, for the record. True when bars are shown."""

    shown: bool = True
    deadline: float = math.inf
    cut: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.shown

    def range(self, n: int, desc: str):
        """range(n) with a progress bar or a log line as each item starts; it ends early once
        the deadline has passed (the figures then cover fewer items; the first always runs)."""
        for i in tqdm(range(n), desc=desc, dynamic_ncols=True, disable=not self.shown):
            if i and time.monotonic() >= self.deadline:
                log.warning("%s: max_minutes reached after %d of %d", desc, i, n)
                self.cut.append(f"{desc}: {i} of {n}")
                return
            if not self.shown:
                log.info("%s: %d/%d", desc, i + 1, n)
            yield i


def flat_grad(model) -> Tensor:
    """Every trainable parameter's .grad in one float32 vector (zeros where none), then cleared."""
    parts = []
    for p in model.parameters():
        if p.requires_grad:
            parts.append(torch.zeros(p.numel()) if p.grad is None else p.grad.detach().flatten().float())
            p.grad = None
    return torch.cat(parts)


class CountSketch:
    """x (D,) -> S x (R,): coordinate d added, with a random sign s_d, into bucket d mod R.
    Inner products are kept in expectation over the signs, E[<Sx, Sy>] = <x, y> (E[s_d s_e] = 0
    for d != e), with an error of about |x| |y| / sqrt(R): K gradients of a 135M-parameter model
    fit in memory as K x R numbers. (Hand-written, being a multiply and a sum: no well-kept
    library ships one for torch; fixed buckets keep it one vectorised pass, not a scatter.)"""

    def __init__(self, dim: int, buckets: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dim, self.buckets = dim, buckets
        padded = -(-dim // buckets) * buckets
        self.sign = torch.randint(0, 2, (padded,), generator=g).float() * 2 - 1
        self.sign[dim:] = 0.0

    def __call__(self, x: Tensor) -> Tensor:
        signed = self.sign.clone()
        signed[: self.dim] *= x.float()
        return signed.view(-1, self.buckets).sum(0, dtype=torch.float64)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sd / sqrt(n); 0 for a single value)."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


def jackknife(leave_outs: Tensor) -> Tensor | float:
    """The jackknife standard error of a statistic from its K leave-one-out values (K, ...)."""
    k = len(leave_outs)
    se = ((k - 1) / k * ((leave_outs - leave_outs.mean(0)) ** 2).sum(0)).sqrt()
    return float(se) if se.dim() == 0 else se


# what a training arm keeps of each step (metrics.jsonl's keys)
PER_STEP = {"entropy": "policy/entropy", "clip_frac_high": "policy/clip_frac_high",
            "clip_frac_low": "policy/clip_frac_low", "reward": "reward/mean",
            "generated_reward": "reward/generated_mean", "length": "rollout/length_mean",
            "length_correct": "rollout/length_correct", "length_wrong": "rollout/length_incorrect",
            "equal_groups": "rollout/equal_groups_frac", "generated": "rollout/generated_responses",
            "accuracy": "reward/accuracy", "model_score": "reward/model_score",
            "model_score_correct": "reward/model_score_correct",
            "model_score_incorrect": "reward/model_score_incorrect",
            "weight_capped": "policy/is_weight_capped_frac", "step_s": "perf/step_s"}


def per_step(metrics_path: Path) -> dict[str, list]:
    """Each PER_STEP quantity of every training step in a run's metrics.jsonl (None where a step
    did not log it: a batch with no signal trains nothing)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r and not any(k.startswith("eval/") for k in r)]
    out: dict[str, list] = {"step": [r["step"] for r in rows]}
    for name, key in PER_STEP.items():
        out[name] = [r.get(key) for r in rows]
    return out


def mean_of(values: list[float | None]) -> float | None:
    """The mean of the values present (None if none is)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def train_arm(run: RLJob, arm: str, algorithm: dict[str, Any], out: Path, steps: int,
              progress: bool, *, eval_every: int = 0, keep_model: bool = False,
              **fields: Any) -> dict[str, Any]:
    """Train `steps` steps of the run's recipe with `algorithm` changed (and any other
    TrainConfig `fields` replaced), from a copy of the run's starting weights and its seed; each
    step's PER_STEP numbers and held-out accuracy before, every `eval_every` steps and after.
    The arm's run folder (out/run/ARM) keeps its metrics and per-token records (`posttrain
    view`), and its final_model only if `keep_model` (an arm another arm learns from)."""
    # every arm runs all its steps (unless the user gave --max_minutes: each arm's budget) and
    # saves no checkpoint it would not keep
    cfg = replace(run.cfg, steps=steps, run_dir=str(out / "run" / arm), eval_every=eval_every,
                  checkpoint=replace(run.cfg.checkpoint, every_minutes=None, every_steps=0),
                  algorithm={**run.cfg.algorithm, **algorithm}, **fields).validate()
    summary = train(cfg, model=copy.deepcopy(run.learner.model), tokenizer=run.learner.tokenizer,
                    show_progress=progress)
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    numbers: dict[str, Any] = per_step(metrics)
    kept = ("checkpoints", "reference_model")   # (a budget's checkpoint, a KL arm's pi_ref)
    for weights in kept if keep_model else ("final_model", *kept):
        shutil.rmtree(Path(cfg.run_dir) / weights, ignore_errors=True)
    numbers.update(algorithm=algorithm, seconds=sum(v for v in numbers["step_s"] if v),
                   eval_before=summary.get("eval_before", {}).get("eval/accuracy"),
                   eval_after=summary.get("eval_after", {}).get("eval/accuracy"),
                   **evaluations(metrics, numbers))
    return numbers


def evaluations(metrics_path: Path, steps: dict[str, list]) -> dict[str, list]:
    """Each held-out evaluation of a run (its step and accuracy) with the training minutes
    before it (the step times summed: the evaluations' own time left out)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r and "step" in r]
    minutes = [sum(s for n, s in zip(steps["step"], steps["step_s"]) if n <= step and s) / 60
               for step, _ in evals]
    return {"eval_steps": [s for s, _ in evals], "eval_accuracy": [a for _, a in evals],
            "eval_minutes": minutes}


def plot_per_step(numbers: dict[str, Any], panels: list[tuple[str, str]], label, path: Path) -> Path:
    """A training-arm experiment's figure: one panel per (key, title), each arm's value per step
    (`label(arm, numbers)` names its line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for arm, n in numbers["arms"].items():
            pts = [(s, v) for s, v in zip(n["step"], n[key]) if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=label(arm, n))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_record(out: Path, name: str, claim: str, numbers: dict[str, Any], command: str,
                 seconds: float) -> Path:
    """out/NAME.json: the claim tested, the numbers, the wall time and the provenance."""
    path = out / f"{name}.json"
    record = {"experiment": name, "claim": claim, "numbers": numbers, "wall_s": round(seconds, 1),
              "provenance": provenance(command)}
    path.write_text(json.dumps(record, indent=1))
    return path


def run_experiment(name: str, overrides: list[str], out: Path | None, repeats: int | None,
                   progress: bool, command: str) -> dict[str, Any]:
    """Set up the run, measure, write out/NAME.json and out/NAME.png; return the record."""
    module = experiment_module(name)
    cfg, out = experiment_config(module, name, overrides, out)   # refused before any model loads
    repeats = module.REPEATS if repeats is None else repeats
    if repeats < module.MIN_REPEATS:
        raise ConfigError(f"--repeats {repeats}: experiment {name} needs at least "
                          f"{module.MIN_REPEATS}")
    out.mkdir(parents=True, exist_ok=True)   # (after the checks: a refused run leaves no folder)
    if module.KEEP_FREED_MEMORY:   # same-sized buffers every batch: reuse them, no page faults
        tune_malloc()
    t0 = time.perf_counter()
    shown = Progress(progress, time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes
                     else math.inf)
    run = None
    try:
        run = start_training(cfg, None, None, None, None, progress)
        numbers = module.run(run, out, repeats, shown)
    finally:   # the run's engine, sandbox and environment stop; its logs close
        if run is not None:
            try:
                close_sources(run)
            finally:
                run.logger.close()
    if shown.cut:
        numbers["max_minutes_cut"] = list(shown.cut)
    seconds = time.perf_counter() - t0
    record = write_record(out, name, module.CLAIM, numbers, command, seconds)
    figure = module.plot(numbers, out / f"{name}.png")
    log.info("%s: %s and %s in %.0f s", name, record, figure, seconds)
    return {"record": str(record), "figure": str(figure), "seconds": round(seconds, 1),
            "numbers": numbers}
