"""Episodes of environments that open them and hold sessions (envs/base.py OpensEpisodes,
HoldsSessions: an OpenEnv environment, docs/environments.md).

What `reset` showed opens an episode's prompt (`opened`), and every episode of a problem must
have been shown the same (a group baseline compares them as answers to one task: the batch's
one prompt per problem holds it). A served environment runs at most as many episodes as it has
sessions; the others wait in a queue (`BookTurns`, a driver of the turn loop, rollout/turns.py):

    start what fits -> sample the next turn of every episode in flight -> an episode that ends
    gives its session back -> the next waiting episode starts (its reset, its opening) -> ...

The same driver takes every built-in episode that an engine samples one turn at a time (vLLM,
where all fit at once): each engine call samples one turn of every episode in flight, turn k of
row r from seed_key(seeds[r], k), its first from seeds[r], so an episode's tokens do not depend
on the episodes that shared its calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.envs.base import Environment, HoldsSessions, OpensEpisodes


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


class BookTurns:
    """Built-in episodes (episodes._Book) as a synchronous driver of the turn loop
    (rollout/turns.py `Answers`, `take_turns`): the episodes started first, then each waiting
    one as an episode ends and gives its session back (`admit`); every sampled turn recorded,
    handed to the environment, and its reply appended as context. `rows()`: what they hold."""

    def __init__(self, book: Any, encode: Callable[[list[Problem]], list[list[int]]],
                 budget: int) -> None:
        B, G = len(book.rows), book.G
        self.book, self.encode, self.budget, self.G = book, encode, budget, G
        self.q = EpisodeRows([[] for _ in range(B // G)], [[] for _ in range(B)],
                             [[] for _ in range(B)], [[] for _ in range(B)], [True] * B, [0] * B)
        self.waiting = deque(r for r in range(B) if not book.started[r])
        self.flight: set[int] = set()
        self.first = [r for r in range(B) if book.started[r]]

    def opening(self) -> dict[int, tuple[list[int], int]]:
        return self._start(self.first)

    def answer(self, row: int, ids: list[int], logps: list[float],
               cut: bool) -> dict[int, tuple[list[int], int]]:
        if _turn(self.book, self.q, row, (ids, logps, cut), self.budget):
            return {row: self._ask(row)}
        self.flight.discard(row)
        return self._start([])

    def rows(self) -> EpisodeRows:
        for i, p in enumerate(self.q.prompts):   # (a problem whose every episode timed out at reset)
            self.q.prompts[i] = p or self.encode([self.book.problem(i)])[0]
        return self.q

    def _start(self, started: list[int]) -> dict[int, tuple[list[int], int]]:
        """The first asks of episodes just started (`started`, then the waiting ones that now
        fit); one whose reset timed out ends at once and makes room for the next."""
        asks: dict[int, tuple[list[int], int]] = {}
        new = list(started)
        while True:
            new += admit(self.book, self.waiting, len(self.flight) + len(new))
            ended = [r for r in new if _ended_at_reset(self.book, self.q, r)]
            for r in new:
                if r not in ended:
                    self.flight.add(r)
                    asks[r] = self._ask(r)
            if not ended or not self.waiting:
                return asks
            new = []

    def _ask(self, r: int) -> tuple[list[int], int]:
        """Episode r's next turn: after its problem's prompt and the episode so far, at most
        the tokens its budget has left."""
        i = r // self.G
        if not self.q.prompts[i]:
            self.q.prompts[i] = self.encode([self.book.problem(i)])[0]
        return self.q.prompts[i] + self.q.ids[r], self.budget - len(self.q.ids[r])


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


def _turn(book: Any, q: EpisodeRows, r: int, turn: tuple[list[int], list[float], bool],
          budget: int) -> bool:
    """Episode r's next turn (its ids, log-probs, whether it was cut): record it, tell the
    environment, add its reply; True while the episode goes on (else its session goes back)."""
    new, logps, cut = turn
    q.ids[r] += new
    q.logps[r] += logps
    q.policy[r] += [1.0] * len(new)
    q.turns[r] += 1
    # (a turn cut by the episode's budget ends by length, whatever it would have ended with)
    reason = "length" if cut else "end"
    reply = book.respond(r, new, reason)
    if reply is None:
        q.truncated[r] = cut
    elif len(q.ids[r]) + len(reply) < budget:
        q.ids[r] += reply
        q.logps[r] += [0.0] * len(reply)
        q.policy[r] += [0.0] * len(reply)
        return True
    book.end(r)
    return False
