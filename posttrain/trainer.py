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
overlong handling) that any preset may turn on.
"""

from __future__ import annotations

import copy
import os
import shutil
from contextlib import nullcontext
import json
import logging
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from posttrain.advantages import (ADVANTAGES, NEEDS_TEACHER, NEEDS_VALUES, AdvantageInputs,
                                  AdvantageParams, whiten)
from posttrain.checkpoint import fsync_path, restore_rng, resume_point, save_checkpoint, seal
from posttrain.config import AlgorithmConfig, ConfigError, TrainConfig
from posttrain.errors import FailingSourceError
from posttrain.health import FailureWatch, Tally, merge_tallies
from posttrain.data.source import Sampler, build_task
from posttrain.data.tasks import Problem
from posttrain.evaluation import evaluate
from posttrain.logging import MetricsLogger, NullLogger, console_line, plot_run, resume_logs
from posttrain.losses import (DISTILL_LOSSES, KL_ESTIMATORS, explained_variance,
                              kl_penalized_rewards, sampled_reverse_kl)
from posttrain.memory import estimate as estimate_memory
from posttrain.models import (add_lora, check_model_folder, load_policy, load_tokenizer,
                              merged_lora_copy, resolve_model_path, save_model)
from posttrain.rewards import Scorer, overlong_penalty
from posttrain.envs import Environment, SingleTurn, for_tokenizer, make_env
from posttrain.prompts import encode_prompts, left_pad
from posttrain.rollout import (HFRolloutEngine, Rollout, RolloutEngine, SamplingParams,
                               episode_settings, make_engine, vllm_options)
from posttrain.rollout.episodes import Episodes, run_episodes
from posttrain.rollout.hf import row_seeds
from posttrain.run import make_adamw, make_scheduler, seed_everything
from posttrain.teachers import Teachers
from posttrain.critic import Critic
from posttrain.distributed import (SINGLE, World, barrier,
                                   device_for, full_state_dict,
                                   full_weights_for_generation, gather_objects,
                                   global_max, global_sum, init_world,
                                   load_optimizer_state, mean_metrics, wrap)
from posttrain.forward import frozen_logprobs
from posttrain.lifecycle import Lifecycle, resume_command
from posttrain.batch import ScoredBatch, equal_reward_groups, merge
from posttrain.update import check_nonfinite_streak, frozen_inputs, masked_mean, update_policy

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


def generate_and_score(engine: RolloutEngine, tokenizer, sampler: Sampler, scorer: Scorer,
                       cfg: TrainConfig, algo: AlgorithmConfig, generator: torch.Generator,
                       timings: Counter, world: World = SINGLE, env: Environment | None = None,
                       tallies: dict[str, Tally] | None = None) -> tuple[ScoredBatch, dict[str, float]]:
    """Sample a group of episodes per prompt and score them; with dynamic sampling, refill until
    P informative groups. A single-turn task's episode is one answer (envs/base.py).

    Every rank draws the same P prompts and keeps its share; each response is sampled from noise
    keyed by (seed, draw number, g), so the batch does not depend on the number of ranks."""
    env = env or SingleTurn()
    G, P_global = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    kept: list[tuple[int, ScoredBatch]] = []
    n_kept, rounds, stats = 0, 0, Counter()
    while True:
        batch = sample_and_score_round(engine, tokenizer, sampler, scorer, cfg, algo, generator,
                                       timings, world, env, tallies, stats, first=rounds == 0)
        equal = equal_reward_groups(batch.rewards_P_G)
        if rounds == 0:
            first = batch
        rounds += 1
        stats["rollout/generated_responses"] += P_global * G
        if not algo.dynamic_sampling:
            return batch, dict(stats)
        keep_groups = (~equal).nonzero().squeeze(-1)
        if keep_groups.numel():
            rows = (keep_groups[:, None] * G + torch.arange(G)).reshape(-1)
            kept.append((rounds, batch.select(rows)))
        # informative groups over all ranks: every rank counts the same, so they stop together
        n_kept += sum(gather_objects(keep_groups.numel(), world))
        if n_kept >= P_global or rounds > algo.max_refill_rounds:
            break
    stats["rollout/dynamic_rounds"] = rounds
    return informative_groups(kept, n_kept, first, cfg, tokenizer, world, stats), dict(stats)


def sample_and_score_round(engine: RolloutEngine, tokenizer, sampler: Sampler, scorer: Scorer,
                           cfg: TrainConfig, algo: AlgorithmConfig, generator: torch.Generator,
                           timings: Counter, world: World, env: Environment,
                           tallies: dict[str, Tally] | None, stats: Counter, first: bool) -> ScoredBatch:
    """One round: draw P prompts (this rank's share), sample G episodes each, score them. The
    first round's statistics (before any filtering: the honest learning curve) go to `stats`."""
    r, G = cfg.rollout, cfg.rollout.group_size
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, stop=r.stop)
    t0 = time.perf_counter()
    drawn, keys = sampler.draw(r.prompts_per_step)     # (prompts that failed before come first)
    problems, keys = drawn[world.share(r.prompts_per_step)], keys[world.share(r.prompts_per_step)]
    with full_weights_for_generation(getattr(engine, "model", None), world):
        episodes = run_episodes(engine, tokenizer, env, problems, G, params,
                                episode_settings(cfg), generator, seeds=row_seeds(cfg.seed, keys, G))
    t1 = time.perf_counter()
    if tallies is not None:   # the environment's and its tools' failures (FailureWatch)
        tallies.update(merge_tallies(tallies, episodes.tallies()))
    per_response = [p for p in problems for _ in range(G)]
    result, rewards, correct = score_round(episodes, per_response, scorer, sampler, cfg, algo,
                                           world, stats)
    timings["generate"] += t1 - t0
    timings["reward"] += time.perf_counter() - t1
    multi_turn = env.max_turns > 1
    if multi_turn and first:    # per episode: turns, tool calls, malformed calls
        stats.update(episodes.metrics())
    batch = ScoredBatch(episodes.rollout, per_response, episodes.completions, rewards, correct,
                        loss_mask(episodes.rollout, algo),
                        transcripts=episodes.transcripts if multi_turn else None)
    if first:
        first_stats = {"rollout/equal_groups_frac": equal_reward_groups(batch.rewards_P_G).float().mean(),
                       "reward/generated_mean": rewards.mean()}
        if result.model_scores_B is not None:   # RLHF: the proxy beside the truth (hacking shows)
            first_stats.update(reward_model_metrics(result.model_scores_B, result.correct_B))
        stats.update(read_floats(first_stats))
    return batch


def informative_groups(kept: list[tuple[int, ScoredBatch]], n_kept: int, first: ScoredBatch,
                       cfg: TrainConfig, tokenizer, world: World, stats: Counter) -> ScoredBatch:
    """Dynamic sampling's batch: the first P informative groups in (round, prompt) order, as one
    process keeps them; if the refills ran out, a multiple of the world size of them, so that
    every rank gets as many. None at all: an empty batch (train on nothing rather than noise)."""
    G = cfg.rollout.group_size
    n_use = min(n_kept, cfg.rollout.prompts_per_step) // world.size * world.size
    stats["rollout/kept_groups"] = n_use
    if n_use == 0:
        return first.select(torch.arange(0))
    parts = [part for _, part in kept]
    if world.distributed:   # each rank kept its own prompts' groups: share them out again evenly
        device = first.rewards_B.device
        shares = gather_objects([(rnd, part.to("cpu")) for rnd, part in kept], world)
        ordered = sorted((rnd, rank, part) for rank, share in enumerate(shares)
                         for rnd, part in share)
        parts = [part.to(device) for _, _, part in ordered]
    merged = merge(parts, tokenizer.pad_token_id)
    mine = world.share(n_use)
    return merged.select(torch.arange(mine.start * G, mine.stop * G))


def score_round(episodes: Episodes, per_response: list[Problem], scorer: Scorer, sampler: Sampler,
                cfg: TrainConfig, algo: AlgorithmConfig, world: World, stats: Counter):
    """A round's rewards (verifier, reward functions, the environment's, DAPO's overlong shaping)
    and verdicts; the prompts to ask again go to the sampler, failed calls to `stats`."""
    rollout = episodes.rollout
    result = scorer(per_response, episodes.completions)
    rewards, correct = episode_rewards(result, episodes, rollout.response_mask_B_T.device)
    report_solved(sampler, correct, cfg.rollout.group_size, cfg.data.retry_if, world, stats)
    if algo.overlong == "shape":
        # (an episode: its longest turn, the part max_new_tokens cuts; never the environment's tokens)
        rewards = rewards + overlong_penalty(rollout.longest_turn_B, cfg.rollout.max_new_tokens,
                                             algo.overlong_buffer, algo.overlong_penalty)
    for k, v in result.failures.items():
        stats[f"reward/failures_{k}"] += v
    return result, rewards, correct


def report_solved(sampler: Sampler, correct_B: Tensor, G: int, retry_if: str, world: World,
                  stats: Counter | None = None) -> None:
    """Tell the sampler which of the step's prompts to ask again (all ranks' prompts, in draw
    order): those not solved by every answer ('unsolved'), or solved by some but not all
    ('mixed': the groups that taught something). `stats` counts the draw's retried prompts."""
    if not sampler.retries:
        sampler.report([False] * (len(correct_B) // G * world.size))
        return
    if stats is not None:
        stats["rollout/retried_prompts"] += sampler.last_retried
    correct_P_G = correct_B.view(-1, G)
    again = ~correct_P_G.all(-1)
    if retry_if == "mixed":
        again &= correct_P_G.any(-1)
    sampler.report([a for share in gather_objects(again.tolist(), world) for a in share])


def loss_mask(rollout: Rollout, algo: AlgorithmConfig) -> Tensor:
    """The response tokens the loss sees: the policy's own (never an environment's), and with
    the overlong filter none of a truncated answer's (they teach nothing about the end)."""
    mask = rollout.policy_tokens_B_T.clone()
    if algo.overlong == "filter":
        mask[rollout.truncated_B] = 0.0
    return mask


def episode_rewards(result, episodes: Episodes, device) -> tuple[Tensor, Tensor]:
    """The reward of each episode: the verifier's and reward functions' (on its last turn) plus
    the environment's; correct is the environment's verdict where it gave one."""
    rewards = result.rewards_B.to(device) + episodes.env_rewards_B.to(device)
    return rewards, episodes.verdicts(result.correct_B).to(device)


def reward_model_metrics(scores_B: Tensor, correct_B: Tensor) -> dict[str, Tensor]:
    """The reward model's mean score, overall and on correct / incorrect answers (nan: none)."""
    correct_B = correct_B.to(scores_B.device)
    return {"reward/model_score": scores_B.mean(),
            "reward/model_score_correct": _mean_where(scores_B, correct_B),
            "reward/model_score_incorrect": _mean_where(scores_B, ~correct_B)}


# ---------------------------------------------------------------------------------------------
# Setup and the loop
# ---------------------------------------------------------------------------------------------

def check_world(cfg: TrainConfig, world: World) -> None:
    """What several ranks need from the config (checked before any model loads)."""
    if not world.distributed:
        return
    P = cfg.rollout.prompts_per_step
    if P % world.size:
        raise ConfigError(f"rollout.prompts_per_step={P} must be divisible by the {world.size} "
                          "ranks: each rank samples and trains on whole groups of its share")
    if cfg.rollout.backend == "vllm" and not cfg.rollout.vllm_server:
        raise ConfigError("rollout.backend='vllm' colocated under torchrun is not supported yet: "
                          "start `vllm serve` (see posttrain/rollout/vllm.py) and set "
                          "rollout.vllm_server, or run on one process")


@dataclass
class Run:
    """Everything one training run holds: what `setup` built, and the state the loop moves on
    (step count and training seconds; the rest lives in the model, optimizer and sampler)."""

    cfg: TrainConfig
    world: World
    run_dir: Path
    model: Any
    tokenizer: Any
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Sampler
    scorer: Scorer
    generator: torch.Generator
    logger: MetricsLogger | NullLogger
    eval_problems: list[Problem]
    teachers: Teachers | None = None
    ref_model: Any = None               # pi_ref when it is a separate copy (no LoRA)
    critic: Critic | None = None
    env: Environment = SingleTurn()     # what answers the policy between its turns
    start_step: int = 0
    train_seconds: float = 0.0
    resumed: bool = False
    nonfinite_streak: int = 0           # trainer steps in a row whose every optimizer step was skipped
    watch: FailureWatch | None = None   # sources failing on most calls, step after step
    saved_step: int = -1                # the step of the last checkpoint written

    @property
    def algo(self) -> AlgorithmConfig:
        return self.cfg.algo

    @property
    def lora(self) -> bool:
        return self.cfg.lora.rank > 0


def train(cfg: TrainConfig, resume: str | Path | None = None, model=None, tokenizer=None,
          show_progress: bool = True, teacher=None) -> dict[str, Any]:
    """Run `cfg`; return the summary (accuracy before/after, timings, paths). `model`,
    `tokenizer` and `teacher` may be passed in (tests, notebooks) instead of being loaded.
    The loop is the lecture's: sample and score -> frozen log-probs -> advantages -> update."""
    t_setup = time.perf_counter()
    run = setup(cfg, resume, model, tokenizer, teacher)
    algo, world = run.algo, run.world
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "preset": cfg.preset,
                               "setup_s": time.perf_counter() - t_setup}
    if run.eval_problems and not run.resumed:
        summary["eval_before"] = run_eval(run, 0, "before")
    bar = tqdm(total=cfg.steps, initial=run.start_step, desc="train", dynamic_ncols=True,
               disable=not (show_progress and world.main))
    lifecycle = Lifecycle(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes, world)
    step = run.start_step
    with lifecycle:   # SIGINT / SIGTERM: finish the step, save a checkpoint, stop
        for step in range(run.start_step + 1, cfg.steps + 1):
            if cfg.max_minutes is not None and run.train_seconds >= cfg.max_minutes * 60:
                log.info("max_minutes=%s reached after %d steps", cfg.max_minutes, step - 1)
                step -= 1
                if step > run.start_step:   # (a longer --max_minutes can continue from here)
                    checkpoint(run, step)
                break
            t_step = time.perf_counter()
            timings: Counter = Counter()

            # 1. sample a group per prompt and score it (pi_old = the current policy)
            tallies: dict[str, Tally] = {}
            batch, metrics = generate_and_score(run.engine, run.tokenizer, run.sampler, run.scorer,
                                                cfg, algo, run.generator, timings, world, run.env,
                                                tallies)
            check_health(run, step, tallies)      # a source failing step after step stops the run
            if len(batch.rewards_B) > 0:   # (dynamic sampling may find nothing informative)
                # 2. frozen log-probs: the trainer's pi_old (another engine sampled), pi_ref, the teacher
                batch, frozen_metrics = frozen_passes(run, batch, timings)

                # 3. advantages (PPO: the value model's V_old, the KL folded into the rewards, GAE)
                batch, adv_metrics = compute_advantages(run, batch)

                # 4. epochs x minibatches of clipped updates (the critic learns on the same minibatches)
                t0 = time.perf_counter()
                warming_up = run.critic is not None and step <= cfg.critic.warmup_steps
                update_metrics = update_policy(run.model, run.optimizer, run.scheduler, batch, cfg,
                                               algo, run.generator, run.teachers, run.critic,
                                               train_policy=not warming_up, world=world)
                timings["update"] += time.perf_counter() - t0
                run.engine.sync_weights()

                # 5. log and evaluate
                metrics.update({**frozen_metrics, **adv_metrics, **update_metrics})
                log_step(run, step, batch, metrics, timings, t_step, bar, show_progress)
                run.nonfinite_streak = nonfinite_streak(run.nonfinite_streak, metrics, cfg)
            else:
                log_empty_step(run, step, metrics, t_step, bar, show_progress)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and run.eval_problems:
                run_eval(run, step, f"step {step}")

            # 6. checkpoint (every N steps, every M minutes, on a stop signal)
            save, stop = lifecycle.after_step(step)
            if save:
                checkpoint(run, step)
                lifecycle.saved()
            if stop:
                bar.close()
                return stopped(run, step, summary, lifecycle.stop_signal)
    bar.close()
    if run.eval_problems:
        summary["eval_after"] = run_eval(run, step, "after")
    return finish(run, step, summary)


def setup(cfg: TrainConfig, resume: str | Path | None, model, tokenizer, teacher) -> Run:
    """Check the inputs (before any model loads), load the policy, pi_ref, teachers and value
    model, place and wrap them, build the engine and optimizer, and restore a checkpoint."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    generator = seed_everything(cfg.seed)
    world = init_world(cfg.parallel.strategy)         # torchrun: join the process group
    check_world(cfg, world)
    task = build_task(cfg.data)                       # data errors surface before model loading
    env = make_env(cfg.env, task)                     # so do unknown environments and tools
    if teacher is None and cfg.algo.advantage in NEEDS_TEACHER:   # so do missing teachers
        for where, path in teacher_paths(cfg.teacher):
            check_model_folder(path, where)
    scorer = Scorer(cfg.reward, task.verifier, cfg.data.system_prompt, cfg.model.autocast)
    run_dir = Path(resume) if resume else Path(
        cfg.run_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    point = resume_point(run_dir) if resume else None   # the newest checkpoint that loads
    if resume and point is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir}/checkpoints")
    ckpt, state = point if point is not None else (None, None)
    model, tokenizer, teachers, path = load_models(cfg, ckpt, model, tokenizer, teacher)
    env = for_tokenizer(env, tokenizer)               # e.g. the template's tool-call format
    if world.main:   # created once the inputs have loaded: a refused run leaves no empty folder
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier(world)
    device = device_for(world) if cfg.model.device == "auto" else torch.device(cfg.model.device)
    model.to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = cfg.lora.rank > 0
    if world.main:
        n_params = sum(p.numel() for p in model.parameters())
        n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora else None
        log.info("%s", estimate_memory(cfg, model.config, n_params, world.size, n_lora).table())
    if teachers is not None:
        teachers.bind_student(model)
    algo = cfg.algo
    uses_ref = "ref_logp" in frozen_inputs(cfg, algo, teachers is not None)   # a KL term reads pi_ref
    ref_model = reference_model(cfg, model, run_dir, ckpt) if uses_ref else None
    # PPO's value model (§5), initialised from the policy's starting weights or critic.path
    critic = (Critic(cfg.critic, model, world, ckpt / "critic" if ckpt is not None else None)
              if algo.advantage in NEEDS_VALUES else None)
    if scorer.cfg.model:
        scorer.reward_model.check_tokenizer(tokenizer)
        scorer.reward_model.to(device)                # beside the policy (a GPU on a GPU run)
    model = wrap(model, world)                        # FSDP2: shard the layers, in place
    engine = make_engine(cfg.rollout.backend, model, tokenizer, cfg.rollout.autocast,
                         cfg.rollout.weights, **vllm_options(cfg, path, model, world))
    o = cfg.optim
    optimizer = make_adamw([p for p in model.parameters() if p.requires_grad], o.lr,
                           (o.beta1, o.beta2), o.weight_decay, sharded=world.strategy == "fsdp")
    scheduler = make_scheduler(optimizer, max(cfg.steps * o.epochs * o.minibatches, 1),
                               o.warmup_steps, o.schedule)
    if world.main:   # only rank 0 writes files; every rank computes and reduces the metrics
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
    logger = (MetricsLogger(run_dir, cfg.tensorboard, resume=ckpt is not None) if world.main
              else NullLogger())
    log.info("run folder %s; algorithm %s", run_dir, algo)
    sampler = Sampler(task, cfg.seed, retries=cfg.data.retry_unsolved,
                      max_waiting=cfg.rollout.prompts_per_step)
    run = Run(cfg, world, run_dir, model, tokenizer, engine, optimizer, scheduler, sampler,
              scorer, generator, logger, task.eval_problems, teachers, ref_model, critic,
              env=env, watch=FailureWatch(cfg.reward.max_failing_steps))
    if ckpt is not None:
        restore(run, state)
    return run


def check_health(run: Run, step: int, tallies: dict[str, Tally]) -> None:
    """Stop the run (every rank) when a verifier, reward function, tool or environment has failed
    on most of its calls for `reward.max_failing_steps` steps in a row."""
    problem = run.watch.check(step, merge_tallies(tallies, run.scorer.take_tallies()))
    if global_max(float(problem is not None), run.world) > 0:
        run.scorer.close()
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
    path = cfg.model.path
    if model is None:   # (LoRA: the base model never changes; checkpoints hold the adapters)
        path = ckpt / "model" if ckpt and not lora else resolve_model_path(cfg.model.path,
                                                                            cfg.model.cache_dir)
        tokenizer = tokenizer or load_tokenizer(path)
    teachers = (Teachers(cfg.teacher, tokenizer, cfg.model.cache_dir, teacher)
                if cfg.algo.advantage in NEEDS_TEACHER else None)
    if model is None:
        model = load_policy(path, cfg.model.dtype)
    elif ckpt is not None and not lora:
        model.load_state_dict(load_policy(ckpt / "model", cfg.model.dtype).state_dict())
    if cfg.model.attention != "auto":
        model.set_attn_implementation(cfg.model.attention)
    if lora:
        model = add_lora(model, cfg.lora, ckpt / "adapter" if ckpt else None)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
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


def restore(run: Run, state: dict[str, Any]) -> None:
    """Optimizer, scheduler, RNG, data position and clock of a checkpoint's trainer state: the
    run continues as if it had never stopped."""
    load_optimizer_state(run.model, run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"], run.generator)
    if run.critic is not None:
        run.critic.load_optimizer_state(state["critic_optimizer"])
    run.start_step = state["step"]
    run.sampler.load_state(state.get("data", {"position": state["data_position"]}))
    resume_logs(run.logger, state)   # rows a killed run wrote after its checkpoint are redone
    run.saved_step = state["step"]
    run.train_seconds, run.resumed = state["train_seconds"], True


def checkpoint(run: Run, step: int) -> None:
    """Save the run at `step` (every rank calls this; rank 0 writes), and pi_ref the first time:
    it is the starting policy, frozen, which a resumed run must get back."""
    if step == run.saved_step:
        return
    run.saved_step = step
    ref_dir = run.run_dir / "reference_model"
    if run.ref_model is not None and run.world.main and not ref_dir.is_dir():
        tmp = run.run_dir / ".reference_model.tmp"   # renamed into place: never half-written
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(run.ref_model, run.tokenizer, tmp)
        seal(tmp, 0)                                  # durable before the checkpoints rely on it
        os.replace(tmp, ref_dir)
        fsync_path(run.run_dir)
    extra = {"data_position": run.sampler.position, "data": run.sampler.state(),
             "train_seconds": run.train_seconds,
             "log_rows": run.logger.line_counts()}
    if run.critic is not None:
        extra["critic_optimizer"] = run.critic.optimizer_state()
    save_checkpoint(run.run_dir, step, run.model, run.tokenizer, run.optimizer, run.scheduler,
                    run.generator, extra, run.cfg.to_dict(),
                    extra_models={"critic": run.critic.save} if run.critic is not None else None,
                    world=run.world, keep=run.cfg.checkpoint.keep)


def frozen_passes(run: Run, batch: ScoredBatch,
                  timings: Counter) -> tuple[ScoredBatch, dict[str, float]]:
    """The log-probs no gradient flows through (§3, §6, §8): the trainer's own pi_old when
    another engine sampled (its log-probs differ slightly; the update reweights by their ratio),
    pi_ref for the KL penalty, and the teacher's log-probs of the student's own tokens. Returns
    the batch with them and the stage's metrics (the teacher's sampled reverse KL)."""
    metrics: dict[str, float] = {}
    cfg, algo, model = run.cfg, run.algo, run.model
    temperature, micro, autocast = cfg.rollout.temperature, cfg.optim.micro_batch_size, cfg.model.autocast
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


def compute_advantages(run: Run, batch: ScoredBatch) -> tuple[ScoredBatch, dict[str, float]]:
    """A_t for every response token by the preset's estimator (ADVANTAGES); PPO also gets the
    value model's V_old and the returns it regresses on. Returns the batch carrying them
    (`adv_B_T`, `old_values_B_T`, `returns_B_T`) and the stage's metrics (the critic's)."""
    cfg, algo, critic = run.cfg, run.algo, run.critic
    token_rewards = old_values = None
    metrics: dict[str, float] = {}
    if critic is not None:
        old_values = critic.predict(batch.rollout, cfg.optim.micro_batch_size,
                                    cfg.model.autocast, run.model, cfg.rollout.temperature)
        token_rewards = ppo_token_rewards(batch, algo)
    adv_out = ADVANTAGES[algo.advantage](
        AdvantageInputs(batch.rewards_P_G, batch.loss_mask_B_T, token_rewards_B_T=token_rewards,
                        values_B_T=old_values, old_logp_B_T=batch.old_logp_B_T,
                        teacher_logp_B_T=batch.teacher_logp_B_T),
        AdvantageParams(algo.eps, algo.scale_by_std, algo.gamma, algo.lam, algo.reward_weight,
                        not DISTILL_LOSSES[algo.distill_loss].in_advantage))
    batch = replace(batch, adv_B_T=adv_out.adv_B_T, old_values_B_T=old_values,
                    returns_B_T=adv_out.returns_B_T if critic is not None else None)
    if critic is not None:   # (before whitening: the advantage as GAE computed it)
        metrics.update(read_floats(critic_metrics(batch, token_rewards)))
    if algo.whiten_advantages:
        batch = replace(batch, adv_B_T=whiten(batch.adv_B_T, batch.loss_mask_B_T,
                                              total=lambda t: global_sum(t, run.world)))
    return batch, metrics


def log_step(run: Run, step: int, batch: ScoredBatch, metrics: dict[str, Any],
             timings: Counter, t_step: float, bar, show_progress: bool) -> None:
    """The step's metrics (JSONL, TensorBoard, console), its first samples, and the clock."""
    cfg, world = run.cfg, run.world
    step_s = global_max(time.perf_counter() - t_step, world)   # ranks stop at the same step
    run.train_seconds += step_s
    metrics.update(rollout_metrics(batch))
    gen_tokens = metrics.pop("_tokens")
    metrics.update({f"perf/{k}_s": v for k, v in timings.items()})
    metrics.update({"perf/step_s": step_s, "perf/train_minutes": run.train_seconds / 60,
                    "perf/generated_tokens_per_s": gen_tokens / max(timings["generate"], 1e-9),
                    "perf/samples": run.sampler.position})
    metrics = mean_metrics(metrics, world)
    run.logger.log(step, metrics)
    if world.main:
        n = cfg.log_samples
        shown = batch.transcripts or batch.completions   # multi-turn: the whole episode
        with open(run.run_dir / "samples.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "samples": [
                {"prompt": p.prompt, "completion": c, "reward": r}
                for p, c, r in zip(batch.problems[:n], shown[:n],
                                   batch.rewards_B[:n].tolist())]}) + "\n")
    bar.set_postfix_str(console_line(step, cfg.steps, metrics).split(" | ", 1)[-1])
    bar.update(1)
    if not show_progress and world.main:
        log.info(console_line(step, cfg.steps, metrics))


def nonfinite_streak(streak: int, metrics: dict[str, Any], cfg: TrainConfig) -> int:
    """Steps in a row whose every optimizer step had a non-finite gradient (and was skipped);
    `optim.max_nonfinite_steps` of them stop the run with a message (NonFiniteError)."""
    skipped = metrics.get("optim/nonfinite_steps", 0)
    streak = streak + 1 if skipped and skipped == metrics["optim/steps"] else 0
    check_nonfinite_streak(streak, cfg.optim.max_nonfinite_steps)
    return streak


def log_empty_step(run: Run, step: int, metrics: dict[str, Any], t_step: float, bar,
                   show_progress: bool) -> None:
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
    run.train_seconds += metrics["perf/step_s"]
    run.logger.log(step, metrics)
    bar.update(1)
    if not show_progress and run.world.main:
        log.info("step %d/%d | no group with a signal in %d responses: no update | %.1fs", step,
                 run.cfg.steps, int(metrics.get("rollout/generated_responses", 0)),
                 metrics["perf/step_s"])


def stopped(run: Run, step: int, summary: dict[str, Any], signal_name: str | None) -> dict[str, Any]:
    """A signal stopped the run after `step` (its checkpoint is written): summary.json says so and
    how to continue; no final model, no final evaluation (a pre-empted job has little time)."""
    run.logger.close()
    run.scorer.close()
    summary.update(steps=step, train_minutes=run.train_seconds / 60, stopped_by=signal_name,
                   resume=resume_command("train", run.run_dir))
    if run.world.main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        log.warning("stopped by %s after step %d; continue with: %s", signal_name, step,
                    summary["resume"])
    barrier(run.world)
    return summary


def run_eval(run: Run, step: int, label: str) -> dict[str, Any]:
    """Held-out accuracy now, logged with the training minutes so far; samples to a file."""
    t0 = time.perf_counter()
    # in the weights' own precision (not the sampler's bf16), as a user's model.generate reads it
    engine = (HFRolloutEngine(run.model, run.tokenizer) if isinstance(run.engine, HFRolloutEngine)
              else run.engine)
    with full_weights_for_generation(run.model, run.world):
        res = evaluate(run.model, run.tokenizer, engine, run.eval_problems, run.scorer,
                       run.cfg, world=run.world, env=run.env)
    samples = res.pop("_samples")
    res["eval/seconds"] = time.perf_counter() - t0
    res["perf/train_minutes"] = run.train_seconds / 60
    run.logger.log(step, res)
    if run.world.main:
        with open(run.run_dir / "eval_samples.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "label": label, "samples": samples}) + "\n")
    log.info("eval %s (step %d): accuracy %.3f", label, step, res["eval/accuracy"])
    return res


def finish(run: Run, step: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Save the final model (a plain HF model: LoRA adapters merged; under FSDP into a CPU copy
    built from the gathered weights, since peft merges in place and the layers are sharded), the
    value model, the plot and summary.json."""
    world, model, tokenizer, run_dir = run.world, run.model, run.tokenizer, run.run_dir
    summary["steps"] = step
    summary["train_minutes"] = run.train_seconds / 60
    t0 = time.perf_counter()
    if run.lora and world.strategy == "fsdp" and world.distributed:
        weights = full_state_dict(model, world)
        model, weights = (merged_lora_copy(model, weights) if world.main else None), None
    else:
        if run.lora:
            model = model.merge_and_unload()
        weights = full_state_dict(model, world)       # FSDP: gathered from the shards
    if world.main:
        save_model(model, tokenizer, run_dir / "final_model", weights)
    summary["final_model"] = str(run_dir / "final_model")
    if run.critic is not None:   # a shared value head sits beside the policy it reads
        value_dir = run_dir / ("final_model" if run.critic.shared else "final_value_model")
        run.critic.save(value_dir, tokenizer)       # every rank: FSDP gathers the shards
        summary["value_model"] = str(value_dir)
    summary["save_s"] = time.perf_counter() - t0
    run.logger.close()
    run.scorer.close()
    if world.main:
        try:
            summary["plot"] = str(plot_run(run_dir))
        except Exception as e:  # noqa: BLE001 - a plotting problem must not lose a finished run
            log.warning("could not plot the run: %s", e)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    barrier(world)
    return summary


def ppo_token_rewards(batch: ScoredBatch, algo: AlgorithmConfig) -> Tensor:
    """Dense rewards for GAE (§5): -beta * kl_t on every token, the score added on the last one.
    The KL is that of the sampled tokens, log pi_old - log pi_ref with the default k1 estimator."""
    mask = batch.loss_mask_B_T
    if algo.kl_in == "reward" and batch.ref_logp_B_T is not None:
        kl = KL_ESTIMATORS[algo.kl_estimator](batch.old_logp_B_T, batch.ref_logp_B_T)
        return kl_penalized_rewards(batch.rewards_B, kl, mask, algo.kl_coef)
    return kl_penalized_rewards(batch.rewards_B, torch.zeros_like(mask), mask, 0.0)


def critic_metrics(batch: ScoredBatch, token_rewards_B_T: Tensor) -> dict[str, Tensor]:
    """How good the value model was on this batch before its update (`batch.old_values_B_T`
    against `batch.returns_B_T`), and where advantage sits (device tensors; nan where no token
    qualifies)."""
    mask, adv_B_T = batch.loss_mask_B_T, batch.adv_B_T
    out = {"critic/explained_variance": explained_variance(
               batch.old_values_B_T, batch.returns_B_T, mask),
           "critic/value_mean": masked_mean(batch.old_values_B_T, mask),
           "critic/return_mean": masked_mean(batch.returns_B_T, mask)}
    # mean (un-whitened) advantage by response position: first tokens, and the last token
    for t in range(min(3, mask.shape[1])):
        out[f"advantage/mean_t{t}"] = _mean_where(adv_B_T[:, t], mask[:, t])
    last = (torch.arange(mask.shape[1], device=mask.device) * (mask > 0)).amax(-1)
    out["advantage/mean_last"] = _mean_where(adv_B_T.gather(1, last[:, None])[:, 0], mask.sum(-1) > 0)
    kl_part = token_rewards_B_T - kl_penalized_rewards(batch.rewards_B, torch.zeros_like(mask), mask, 0.0)
    out["reward/kl_penalty"] = kl_part.sum(-1).mean()
    return out


def per_domain(batch: ScoredBatch, kl_B_T: Tensor | None = None) -> dict[str, Tensor]:
    """Accuracy and sampled reverse KL per domain, when a batch mixes domains (MOPD)."""
    domains = [p.domain for p in batch.problems]
    if len(set(domains)) < 2:
        return {}
    out = {}
    for d in sorted(set(domains)):
        rows = torch.tensor([i for i, x in enumerate(domains) if x == d])
        if kl_B_T is not None:
            out[f"distill/reverse_kl@{d}"] = masked_mean(kl_B_T[rows], batch.loss_mask_B_T[rows])
        out[f"reward/accuracy@{d}"] = batch.correct_B[rows].float().mean()
    return out


def _mean_where(x: Tensor, rows: Tensor) -> Tensor:
    """Mean of x over the rows where `rows` holds (0 / 0 = nan when none does)."""
    return (x * rows).sum() / rows.float().sum()


def read_floats(t: dict[str, Tensor]) -> dict[str, float]:
    """Scalar metric tensors as floats, in one device-to-host transfer; nan ones left out."""
    if not t:
        return {}
    device = next(iter(t.values())).device
    values = torch.stack([v.detach().float().reshape(()).to(device) for v in t.values()]).tolist()
    return {k: v for k, v in zip(t, values) if not math.isnan(v)}


def rollout_metrics(batch: ScoredBatch) -> dict[str, float | None]:
    """What was sampled and how it scored, read from the device in one transfer ('_tokens': the
    generated tokens, for the throughput; None where no row qualifies)."""
    lengths, correct, r = batch.rollout.lengths_B, batch.correct_B, batch.rewards_B

    t = {"reward/mean": r.mean(), "reward/std": r.std() if len(r) > 1 else torch.zeros_like(r[0]),
         "reward/accuracy": correct.float().mean(),
         "rollout/length_mean": lengths.mean(),
         "rollout/truncated_frac": batch.rollout.truncated_B.float().mean(),
         "policy/adv_abs_mean": batch.adv_B_T.abs().sum() / batch.loss_mask_B_T.sum().clamp(min=1),
         "rollout/length_correct": _mean_where(lengths, correct),
         "rollout/length_incorrect": _mean_where(lengths, ~correct),
         "_tokens": batch.rollout.response_mask_B_T.sum()}
    values = torch.stack([v.float().to(r.device) for v in t.values()]).tolist()
    return {k: None if math.isnan(v) else v for k, v in zip(t, values)}