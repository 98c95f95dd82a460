"""`posttrain train`: the one policy-gradient loop. docs/algorithms.md §2-§8.

    for each step:
        sample a group of G responses for each of P prompts      (sampling, pi_old = pi_theta)
        score them                                               (verifier / reward functions)
        [drop all-equal groups and refill]                       (DAPO dynamic sampling)
        frozen log-probs: pi_ref, the teacher, pi_old            (only those a term reads)
        advantages                                               (ADVANTAGES[algo.advantage])
        epochs x minibatches of clipped updates on the batch     (POLICY_LOSSES, AGGREGATIONS)
        the engine gets the new weights; log, evaluate, checkpoint

REINFORCE, RLOO, GRPO, DAPO, Dr. GRPO, PPO and the distillations are presets of `AlgorithmConfig`:
this file has no per-algorithm branch. It composes two services, built by rl/job.py: the
`Sampling` service (sampling/service.py: engine, environment, scorer, prompts; a step's batch
sampled now or ahead) and the `PolicyLearner` (rl/learner.py: the models, optimizer, checkpoint),
whose stages are rl/frozen.py, rl/advantage.py and rl/update.py; the frame of the loop (budget,
signals, checkpoint cadence) is run/lifecycle.py's `Steps`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from posttrain.config.commands import TrainConfig
from posttrain.logs.metrics import console_line
from posttrain.model.distributed import global_max, mean_metrics
from posttrain.run.lifecycle import Steps, stop_job
from posttrain.sampling.batch import ScoredBatch
from posttrain.rl.advantage import compute_advantages
from posttrain.rl.frozen import frozen_passes
from posttrain.rl.update import update_policy
from posttrain.rl.token_records import TokenTrace, step_rows, traced_rows, write_step
from posttrain.rl.step_metrics import rollout_metrics
from posttrain.rl.job import (RLJob, check_health, checkpoint, close_sources, run_eval,
                              save_final, start_training)

log = logging.getLogger("posttrain")


def train(cfg: TrainConfig, resume: str | Path | None = None, model=None, tokenizer=None,
          show_progress: bool = True, teacher=None) -> dict[str, Any]:
    """Run `cfg`; return the summary (accuracy before/after, timings, paths). `model`,
    `tokenizer` and `teacher` may be passed in (tests, notebooks) instead of being loaded."""
    t_setup = time.perf_counter()
    run = start_training(cfg, resume, model, tokenizer, teacher, show_progress)
    try:
        return run_training(run, time.perf_counter() - t_setup)
    except BaseException:     # (an error or Ctrl-C twice: vLLM's processes and servers stop too)
        try:
            close_sources(run)
        except Exception:  # noqa: BLE001 - the run's own error is the one to raise
            log.exception("closing the engine, sandbox and environment after the error failed")
        raise


def run_training(run: RLJob, setup_s: float) -> dict[str, Any]:
    """Evaluate; the steps until `cfg.steps`, `max_minutes` or a stop signal, each followed by
    the evaluation and checkpoint its cadence asks for; then evaluate and save."""
    cfg = run.cfg
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "preset": cfg.preset,
                               "setup_s": setup_s, "isolation": run.sampling.isolation()}
    if run.eval_problems and not run.resumed:
        summary["eval_before"] = run_eval(run, 0, "before")
    with Steps(run, cfg.steps, "train") as steps:
        for step in steps:
            with steps.timed(step):
                train_step(run, step)
            if steps.evaluation_due(step, cfg.eval_every) and run.eval_problems:
                run_eval(run, step, f"step {step}")   # (outside the training clock)
            if steps.checkpoint_due(step):            # every N steps, M minutes, on a signal
                with steps.saving(step):
                    checkpoint(run, step)
    if steps.stop_signal is not None:
        close_sources(run)
        return stop_job(run, steps.stop_signal, summary)
    if run.eval_problems:
        summary["eval_after"] = run_eval(run, run.steps_done, "after")
    return save_final(run, summary)


def train_step(run: RLJob, step: int) -> None:
    """One step of the lecture's loop: sample and score -> frozen log-probs -> advantages ->
    update -> the engine gets the new weights -> log."""
    sampling, learner, cfg = run.sampling, run.learner, run.cfg
    t_step, timings, tallies = time.perf_counter(), Counter(), {}
    # 1. a group per prompt, sampled and scored (pi_old = the policy; sampled ahead: at most
    #    rollout.max_staleness updates older)
    batch, metrics = sampling.next(step, timings, tallies)
    # (the one place every batch, sampled now, refilled, sampled ahead or restored from a
    # checkpoint's in_flight/, meets the policy: vLLM and a checkpoint hand it over on the CPU)
    batch, version = batch.to(learner.device), sampling.version   # (the weights it trains)
    check_health(run, step, tallies)      # a source failing step after step stops the run
    if len(batch.rewards_B) == 0:         # (dynamic sampling found no informative group)
        return skip_update(run, step, metrics, timings, t_step)
    # 2. frozen log-probs: the trainer's pi_old (another engine sampled), pi_ref, the teacher
    batch, frozen_metrics = frozen_passes(learner, batch, timings)
    # 3. advantages (PPO: the value model's V_old, the KL folded into the rewards, GAE)
    batch, adv_metrics = compute_advantages(learner, batch)
    # 4. epochs x minibatches of clipped updates (the critic learns on the same minibatches)
    t0 = time.perf_counter()
    tokens = token_trace(run, batch)
    warming_up = learner.critic is not None and step <= cfg.critic.warmup_steps
    update_metrics = update_policy(learner, batch, train_policy=not warming_up, tokens=tokens)
    timings["update"] += time.perf_counter() - t0
    # 5. the sampler gets the new weights (vLLM: a push)
    t0 = time.perf_counter()
    sampling.sync(step)
    timings["weight_push"] += time.perf_counter() - t0
    # 6. log
    metrics.update({**frozen_metrics, **adv_metrics, **update_metrics})
    log_step(run, step, batch, metrics, timings, t_step)
    if tokens is not None:   # the per-token numbers of a few groups (posttrain view)
        write_step(run.run_dir, step, step_rows(step, batch, tokens, learner.tokenizer,
                                                run.algo.gamma, version))
    skipped = metrics.get("optim/nonfinite_steps", 0)   # every optimizer step skipped?
    learner.count_skipped(bool(skipped) and skipped == metrics["optim/steps"])


def token_trace(run: RLJob, batch: ScoredBatch) -> TokenTrace | None:
    """Where the update writes the per-token values of `cfg.log_tokens` groups (rank 0)."""
    if not (run.world.main and run.cfg.log_tokens):
        return None
    return TokenTrace(traced_rows(len(batch.rewards_B), batch.rollout.group_size,
                                  run.cfg.log_tokens))


def log_step(run: RLJob, step: int, batch: ScoredBatch, metrics: dict[str, Any],
             timings: Counter, t_step: float) -> None:
    """The step's metrics (JSONL, TensorBoard, console), its first samples, and the clock."""
    cfg, world = run.cfg, run.world
    step_s = global_max(time.perf_counter() - t_step, world)   # ranks stop at the same step
    metrics.update(rollout_metrics(batch))
    gen_tokens = metrics.pop("_tokens")
    metrics.update({f"perf/{k}_s": v for k, v in timings.items()})
    metrics.update({"perf/step_s": step_s, "perf/train_minutes": (run.train_seconds + step_s) / 60,
                    "perf/generated_tokens_per_s": gen_tokens / max(timings["generate"], 1e-9),
                    "perf/samples": run.sampling.prompts.position})
    metrics = mean_metrics(metrics, world)
    run.logger.log(step, metrics)
    n = cfg.log_samples
    shown = batch.transcripts or batch.completions   # multi-turn: the whole episode
    run.logger.append("samples.jsonl", {"step": step, "samples": [
        {"prompt": p.prompt, "completion": c, "reward": r}
        for p, c, r in zip(batch.problems[:n], shown[:n], batch.rewards_B[:n].tolist())]})
    if world.main:
        run.logger.log_completions(step, completion_rows(batch, n))
    if run.bar is not None:   # (inside the loop, its bar)
        run.bar.set_postfix_str(console_line(step, cfg.steps, metrics).split(" | ", 1)[-1])
    if not run.show_progress and world.main:
        log.info(console_line(step, cfg.steps, metrics))


def completion_rows(batch: ScoredBatch, n: int) -> list[dict[str, Any]]:
    """The step's first n responses for the trackers' completions table; the advantage is the
    mean over each response's tokens in the loss (one value for outcome rewards)."""
    shown = batch.transcripts or batch.completions
    mask = batch.loss_mask_B_T[:n]
    adv = ((batch.adv_B_T[:n] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    return [{"prompt": p.prompt, "completion": c, "reward": r, "correct": bool(ok), "advantage": a}
            for p, c, r, ok, a in zip(batch.problems[:n], shown[:n], batch.rewards_B[:n].tolist(),
                                      batch.correct_B[:n].tolist(), adv)]


def skip_update(run: RLJob, step: int, metrics: dict[str, Any], timings: Counter,
                t_step: float) -> None:
    """A step whose dynamic sampling kept no group: its sampling time and counts, no update.
    The learning-rate schedule still advances by the step's optimizer steps, so it reaches its
    end at the last step as planned (a cosine schedule would otherwise never decay to 0)."""
    metrics.update({f"perf/{k}_s": v for k, v in timings.items()})
    o, scheduler = run.cfg.optim, run.learner.scheduler
    with warnings.catch_warnings():   # (torch warns when a schedule steps before any optimizer step)
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(o.epochs * o.minibatches):
            scheduler.step()
    metrics["optim/lr"] = scheduler.get_last_lr()[0]
    metrics["perf/step_s"] = time.perf_counter() - t_step
    run.logger.log(step, metrics)
    if not run.show_progress and run.world.main:
        log.info("step %d/%d | no group with a signal in %d responses: no update | %.1fs", step,
                 run.cfg.steps, int(metrics.get("rollout/generated_responses", 0)),
                 metrics["perf/step_s"])


