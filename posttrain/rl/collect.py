"""A step's batch (docs/algorithms.md §6, §7): a group of answers per prompt, sampled (one turn,
or episodes of several with an environment), scored out of the trainer's process, and with DAPO's
dynamic sampling refilled until the groups whose rewards are not all equal fill the step
(several ranks: shared out again as whole groups)."""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch import Tensor

from posttrain.config.commands import TrainConfig
from posttrain.config.presets import AlgorithmConfig
from posttrain.util.health import Tally, merge_tallies
from posttrain.data.source import Sampler
from posttrain.data.tasks import Problem
from posttrain.rewards.scorer import Scorer
from posttrain.rewards.verifiers import overlong_penalty
from posttrain.envs import Environment, SingleTurn
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams, episode_settings
from posttrain.rollout.episodes import Episodes, run_episodes
from posttrain.rollout.seated import seat_problems, seated_episodes, seats_of
from posttrain.rollout.hf import row_seeds
from posttrain.model.distributed import SINGLE, World, full_weights_for_generation, gather_objects
from posttrain.rl.batch import ScoredBatch, merge
from posttrain.rl.step_metrics import judge_metrics, read_floats, reward_model_metrics


def generate_and_score(engine: RolloutEngine, tokenizer, sampler: Sampler, scorer: Scorer,
                       cfg: TrainConfig, algo: AlgorithmConfig, generator: torch.Generator,
                       timings: Counter, world: World = SINGLE, env: Environment | None = None,
                       tallies: dict[str, Tally] | None = None) -> tuple[ScoredBatch, dict[str, float]]:
    """Sample a group of episodes per prompt and score them; with dynamic sampling, refill until
    P informative groups (P x seats where each seat of an episode is a row: rollout/seated.py).
    A single-turn task's episode is one answer (envs/base.py).

    Every rank draws the same P prompts and keeps its share; each response is sampled from noise
    keyed by (seed, draw number, g), so the batch does not depend on the number of ranks."""
    env = env or SingleTurn()
    G = cfg.rollout.group_size
    kept: list[tuple[int, ScoredBatch]] = []
    n_kept, rounds, stats = 0, 0, Counter()
    while True:
        batch = sample_and_score_round(engine, tokenizer, sampler, scorer, cfg, algo, generator,
                                       timings, world, env, tallies, stats, first=rounds == 0)
        equal = batch.equal_groups
        if rounds == 0:
            first = batch
        rounds += 1
        groups = len(batch.rewards_B) // G * world.size   # (P_global; x seats where each is a row)
        stats["rollout/generated_responses"] += groups * G
        if not algo.dynamic_sampling:
            return batch, dict(stats)
        keep_groups = (~equal).nonzero().squeeze(-1)
        if keep_groups.numel():
            rows = (keep_groups[:, None] * G + torch.arange(G)).reshape(-1)
            kept.append((rounds, batch.select(rows)))
        # informative groups over all ranks: every rank counts the same, so they stop together
        n_kept += sum(gather_objects(keep_groups.numel(), world))
        if n_kept >= groups or rounds > algo.max_refill_rounds:
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
    seats = seats_of(env, problems)   # (several seats a row each: P*S groups of G, Seated)
    with full_weights_for_generation(getattr(engine, "model", None), world):
        episodes = (seated_episodes if seats else run_episodes)(
            engine, tokenizer, env, problems, G, params, episode_settings(cfg), generator,
            seeds=row_seeds(cfg.seed, keys, G))
    t1 = time.perf_counter()
    if tallies is not None:   # the environment's and its tools' failures (FailureWatch)
        tallies.update(merge_tallies(tallies, episodes.tallies()))
    per_response = [p for p in seat_problems(problems, seats) for _ in range(G)]
    result, rewards, correct, parts = score_round(episodes, per_response, scorer, sampler, cfg,
                                                  algo, world, stats, max(len(seats), 1))
    if tallies is not None:   # the scorers' failures on this batch (FailureWatch)
        tallies.update(merge_tallies(tallies, result.tallies))
    timings["generate"] += t1 - t0
    timings["reward"] += time.perf_counter() - t1
    multi_turn = env.max_turns > 1
    if multi_turn and first:    # per episode: turns, tool calls, malformed calls
        stats.update(episodes.metrics())
    elif first and episodes.counts.get("timeouts"):   # (a one-turn environment's time limits)
        stats["env/timeouts"] = episodes.metrics()["env/timeouts"]
    scored = episodes.scored(result.scored_B, rewards.device)   # (judged, within time limits)
    batch = ScoredBatch(episodes.rollout, per_response, episodes.completions, rewards, correct,
                        loss_mask(episodes.rollout, algo, scored),
                        transcripts=episodes.transcripts if multi_turn else None, reward_parts=parts,
                        scored_B=scored)
    if first:
        scored = torch.ones_like(rewards, dtype=torch.bool) if scored is None else scored
        first_stats = {"rollout/equal_groups_frac": batch.equal_groups.float().mean(),
                       "reward/generated_mean": rewards[scored].mean()}
        if result.model_scores_B is not None:   # RLHF: the proxy beside the truth (hacking shows)
            first_stats.update(reward_model_metrics(result.model_scores_B, result.correct_B))
        if result.judge_scores_B is not None:   # the judge beside the verifier
            first_stats.update(judge_metrics(result.judge_scores_B, result.correct_B,
                                             result.judge_stats))
        stats.update(read_floats(first_stats))
    return batch


def informative_groups(kept: list[tuple[int, ScoredBatch]], n_kept: int, first: ScoredBatch,
                       cfg: TrainConfig, tokenizer, world: World, stats: Counter) -> ScoredBatch:
    """Dynamic sampling's batch: the first P informative groups in (round, prompt) order, as one
    process keeps them; if the refills ran out, a multiple of the world size of them, so that
    every rank gets as many. None at all: an empty batch (train on nothing rather than noise)."""
    G = cfg.rollout.group_size
    n_use = min(n_kept, len(first.rewards_B) // G * world.size) // world.size * world.size
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
                cfg: TrainConfig, algo: AlgorithmConfig, world: World, stats: Counter,
                seats: int = 1):
    """A round's rewards (verifier, reward functions, the environment's, DAPO's overlong shaping),
    verdicts and each reward's parts by source; the prompts to ask again go to the sampler (a
    prompt's `seats` groups judged together), failed calls to `stats`."""
    rollout = episodes.rollout
    result = scorer(per_response, episodes.completions, group_size=cfg.rollout.group_size,
                    completion_ids=rollout.policy_ids())
    rewards, correct = episode_rewards(result, episodes, rollout.response_mask_B_T.device)
    parts = [dict(p) for p in result.parts_B]
    if episodes.parts is not None and any(episodes.parts):   # a driving environment's sources
        for part, env_parts in zip(parts, episodes.parts):
            part.update({f"environment/{k}": v for k, v in env_parts.items()})
        for k in sorted({k for p in episodes.parts for k in p}):   # (the first round's)
            if f"env/reward_{k}" not in stats:
                stats[f"env/reward_{k}"] = sum(p.get(k, 0.0) for p in episodes.parts) / len(parts)
    elif episodes.env_rewards_B.abs().sum() > 0:
        for part, r in zip(parts, episodes.env_rewards_B.tolist()):
            part["environment"] = r
    report_solved(sampler, correct, cfg.rollout.group_size * seats, cfg.data.retry_if, world, stats)
    if algo.overlong == "shape":
        # (an episode: its longest turn, the part max_new_tokens cuts; never the environment's tokens)
        penalty = overlong_penalty(rollout.longest_turn_B, cfg.rollout.max_new_tokens,
                                   algo.overlong_buffer, algo.overlong_penalty)
        rewards = rewards + penalty
        for part, r in zip(parts, penalty.tolist()):
            part["overlong"] = r
    for k, v in result.failures.items():
        stats[f"reward/failures_{k}"] += v
    if result.unscored:   # (no reward function scored them: out of the baseline and the loss)
        stats["reward/unscored"] += result.unscored
    return result, rewards, correct, parts


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


def loss_mask(rollout: Rollout, algo: AlgorithmConfig, scored_B: Tensor | None = None) -> Tensor:
    """The response tokens the loss sees: the policy's own (never an environment's), none of a
    response the judge could not score, and with the overlong filter none of a truncated
    answer's (they teach nothing about the end)."""
    mask = rollout.policy_tokens_B_T.clone()
    if algo.overlong == "filter":
        mask[rollout.truncated_B] = 0.0
    if scored_B is not None:
        mask[~scored_B] = 0.0
    return mask


def episode_rewards(result, episodes: Episodes, device) -> tuple[Tensor, Tensor]:
    """The reward of each episode: the verifier's and reward functions' (on its last turn) plus
    the environment's; correct is the environment's verdict where it gave one."""
    rewards = result.rewards_B.to(device) + episodes.env_rewards_B.to(device)
    return rewards, episodes.verdicts(result.correct_B).to(device)
