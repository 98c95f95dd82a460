"""The one policy-gradient loop. docs/algorithms.md §2-§7.

    for each step:
        sample a group of G responses for each of P prompts      (rollout, pi_old = pi_theta)
        score them                                               (verifier / reward functions)
        [drop all-equal groups and refill]                       (DAPO dynamic sampling)
        log-probs of the frozen reference                        (only when KL is used)
        advantages                                               (ADVANTAGES[algo.advantage])
        epochs x minibatches of clipped updates on the batch     (POLICY_LOSSES, AGGREGATIONS)
        log, evaluate, checkpoint

REINFORCE, RLOO, GRPO, DAPO and Dr. GRPO are presets of `AlgorithmConfig`: this file has no
per-algorithm branch, only switches for optional stages (reference model, dynamic sampling,
overlong handling) that any preset may turn on. Its rooms: rl/collect.py samples and scores a
step's batch, rl/job.py starts a run and checkpoints, evaluates and finishes it (on run/lifecycle.py's
common start and loop),
rl/step_metrics.py computes what a step logs; this file is the loop and the stages of one step.
"""

from __future__ import annotations

from contextlib import nullcontext
import logging
import time
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.losses.advantages import ADVANTAGES, AdvantageInputs, AdvantageParams, whiten
from posttrain.config.commands import TrainConfig
from posttrain.config.presets import AlgorithmConfig
from posttrain.util.health import Tally
from posttrain.logs.metrics import console_line
from posttrain.losses.common import masked_mean
from posttrain.losses.distill import DISTILL_LOSSES, sampled_reverse_kl
from posttrain.losses.kl import KL_ESTIMATORS, kl_penalized_rewards
from posttrain.model.prompts import encode_prompts, left_pad
from posttrain.rollout import Rollout
from posttrain.model.distributed import global_max, global_sum, mean_metrics
from posttrain.rollout.forward import frozen_logprobs, micro_rows
from posttrain.run.lifecycle import run_steps, stop_job
from posttrain.rl.batch import ScoredBatch
from posttrain.rl.update import check_nonfinite_streak, update_policy
from posttrain.rl.loss_terms import frozen_inputs
from posttrain.rl.token_records import TokenTrace, step_rows, traced_rows, write_step
from posttrain.rl.step_metrics import critic_metrics, per_domain, read_floats, rollout_metrics
from posttrain.rl.sampling import isolation
from posttrain.rl.job import (RLJob, check_health, checkpoint, close_sources, run_eval,
                                 save_final, start_training)

log = logging.getLogger("posttrain")


def teacher_view(batch: ScoredBatch, cfg: TrainConfig, tokenizer) -> Rollout:
    """The batch's responses after the teacher's prompts (OPSD: with privileged information).

    Prompts are left-padded and responses right-padded, so however long the teacher's prompt is,
    response token t sits at the same column after it: the teacher's log-probs line up token for
    token with the student's.
    """
    template = cfg.teacher.context_template
    if template is None:
        return batch.rollout
    G = batch.rollout.group_size
    shown = [replace(p, prompt=template.format(prompt=p.prompt, answer=p.answer), messages=None)
             for p in batch.problems[::G]]
    ids, mask = left_pad(encode_prompts(tokenizer, shown, cfg.data.system_prompt,
                                        cfg.data.chat_template), tokenizer.pad_token_id)
    device = batch.rollout.prompt_ids_B_L.device
    return replace(batch.rollout, prompt_ids_B_L=ids.repeat_interleave(G, 0).to(device),
                   prompt_mask_B_L=mask.repeat_interleave(G, 0).to(device))


def train(cfg: TrainConfig, resume: str | Path | None = None, model=None, tokenizer=None,
          show_progress: bool = True, teacher=None) -> dict[str, Any]:
    """Run `cfg`; return the summary (accuracy before/after, timings, paths). `model`,
    `tokenizer` and `teacher` may be passed in (tests, notebooks) instead of being loaded.
    The loop is the lecture's: sample and score -> frozen log-probs -> advantages -> update."""
    t_setup = time.perf_counter()
    run = start_training(cfg, resume, model, tokenizer, teacher, show_progress)
    try:
        return run_training(run, time.perf_counter() - t_setup)
    except BaseException:     # (an error or Ctrl-C twice: vLLM's processes and servers stop too)
        run.batches.close()
        raise


def run_training(run: RLJob, setup_s: float) -> dict[str, Any]:
    """Evaluate, then steps 1-6 of the lecture's loop (the common loop, lifecycle.run_steps)
    until `cfg.steps`, `max_minutes` or a stop signal; then evaluate and save."""
    cfg = run.cfg
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "preset": cfg.preset,
                               "setup_s": setup_s, "isolation": isolation(run.scorer, run.env)}
    if run.eval_problems and not run.resumed:
        summary["eval_before"] = run_eval(run, 0, "before")

    def evaluate_now(step: int) -> None:   # (outside the training clock)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and run.eval_problems:
            run_eval(run, step, f"step {step}")

    # steps 1-5 of the lecture's loop each step; 6. checkpoint every N steps, every M minutes,
    # on a stop signal
    signal_name = run_steps(run, cfg.steps, lambda step: train_step(run, step),
                            lambda step: checkpoint(run, step), "train", after_step=evaluate_now)
    if signal_name is not None:
        close_sources(run)
        return stop_job(run, signal_name, summary)
    if run.eval_problems:
        summary["eval_after"] = run_eval(run, run.steps_done, "after")
    return save_final(run, summary)


def train_step(run: RLJob, step: int) -> None:
    """One step of the lecture's loop: sample and score -> frozen log-probs -> advantages ->
    update -> log."""
    cfg, algo, world = run.cfg, run.algo, run.world
    t_step = time.perf_counter()
    timings: Counter = Counter()

    # 1. sample a group per prompt and score it (pi_old = the current policy; sampled ahead:
    #    at most rollout.max_staleness updates older)
    tallies: dict[str, Tally] = {}
    batch, metrics = run.batches.next(step, timings, tallies)
    # the one place every batch (sampled now, refilled, sampled ahead, restored from a
    # checkpoint's in_flight/) meets the policy: vLLM and a checkpoint hand it over on the CPU
    batch = batch.to(run.device)
    version = run.batches.version         # the weights this step trains (a step number)
    check_health(run, step, tallies)      # a source failing step after step stops the run
    if len(batch.rewards_B) > 0:   # (dynamic sampling may find nothing informative)
        # 2. frozen log-probs: the trainer's pi_old (another engine sampled), pi_ref, the teacher
        batch, frozen_metrics = frozen_passes(run, batch, timings)

        # 3. advantages (PPO: the value model's V_old, the KL folded into the rewards, GAE)
        batch, adv_metrics = compute_advantages(run, batch)

        # 4. epochs x minibatches of clipped updates (the critic learns on the same minibatches)
        t0 = time.perf_counter()
        warming_up = run.critic is not None and step <= cfg.critic.warmup_steps
        tokens = (TokenTrace(traced_rows(len(batch.rewards_B), batch.rollout.group_size,
                                         cfg.log_tokens)) if world.main and cfg.log_tokens else None)
        update_metrics = update_policy(run.model, run.optimizer, run.scheduler, batch, cfg,
                                       algo, run.generator, run.teachers, run.critic,
                                       train_policy=not warming_up, world=world, tokens=tokens)
        timings["update"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        run.batches.after_update(step)    # the sampler gets the new weights (vLLM: a push)
        timings["weight_push"] += time.perf_counter() - t0

        # 5. log and evaluate
        metrics.update({**frozen_metrics, **adv_metrics, **update_metrics})
        log_step(run, step, batch, metrics, timings, t_step)
        if tokens is not None:   # the per-token numbers of a few groups (posttrain view)
            write_step(run.run_dir, step, step_rows(step, batch, tokens, run.tokenizer, algo.gamma,
                                                    version))
        run.nonfinite_streak = nonfinite_streak(run.nonfinite_streak, metrics, cfg)
    else:
        metrics.update({f"perf/{k}_s": v for k, v in timings.items()})
        log_empty_step(run, step, metrics, t_step)


def frozen_passes(run: RLJob, batch: ScoredBatch,
                  timings: Counter) -> tuple[ScoredBatch, dict[str, float]]:
    """The log-probs no gradient flows through (§3, §6, §8): the trainer's own pi_old when
    another engine sampled (its log-probs differ slightly; the update reweights by their ratio),
    pi_ref for the KL penalty, and the teacher's log-probs of the student's own tokens. Returns
    the batch with them and the stage's metrics (the teacher's sampled reverse KL)."""
    metrics: dict[str, float] = {}
    cfg, algo, model = run.cfg, run.algo, run.model
    temperature, autocast = cfg.rollout.temperature, cfg.model.autocast
    micro = micro_rows(cfg.optim, batch.rollout)
    t0 = time.perf_counter()
    needs = frozen_inputs(cfg, algo, run.teachers is not None)   # what the step's terms read
    # the sampler's log-probs are not the trainer's when another engine sampled, or when the
    # trainer's forward runs in another precision than the sampler's (model.autocast bfloat16
    # against a float32 sampler: bf16 noise, far above GSPO's 4e-4 clip): pi_old is recomputed
    # by the trainer itself, so the first minibatch's ratio is 1 up to its own numerics
    if "trainer_old_logp" in needs:
        batch = replace(batch, trainer_old_logp_B_T=frozen_logprobs(model, batch.rollout,
                                                                    temperature, micro, autocast))
        timings["old_logprobs"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    if "ref_logp" in needs:
        with model.disable_adapter() if run.lora else nullcontext():
            batch = replace(batch, ref_logp_B_T=frozen_logprobs(run.ref_model or model,
                                                                batch.rollout, temperature,
                                                                micro, autocast))
    timings["reference"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    if run.teachers is not None:
        batch = replace(batch, teacher_view=teacher_view(batch, cfg, run.tokenizer))
    # (a per-position loss, distill_loss exact / forward: the update runs the teacher itself,
    # micro-batch by micro-batch; a separate pass here would be wasted)
    if "teacher_logp" in needs:
        tau = cfg.teacher.temperature or temperature
        teacher_logp = run.teachers.logprobs(
            batch.teacher_view, [p.domain for p in batch.problems],
            lambda m, view: frozen_logprobs(m, view, tau, micro, autocast))
        batch = replace(batch, teacher_logp_B_T=teacher_logp)
        kl = sampled_reverse_kl(batch.old_logp_B_T, batch.teacher_logp_B_T)
        metrics.update(read_floats({"distill/reverse_kl": masked_mean(kl, batch.loss_mask_B_T),
                                    **per_domain(batch, kl)}))
    elif run.teachers is not None:
        metrics.update(read_floats(per_domain(batch)))
    timings["teacher"] += time.perf_counter() - t0
    return batch, metrics


def compute_advantages(run: RLJob, batch: ScoredBatch) -> tuple[ScoredBatch, dict[str, float]]:
    """A_t for every response token by the preset's estimator (ADVANTAGES); PPO also gets the
    value model's V_old and the returns it regresses on. Returns the batch carrying them
    (`adv_B_T`, `old_values_B_T`, `returns_B_T`) and the stage's metrics (the critic's)."""
    cfg, algo, critic = run.cfg, run.algo, run.critic
    token_rewards = old_values = None
    metrics: dict[str, float] = {}
    if critic is not None:
        old_values = critic.predict(batch.rollout, micro_rows(cfg.optim, batch.rollout),
                                    cfg.model.autocast, run.model, cfg.rollout.temperature)
        token_rewards = ppo_token_rewards(batch, algo)
    adv_out = ADVANTAGES[algo.advantage](
        AdvantageInputs(batch.rewards_P_G, batch.loss_mask_B_T, token_rewards_B_T=token_rewards,
                        values_B_T=old_values, old_logp_B_T=batch.old_logp_B_T,
                        teacher_logp_B_T=batch.teacher_logp_B_T,
                        scored_P_G=batch.scored_P_G),
        AdvantageParams(algo.eps, algo.scale_by_std, algo.gamma, algo.lam, algo.reward_weight,
                        not DISTILL_LOSSES[algo.distill_loss].in_advantage))
    batch = replace(batch, adv_B_T=adv_out.adv_B_T, old_values_B_T=old_values,
                    returns_B_T=adv_out.returns_B_T if critic is not None else None,
                    token_rewards_B_T=token_rewards)
    if critic is not None:   # (before whitening: the advantage as GAE computed it)
        metrics.update(read_floats(critic_metrics(batch, token_rewards)))
    if algo.whiten_advantages:
        batch = replace(batch, adv_B_T=whiten(batch.adv_B_T, batch.loss_mask_B_T,
                                              total=lambda t: global_sum(t, run.world)))
    return batch, metrics


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
                    "perf/samples": run.sampler.position})
    metrics = mean_metrics(metrics, world)
    run.logger.log(step, metrics)
    n = cfg.log_samples
    shown = batch.transcripts or batch.completions   # multi-turn: the whole episode
    run.logger.append("samples.jsonl", {"step": step, "samples": [
        {"prompt": p.prompt, "completion": c, "reward": r}
        for p, c, r in zip(batch.problems[:n], shown[:n], batch.rewards_B[:n].tolist())]})
    if world.main:
        run.logger.log_completions(step, completion_rows(batch, n))
    if run.bar is not None:   # (inside run_steps, the loop's bar)
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


def nonfinite_streak(streak: int, metrics: dict[str, Any], cfg: TrainConfig) -> int:
    """Steps in a row whose every optimizer step had a non-finite gradient (and was skipped);
    `optim.max_nonfinite_steps` of them stop the run with a message (NonFiniteError)."""
    skipped = metrics.get("optim/nonfinite_steps", 0)
    streak = streak + 1 if skipped and skipped == metrics["optim/steps"] else 0
    check_nonfinite_streak(streak, cfg.optim.max_nonfinite_steps)
    return streak


def log_empty_step(run: RLJob, step: int, metrics: dict[str, Any], t_step: float) -> None:
    """A step whose dynamic sampling kept no group: its sampling time and counts, no update.
    The learning-rate schedule still advances by the step's optimizer steps, so it reaches its
    end at the last step as planned (a cosine schedule would otherwise never decay to 0)."""
    o = run.cfg.optim
    with warnings.catch_warnings():   # (torch warns when a schedule steps before any optimizer step)
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(o.epochs * o.minibatches):
            run.scheduler.step()
    metrics["optim/lr"] = run.scheduler.get_last_lr()[0]
    metrics["perf/step_s"] = time.perf_counter() - t_step
    run.logger.log(step, metrics)
    if not run.show_progress and run.world.main:
        log.info("step %d/%d | no group with a signal in %d responses: no update | %.1fs", step,
                 run.cfg.steps, int(metrics.get("rollout/generated_responses", 0)),
                 metrics["perf/step_s"])


def ppo_token_rewards(batch: ScoredBatch, algo: AlgorithmConfig) -> Tensor:
    """Dense rewards for GAE (§5): -beta * kl_t on every token, the score added on the last one.
    The KL is that of the sampled tokens, log pi_old - log pi_ref with the default k1 estimator."""
    mask = batch.loss_mask_B_T
    if algo.kl_in == "reward" and batch.ref_logp_B_T is not None:
        kl = KL_ESTIMATORS[algo.kl_estimator](batch.old_logp_B_T, batch.ref_logp_B_T)
        return kl_penalized_rewards(batch.rewards_B, kl, mask, algo.kl_coef)
    return kl_penalized_rewards(batch.rewards_B, torch.zeros_like(mask), mask, 0.0)
