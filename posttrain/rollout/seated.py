"""Episodes of several seats the policy plays (envs/base.py `Seated`: a game's two players, a
proposer and a solver, an assistant and a simulated user), each seat's turns a row of its own.

    rows: (problem p, seat s, episode g) at (p*S + s)*G + g
    group p*S + s: seat s's rows of the G episodes of problem p

So a group's baseline compares one seat's outcomes over its problem's episodes: advantages are
taken within group and seat. One thread drives each episode with a policy client per seat
(rollout/driven.py `drive_batch` units), and the batcher waits on the episode, never on a seat
that waits for another's move. Row (p, s, g) samples from seed seeds[p*G + g] * S + s.

A seat's first request need not be the same over its group (player 1 is first asked after
player 0's move): a group's prompt is the common prefix of its rows' first requests, and the
rest of each row's starts its response as the environment's tokens (out of the loss, as every
message an environment writes). A seat that never asked the policy gets one end-of-text token.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from posttrain.data.tasks import Problem
from posttrain.envs.base import Environment, Seated, StartsBatch
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.driven import Session, drive_batch
from posttrain.rollout.episodes import Episodes, EpisodeSettings, _device, driven_rewards, padded_rollout
from posttrain.rollout.sessions import EpisodeRows


def seats_of(env: Environment, problems: list[Problem]) -> tuple[str, ...]:
    """The seats of the step's episodes when there are several (Seated), else ()."""
    if not isinstance(env, Seated) or not problems:
        return ()
    seats = tuple(env.seats(problems[0]))
    return seats if len(seats) > 1 else ()


def seat_problems(problems: list[Problem], seats: tuple[str, ...]) -> list[Problem]:
    """The problem of each group: one per (problem, seat), the seat in its meta (`seat`)."""
    if not seats:
        return list(problems)
    return [replace(p, meta={**p.meta, "seat": s}) for p in problems for s in seats]


def seat_seeds(seeds: Tensor | None, S: int, G: int) -> Tensor | None:
    """(P*S*G,) row seeds: seeds[p*G + g] * S + s at row (p*S + s)*G + g."""
    if seeds is None:
        return None
    seeds_P_1_G = seeds.view(-1, 1, G)
    return (seeds_P_1_G * S + torch.arange(S, device=seeds.device).view(1, S, 1)).reshape(-1)


def common_prefix(prompts: list[list[int]]) -> list[int]:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return prompts[0][:i]
    return prompts[0][:n]


def group_prompts(sessions: list[Session], G: int, eos_id: int) -> list[list[int]]:
    """Each group's prompt (its rows' first requests' common prefix); each row's session then
    starts with the rest of its first request, as the environment's tokens."""
    prompts = []
    for i in range(0, len(sessions), G):
        group = sessions[i:i + G]
        asked = [s.prompt for s in group if s.prompt is not None]
        prefix = common_prefix(asked) if asked else [eos_id]
        for s in group:
            rest = s.prompt[len(prefix):] if s.prompt is not None else []
            if not s.ids:   # (a row needs one token: the episode's end)
                s.append([eos_id], None)
            s.ids, s.logps = rest + s.ids, [0.0] * len(rest) + s.logps
            s.policy = [0.0] * len(rest) + s.policy
        prompts.append(prefix)
    return prompts


def seated_episodes(engine: RolloutEngine, tokenizer, env: Environment, problems: list[Problem],
                    G: int, params: SamplingParams, *, settings: EpisodeSettings = EpisodeSettings(),
                    generator: torch.Generator | None = None,
                    seeds: Tensor | None = None) -> Episodes:
    """`G` episodes of each problem, every seat a row (P*S*G rows, laid out as above)."""
    seats = seats_of(env, problems)
    S, P = len(seats), len(problems)
    if isinstance(env, StartsBatch):
        env.start_batch()
    rows = [p for p in seat_problems(problems, seats) for _ in range(G)]
    units = [{seat: (p * S + s) * G + g for s, seat in enumerate(seats)}
             for p in range(P) for g in range(G)]
    out = drive_batch(engine, tokenizer, env, rows, params, settings, generator=generator,
                      seeds=seat_seeds(seeds, S, G), units=units)
    prompts = group_prompts(out.sessions, G, tokenizer.eos_token_id)
    s = out.sessions
    rollout = padded_rollout(EpisodeRows.of_sessions(prompts, s), G, tokenizer.pad_token_id,
                             _device(engine))
    rewards, counts, errors = driven_rewards(out)
    return Episodes(rollout, [x.last_text for x in s], [tokenizer.decode(x.ids) for x in s],
                    rewards, [x.correct for x in out.results], counts, errors,
                    parts=[dict(x.parts) for x in out.results], timed_out=out.timed_out,
                    left_out=[x.left_out for x in out.results])
