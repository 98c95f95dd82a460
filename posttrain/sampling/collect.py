"""A step's batch (docs/algorithms.md §6, §7): a group of answers per prompt, sampled (one turn,
or episodes of several with an environment), scored out of the trainer's process, and with DAPO's
dynamic sampling refilled until the groups whose rewards are not all equal fill the step
(several ranks: shared out again as whole groups)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.config.presets import AlgorithmConfig
from posttrain.util.health import Tally, merge_tallies
from posttrain.data.source import PromptStream
from posttrain.data.tasks import Problem
from posttrain.rewards.scorer import RewardResult
from posttrain.rewards.verifiers import overlong_penalty
from posttrain.rollout import EpisodeSettings, Rollout, SamplingParams, episode_settings
from posttrain.rollout.episodes import Episodes, run_episodes
from posttrain.rollout.seated import seat_problems, seated_episodes, seats_of
from posttrain.rollout.hf import row_seeds
from posttrain.model.distributed import World, full_weights_for_generation, gather_objects
from posttrain.sampling.batch import ScoredBatch, merge
from posttrain.sampling.metrics import judge_metrics, read_floats, reward_model_metrics
from posttrain.sampling.setup import SamplingSetup


@dataclass
class ScoredEpisodes:
    """Episodes sampled for a list of problems and their scores: `problems` has one entry per
    row (a problem repeated n times; several seats: per seat), `result` is the scorer's."""
    episodes: Episodes
    problems: list[Problem]
    result: RewardResult
    seats: int = 1          # rows per episode (an environment's seats)


def sample_and_score(setup: SamplingSetup, problems: list[Problem], n: int,
                     params: SamplingParams, *, episodes: EpisodeSettings | None = None,
                     seeds: list[int] | None = None, judged: bool = True, seated: bool = False,
                     gather: bool = False, timings: Counter | None = None) -> ScoredEpisodes:
    """`n` episodes for each problem, then their scores: the one place any command samples and
    then scores (train's rounds, the held-out evaluator, `generate`).

    `episodes`: how an episode is encoded (default: the run's config); `seeds`: per-row noise
    keys (else the setup's generator draws); `judged` False: the verifier and reward functions
    alone, no reward model or judge (evaluation); `seated`: an environment with several seats
    gives a row per seat; `gather`: under FSDP, the policy's full weights gathered around the
    sampling (and released before the scoring); `timings`: generate and reward seconds added."""
    t0 = time.perf_counter()
    seats = seats_of(setup.env, problems) if seated else []
    run = seated_episodes if seats else run_episodes
    model = getattr(setup.engine, "model", None) if gather else None
    with full_weights_for_generation(model, setup.world):
        ep = run(setup.engine, setup.tokenizer, setup.env, problems, n, params,
                 settings=episodes or episode_settings(setup.cfg), generator=setup.generator,
                 seeds=seeds)
    t1 = time.perf_counter()
    per_row = [p for p in seat_problems(problems, seats) for _ in range(n)]
    result = setup.scorer(per_row, ep.completions, with_model=judged, group_size=n,
                          completion_ids=ep.rollout.policy_ids())
    if timings is not None:
        timings["generate"] += t1 - t0
        timings["reward"] += time.perf_counter() - t1
    return ScoredEpisodes(ep, per_row, result, max(len(seats), 1))


def generate_and_score(setup: SamplingSetup, timings: Counter,
                       tallies: dict[str, Tally] | None = None) -> tuple[ScoredBatch, dict[str, float]]:
    """Sample a group of episodes per prompt and score them; with dynamic sampling, refill until
    P informative groups (P x seats where each seat of an episode is a row: rollout/seated.py).
    A single-turn task's episode is one answer (envs/base.py).

    Every rank draws the same P prompts and keeps its share; each response is sampled from noise
    keyed by (seed, draw number, g), so the batch does not depend on the number of ranks."""
    algo, world, G = setup.cfg.algo, setup.world, setup.cfg.rollout.group_size
    kept: list[tuple[int, ScoredBatch]] = []
    n_kept, rounds, stats = 0, 0, Counter()
    while True:
        batch = sample_and_score_round(setup, timings, tallies, stats, first=rounds == 0)
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
    return informative_groups(setup, kept, n_kept, first, stats), dict(stats)


def sample_and_score_round(setup: SamplingSetup, timings: Counter,
                           tallies: dict[str, Tally] | None, stats: Counter, *,
                           first: bool = True) -> ScoredBatch:
    """One round: draw P prompts (this rank's share), sample G episodes each, score them. The
    first round's statistics (before any filtering: the honest learning curve) go to `stats`."""
    cfg, world = setup.cfg, setup.world
    r, G, algo = cfg.rollout, cfg.rollout.group_size, cfg.algo
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, stop=r.stop)
    drawn, keys = setup.prompts.draw(r.prompts_per_step)   # (prompts that failed before come first)
    problems, keys = drawn[world.share(r.prompts_per_step)], keys[world.share(r.prompts_per_step)]
    scored = sample_and_score(setup, problems, G, params, seeds=row_seeds(cfg.seed, keys, G),
                              seated=True, gather=True, timings=timings)
    episodes, result = scored.episodes, scored.result
    if tallies is not None:   # the environment's, its tools' and the scorers' failures (FailureWatch)
        tallies.update(merge_tallies(tallies, episodes.tallies()))
        tallies.update(merge_tallies(tallies, result.tallies))
    rewards, correct, parts = round_rewards(setup, scored, stats)
    multi_turn = setup.env.max_turns > 1
    if multi_turn and first:    # per episode: turns, tool calls, malformed calls
        stats.update(episodes.metrics())
    elif first and episodes.counts.get("timeouts"):   # (a one-turn environment's time limits)
        stats["env/timeouts"] = episodes.metrics()["env/timeouts"]
    judged = episodes.scored(result.scored_B, rewards.device)   # (judged, within time limits)
    batch = ScoredBatch(episodes.rollout, scored.problems, episodes.completions, rewards, correct,
                        loss_mask(episodes.rollout, algo, judged),
                        transcripts=episodes.transcripts if multi_turn else None, reward_parts=parts,
                        scored_B=judged)
    if first:
        stats.update(read_floats(first_round_stats(batch, result, judged)))
    return batch


def first_round_stats(batch: ScoredBatch, result: RewardResult,
                      judged: Tensor | None) -> dict[str, Tensor]:
    """What the first round logs before any filtering: equal groups, the generated mean reward,
    the reward model beside the truth (hacking shows), the judge beside the verifier."""
    rewards = batch.rewards_B
    judged = torch.ones_like(rewards, dtype=torch.bool) if judged is None else judged
    out = {"rollout/equal_groups_frac": batch.equal_groups.float().mean(),
           "reward/generated_mean": rewards[judged].mean()}
    if result.model_scores_B is not None:
        out.update(reward_model_metrics(result.model_scores_B, result.correct_B))
    if result.judge_scores_B is not None:
        out.update(judge_metrics(result.judge_scores_B, result.correct_B, result.judge_stats))
    return out


def informative_groups(setup: SamplingSetup, kept: list[tuple[int, ScoredBatch]], n_kept: int,
                       first: ScoredBatch, stats: Counter) -> ScoredBatch:
    """Dynamic sampling's batch: the first P informative groups in (round, prompt) order, as one
    process keeps them; if the refills ran out, a multiple of the world size of them, so that
    every rank gets as many. None at all: an empty batch (train on nothing rather than noise)."""
    G, world = setup.cfg.rollout.group_size, setup.world
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
    merged = merge(parts, setup.tokenizer.pad_token_id)
    mine = world.share(n_use)
    return merged.select(torch.arange(mine.start * G, mine.stop * G))


def round_rewards(setup: SamplingSetup, scored: ScoredEpisodes,
                  stats: Counter) -> tuple[Tensor, Tensor, list[dict[str, float]]]:
    """A round's rewards (verifier, reward functions, the environment's, DAPO's overlong shaping),
    verdicts and each reward's parts by source; the prompts to ask again go to the prompt drawer
    (a prompt's groups, one per seat, judged together), failed calls to `stats`."""
    cfg, episodes, result = setup.cfg, scored.episodes, scored.result
    rollout, algo = episodes.rollout, setup.cfg.algo
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
    report_solved(setup.prompts, correct, cfg.rollout.group_size * scored.seats, cfg.data.retry_if,
                  setup.world, stats)
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
    return rewards, correct, parts


def report_solved(prompts: PromptStream, correct_B: Tensor, G: int, retry_if: str, world: World,
                  stats: Counter | None = None) -> None:
    """Tell the prompt stream which of the step's prompts to ask again (all ranks' prompts, in draw
    order): those not solved by every answer ('unsolved'), or solved by some but not all
    ('mixed': the groups that taught something). `stats` counts the draw's retried prompts."""
    if not prompts.retries:
        prompts.report([False] * (len(correct_B) // G * world.size))
        return
    if stats is not None:
        stats["rollout/retried_prompts"] += prompts.last_retried
    correct_P_G = correct_B.view(-1, G)
    again = ~correct_P_G.all(-1)
    if retry_if == "mixed":
        again &= correct_P_G.any(-1)
    prompts.report([a for share in gather_objects(again.tolist(), world) for a in share])


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
