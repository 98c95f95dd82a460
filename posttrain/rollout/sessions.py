"""Episodes of environments that open them and hold sessions (envs/base.py OpensEpisodes,
HoldsSessions: an OpenEnv environment, docs/environments.md).

What `reset` showed opens an episode's prompt (`opened`), and every episode of a problem must
have been shown the same (a group baseline compares them as answers to one task: the batch's
one prompt per problem holds it). A served environment runs at most as many episodes as it has
sessions; the others wait in a queue (`generate_queued`):

    start what fits -> sample the next turn of every episode in flight -> an episode that ends
    gives its session back -> the next waiting episode starts (its reset, its opening) -> ...

Each engine call samples one turn of every episode in flight, as `episodes.generate_by_turns`
does for an engine without `respond=`: turn k of row r draws from seed
(seeds[r] * 1_000_003 + k), its first from seeds[r], so an episode's tokens do not depend on the
episodes that shared its calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from posttrain.data.tasks import Problem
from posttrain.envs.base import Environment, HoldsSessions, OpensEpisodes
from posttrain.rollout.base import Rollout, RolloutEngine, SamplingParams, seed_key


def opened(problem: Problem, text: str | None) -> Problem:
    """The problem as its episode opens (OpensEpisodes): the environment's opening after the
    prompt, a blank line between (in the last user message of a conversational row), or as the
    prompt when the problem has none (a row of seeds or reset options only)."""
    if not text:
        return problem
    if problem.messages:
        *head, last = problem.messages
        if last.get("role") == "user" and str(last.get("content") or "").strip():
            last = {**last, "content": f"{last['content']}\n\n{text}"}
            return replace(problem, prompt=last["content"], messages=(*head, last))
        return replace(problem, prompt=text,
                       messages=(*problem.messages, {"role": "user", "content": text}))
    if problem.prompt.strip():
        return replace(problem, prompt=f"{problem.prompt}\n\n{text}")
    return replace(problem, prompt=text)


def refuse_untaskable_groups(env: Environment, G: int) -> None:
    """A problem's episodes must face the same task: an environment whose reset cannot be handed
    one (OpensEpisodes.takes_task False) gets one episode per problem, else a one-line error."""
    if G > 1 and isinstance(env, OpensEpisodes) and not env.takes_task:
        raise ValueError(
            f"the {env.name} environment's reset takes no seed or other parameter a problem's row "
            f"could fill, so the {G} episodes of a problem could face different tasks, which a "
            "group baseline would compare as one: give reset a `seed` parameter (or one named "
            "after a data column), or sample one episode per problem (rollout.group_size 1, "
            "with a baseline that needs no group: algorithm.advantage batch_mean)")


@dataclass
class EpisodeRows:
    """Episodes as per-row lists (episodes.padded_rollout makes them one Rollout): each row's
    tokens after its problem's prompt, their log-probs, 1 where the policy wrote them, whether
    the episode was cut, and (queued episodes) the turns taken."""

    prompts: list[list[int]]                 # one per problem: what its episodes opened with
    ids: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)
    policy: list[list[float]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)

    @classmethod
    def of_sessions(cls, prompts: list[list[int]], sessions: list[Any]) -> EpisodeRows:
        """Driven episodes' rows (rollout/driven.py `Session`s, one per row)."""
        return cls(prompts, [s.ids for s in sessions], [s.logps for s in sessions],
                   [s.policy for s in sessions], [s.truncated for s in sessions])


def generate_queued(engine: RolloutEngine, book: Any,
                    encode: Callable[[list[Problem]], list[list[int]]], params: SamplingParams,
                    generator: torch.Generator | None = None,
                    seeds: Tensor | None = None) -> EpisodeRows:
    """The episodes of `book` (episodes._Book: some started, the rest waiting for a session),
    at most as many in flight as the environment has room for; `encode(problems)` their prompts."""
    B, G = len(book.rows), book.G
    budget = params.max_episode_tokens or params.max_new_tokens
    turn_params = replace(params, max_episode_tokens=None)
    q = EpisodeRows([[] for _ in range(B // G)], [[] for _ in range(B)], [[] for _ in range(B)],
               [[] for _ in range(B)], [True] * B, [0] * B)
    waiting = deque(r for r in range(B) if not book.started[r])
    flight = [r for r in range(B) if book.started[r]]
    while flight or waiting:
        flight += admit(book, waiting, len(flight))
        rows = [r for r in flight if not _ended_at_reset(book, q, r)]
        for r in rows:
            if not q.prompts[r // G]:
                q.prompts[r // G] = encode([book.problem(r // G)])[0]
        if not rows:
            flight = []
            continue
        turn_seeds = None if seeds is None else torch.stack(
            [seeds[r] if q.turns[r] == 0 else seed_key(seeds[r], q.turns[r]) for r in rows])
        out = engine.generate([q.prompts[r // G] + q.ids[r] for r in rows], 1, turn_params,
                              generator, seeds=turn_seeds)
        flight = [r for j, r in enumerate(rows) if _turn(book, q, out, j, r, budget)]
    for i, p in enumerate(q.prompts):   # (a problem whose every episode timed out at reset)
        q.prompts[i] = p or encode([book.problem(i)])[0]
    return q


def admit(book: Any, waiting: deque, in_flight: int) -> list[int]:
    """Start waiting episodes, in order, while the environment has room (its known limit, or
    until a reset is refused); the rows started."""
    started: list[int] = []
    while waiting:
        limit = book.env.max_episodes if isinstance(book.env, HoldsSessions) else None
        if limit is not None and in_flight + len(started) >= limit:
            break
        if not book.start(waiting[0]):
            break
        started.append(waiting.popleft())
    if waiting and not started and not in_flight:
        raise RuntimeError(f"the {book.env.name} environment has no room for an episode while "
                           "none of this batch's is running; check who else holds its sessions")
    return started


def _ended_at_reset(book: Any, q: EpisodeRows, r: int) -> bool:
    """An episode whose reset timed out is over before its first turn: one end-of-text token,
    outside the policy's loss (as a driven episode that never asked the policy)."""
    if not book.timed_out[r]:
        return False
    q.ids[r], q.logps[r], q.policy[r], q.truncated[r] = [book.eos_id], [0.0], [0.0], False
    book.end(r)
    return True


def _turn(book: Any, q: EpisodeRows, out: Rollout, j: int, r: int, budget: int) -> bool:
    """Row j of an engine call was episode r's next turn: record it, tell the environment, add
    its reply; True while the episode goes on (else its session goes back)."""
    n = int(out.response_mask_B_T[j].sum())
    new = out.response_ids_B_T[j, :n].tolist()[: budget - len(q.ids[r])]
    q.ids[r] += new
    q.logps[r] += out.logp_B_T[j, :len(new)].tolist()
    q.policy[r] += [1.0] * len(new)
    q.turns[r] += 1
    # (a turn cut by the episode's budget ends by length, whatever it would have ended with)
    reason = "length" if bool(out.truncated_B[j]) or len(new) < n else "end"
    reply = book.respond(r, new, reason)
    if reply is None:
        q.truncated[r] = reason == "length"
    elif len(q.ids[r]) + len(reply) < budget:
        q.ids[r] += reply
        q.logps[r] += [0.0] * len(reply)
        q.policy[r] += [0.0] * len(reply)
        return True
    book.end(r)
    return False
