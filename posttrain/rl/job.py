"""What `posttrain train` builds on the common lifecycle (run/lifecycle.py): the inputs checked
before any model loads; the policy, pi_ref, the teachers and the value model loaded and placed;
the two services, the `PolicyLearner` (rl/learner.py) and `Sampling` (sampling/service.py); a
checkpoint restored. Then what the loop calls between steps: the checkpoint's contents, the
held-out evaluations, the final model.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.losses.advantages import NEEDS_TEACHER, NEEDS_VALUES
from posttrain.config.commands import ConfigError, TrainConfig
from posttrain.config.presets import AlgorithmConfig
from posttrain.util.errors import FailingSourceError
from posttrain.util.health import FailureWatch, Tally
from posttrain.data.source import PromptStream
from posttrain.data.tasks import Problem
from posttrain.sampling.evaluation import eval_settings
from posttrain.logs.metrics import plot_run
from posttrain.rl.token_records import drop_after
from posttrain.model.memory import estimate as estimate_memory
from posttrain.model.loading import (add_lora, check_model_folder, load_model, load_policy,
                                     resolve_model_path)
from posttrain.rewards.scorer import Scorer
from posttrain.envs import for_tokenizer
from posttrain.rollout import async_core_split
from posttrain.sampling.service import Sampling, sampling_engine, sampling_inputs
from posttrain.run.optim import make_adamw, make_scheduler
from posttrain.rl.teachers import Teachers
from posttrain.rl.critic import Critic
from posttrain.model.distributed import World, device_for, global_max, wrap
from posttrain.run.lifecycle import Job, finish_job, make_folder, open_folder, start_job
from posttrain.rl.learner import PolicyLearner
from posttrain.rl.loss_terms import frozen_inputs


log = logging.getLogger("posttrain")


def check_world(cfg: TrainConfig, world: World) -> None:
    """What several ranks need from the config (checked before any model loads)."""
    if not world.distributed:
        return
    P = cfg.rollout.prompts_per_step
    if cfg.rollout.max_staleness:
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} under torchrun is not "
                          "supported yet (one trainer process samples ahead); run on one process "
                          "or with max_staleness 0")
    if P % world.size:
        raise ConfigError(f"rollout.prompts_per_step={P} must be divisible by the {world.size} "
                          "ranks: each rank samples and trains on whole groups of its share")
    if cfg.rollout.backend == "vllm" and (cfg.rollout.vllm_launch or not cfg.rollout.vllm_servers):
        raise ConfigError("rollout.backend='vllm' under torchrun takes servers you start: "
                          "`vllm serve` (see posttrain/rollout/vllm.py) and rollout.vllm_servers, "
                          "or run on one process")


@dataclass(kw_only=True)
class RLJob(Job):
    """A `train` run: the common lifecycle's fields (Job), the policy's learner (the models, the
    optimizer, the checkpoint) and the sampling service (engine, environment, scorer, prompts,
    the step's batch source), built by `start_training`; the loop moves the step count and the
    clock."""

    cfg: TrainConfig
    learner: PolicyLearner
    sampling: Sampling
    eval_problems: list[Problem]
    watch: FailureWatch                 # sources failing on most calls, step after step

    @property
    def algo(self) -> AlgorithmConfig:
        return self.cfg.algo


def check_health(run: RLJob, step: int, tallies: dict[str, Tally]) -> None:
    """Stop the run (every rank) when a verifier, reward function, tool or environment has failed
    on most of its calls for `reward.max_failing_steps` steps in a row. `tallies` are those of
    the batch this step trains (sampling/collect.py), whichever thread sampled and scored it."""
    problem = run.watch.check(step, tallies)
    if global_max(float(problem is not None), run.world) > 0:
        run.sampling.scorer.close()
        raise FailingSourceError(problem or "a verifier, reward function, tool or environment kept "
                                 "failing on another rank (its log has the traceback)")


def teacher_paths(t) -> list[tuple[str, str]]:
    """(option, folder) of every teacher model a config names ('self' is the student)."""
    named = [("teacher.path", t.path)] if t.path and t.path != "self" else []
    return named + [(f"teacher.domains.{d}", p) for d, p in sorted(t.domains.items())]


def load_models(cfg: TrainConfig, ckpt: Path | None, model, tokenizer, teacher):
    """The policy (from the checkpoint when resuming; LoRA: the base, then its adapters), its
    tokenizer and the distillation teachers, whose tokenizers are checked before the student's
    weights load. Returns (model, tokenizer, teachers, the folder the policy came from)."""
    lora = cfg.lora.rank > 0
    folder = None   # (LoRA: the base model never changes; checkpoints hold the adapters)
    if model is None:
        folder = (ckpt / "model" if ckpt is not None and not lora
                  else resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    _, tokenizer, path = load_model(cfg.model, model, tokenizer, folder=folder, weights=False)
    teachers = (Teachers(cfg.teacher, tokenizer, cfg.model.cache_dir, teacher)
                if cfg.algo.advantage in NEEDS_TEACHER else None)
    given = model is not None
    model, tokenizer, _ = load_model(cfg.model, model, tokenizer,
                                     folder=None if given else Path(path))
    if given and ckpt is not None and not lora:
        model.load_state_dict(load_policy(ckpt / "model", cfg.model.dtype).state_dict())
    if lora:
        model = add_lora(model, cfg.lora, ckpt / "adapter" if ckpt else None)
    return model, tokenizer, teachers, path


def reference_model(cfg: TrainConfig, model, run_dir: Path, ckpt: Path | None):
    """pi_ref: the starting policy, frozen (saved with the first checkpoint, so a resumed run gets
    the same one). With LoRA it is the policy with its adapters switched off: None, no second copy."""
    if cfg.lora.rank > 0:
        return None
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if ckpt is not None:  # the reference is the *initial* model, saved with the first checkpoint
        ref_model.load_state_dict(load_policy(run_dir / "reference_model", cfg.model.dtype).state_dict())
    return ref_model


def restore(run: RLJob, state: dict[str, Any]) -> None:
    """Optimizer, scheduler, RNG, data position and clock of a checkpoint's trainer state: the
    run continues as if it had never stopped."""
    run.learner.restore(state)
    run.start_step = state["step"]
    run.sampling.prompts.load_state(state.get("data", {"position": state["data_position"]}))
    if run.world.main:   # rows after the checkpoint are redone (open_folder), so are token records
        drop_after(run.run_dir, state["step"])
    run.saved_step = state["step"]
    run.train_seconds = state["train_seconds"]


def checkpoint(run: RLJob, step: int) -> None:
    """Save the run at `step` (every rank calls this; rank 0 writes): the learner's checkpoint
    with the data position, the clock and, asynchronous, the batches sampled and not yet trained
    on (the engine paused between two batches)."""
    if step == run.saved_step:
        return
    run.saved_step = step
    prompts = run.sampling.prompts
    with run.sampling.paused(load_latest=False):   # (read while the engine draws nothing)
        extra = {"data_position": prompts.position, "data": prompts.state(),
                 "train_seconds": run.train_seconds, "log_rows": run.logger.line_counts()}
        run.learner.save_checkpoint(run.run_dir, step, extra, {"in_flight": run.sampling.save})


def run_eval(run: RLJob, step: int, label: str) -> dict[str, Any]:
    """Held-out accuracy now, logged with the training minutes so far; samples to a file."""
    t0 = time.perf_counter()
    res = run.sampling.evaluate(run.learner.model, run.eval_problems, eval_settings(run.cfg))
    samples, _ = res.pop("_samples"), res.pop("_lengths")
    res["eval/seconds"] = time.perf_counter() - t0
    res["perf/train_minutes"] = run.train_seconds / 60
    run.logger.log(step, res)
    run.logger.append("eval_samples.jsonl", {"step": step, "label": label, "samples": samples})
    log.info("eval %s (step %d): accuracy %.3f", label, step, res["eval/accuracy"])
    return res


def close_sources(run: RLJob) -> None:
    """The sampling service's engine, sandbox and environment; a stopped run's engine waits no
    longer than its grace allows (Job.cleanup_wait_s)."""
    run.sampling.close(run.cleanup_wait_s())


def save_final(run: RLJob, summary: dict[str, Any]) -> dict[str, Any]:
    """The final model and value model (PolicyLearner.save_final_models), the sources closed,
    the plot; then summary.json."""
    summary.update(run.learner.save_final_models(run.run_dir))
    close_sources(run)
    if run.world.main:
        try:
            summary["plot"] = str(plot_run(run.run_dir))
        except Exception as e:  # noqa: BLE001 - a plotting problem must not lose a finished run
            log.warning("could not plot the run: %s", e)
    return finish_job(run, summary)


def log_memory_estimate(cfg: TrainConfig, model, world: World, env) -> None:
    """The memory this run needs per rank (model/memory.py), before anything big is allocated."""
    n_params = sum(p.numel() for p in model.parameters())
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.lora.rank else None
    log.info("%s", estimate_memory(cfg, model.config, n_params, world.size, n_lora,
                                   episodes=env.max_turns > 1).table())


def optimizer_and_schedule(cfg: TrainConfig, model, world: World):
    """AdamW over the trainable parameters, and its lr schedule over every optimizer step."""
    o = cfg.optim
    optimizer = make_adamw([p for p in model.parameters() if p.requires_grad], o.lr,
                           (o.beta1, o.beta2), o.weight_decay, sharded=world.strategy == "fsdp")
    scheduler = make_scheduler(optimizer, max(cfg.steps * o.epochs * o.minibatches, 1),
                               o.warmup_steps, o.schedule)
    return optimizer, scheduler


def check_inputs(job: Job, teacher):
    """What several ranks need; then the task, environment, teachers' folders and the reward
    scorer (its sandbox started), each of which fails here, before any model loads."""
    cfg = job.cfg
    check_world(cfg, job.world)

    def teachers_exist() -> None:
        if teacher is None and cfg.algo.advantage in NEEDS_TEACHER:
            for where, path in teacher_paths(cfg.teacher):
                check_model_folder(path, where)
    return sampling_inputs(cfg, teachers_exist, job.run_dir)


def place_models(job: Job, model, tokenizer, teachers, scorer: Scorer, env):
    """The policy on its device (gradient checkpointing on request), the memory estimate, the
    teachers bound to it, pi_ref when a KL term reads it, PPO's value model, the reward model
    beside the policy. Returns (pi_ref, critic)."""
    cfg, world, ckpt = job.cfg, job.world, job.ckpt
    device = device_for(world) if cfg.model.device == "auto" else torch.device(cfg.model.device)
    model.to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world.main:
        log_memory_estimate(cfg, model, world, env)
    if teachers is not None:
        teachers.bind_student(model)
    uses_ref = "ref_logp" in frozen_inputs(cfg, cfg.algo, teachers is not None)   # a KL term reads pi_ref
    ref_model = reference_model(cfg, model, job.run_dir, ckpt) if uses_ref else None
    # PPO's value model (§5), initialised from the policy's starting weights or critic.path
    critic = (Critic(cfg.critic, model, world, ckpt / "critic" if ckpt is not None else None)
              if cfg.algo.advantage in NEEDS_VALUES else None)
    if scorer.cfg.model:
        scorer.reward_model.check_tokenizer(tokenizer)
        scorer.reward_model.to(device)                # beside the policy (a GPU on a GPU run)
    return ref_model, critic


def start_training(cfg: TrainConfig, resume: str | Path | None, model, tokenizer, teacher,
                   show_progress: bool = True) -> RLJob:
    """The common start (threads, seed, world, resume point), the inputs checked before any model
    loads, the sampling service over them; the run built (build_run); a checkpoint restored.
    Anything failing on the way stops the sandbox and environment the inputs started."""
    split = async_core_split(cfg.rollout)   # (sampling ahead on a CPU: the lower half of the cores)
    job = start_job("train", cfg, resume, show_progress, threads=split[0] if split else None)
    task, env, scorer = check_inputs(job, teacher)
    prompts = PromptStream(task, cfg.seed, retries=cfg.data.retry_unsolved,
                           max_waiting=cfg.rollout.prompts_per_step)
    # (sampling ahead runs in a thread: never the run's generator, which the update draws from)
    generator = job.generator if not cfg.rollout.max_staleness else torch.Generator().manual_seed(cfg.seed)
    sampling = Sampling(cfg=cfg, engine=None, tokenizer=None, scorer=scorer, prompts=prompts,
                        env=env, world=job.world, generator=generator)
    try:
        run = build_run(job, sampling, model, tokenizer, teacher)
        if job.ckpt is not None:
            restore(run, job.state)
        sampling.start(run.start_step, job.ckpt / "in_flight" if job.ckpt is not None else None)
    except BaseException:
        sampling.close()
        raise
    return run


def build_run(job: Job, sampling: Sampling, model, tokenizer, teacher) -> RLJob:
    """The policy, pi_ref, teachers and value model loaded, placed and wrapped; the engine
    (the sampling service's); the learner; the run folder opened."""
    cfg = job.cfg
    model, tokenizer, teachers, path = load_models(cfg, job.ckpt, model, tokenizer, teacher)
    sampling.tokenizer = tokenizer
    sampling.env = for_tokenizer(sampling.env, tokenizer)   # e.g. the template's tool-call format
    make_folder(job)
    ref_model, critic = place_models(job, model, tokenizer, teachers, sampling.scorer, sampling.env)
    model = wrap(model, job.world)                    # FSDP2: shard the layers, in place
    sampling.engine = sampling_engine(cfg, path, model, tokenizer, job.world)
    optimizer, scheduler = optimizer_and_schedule(cfg, model, job.world)
    # config.json records where the model's text runs (not a config field)
    open_folder(job, {**cfg.to_dict(), "_isolation": sampling.isolation()}, cfg.tensorboard)
    log.info("run folder %s; algorithm %s", job.run_dir, cfg.algo)
    for warning in cfg.start_warnings():
        log.warning(warning)
    learner = PolicyLearner(model=model, tokenizer=tokenizer, optimizer=optimizer, optim=cfg.optim,
                            scheduler=scheduler, world=job.world, cfg=cfg, generator=job.generator,
                            teachers=teachers, ref_model=ref_model, critic=critic)
    return RLJob(**job.parts(), learner=learner, sampling=sampling,
                 eval_problems=sampling.prompts.task.eval_problems,
                 watch=FailureWatch(cfg.reward.max_failing_steps))
