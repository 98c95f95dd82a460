"""The turn loop: every multi-turn episode that an engine samples one turn at a time runs here.
`TurnBatcher` samples the turns of every live episode in one engine call once each has asked (or
ended), and ends an episode that passes a time limit so that the others never wait for it.

    while episodes are live: wait until each has asked -> one engine call samples every asked
    turn -> each episode gets its turn back (and asks again, or ends)

Two kinds of driver ask: episodes an environment drives (rollout/driven.py), each in a thread of
its own that blocks in `ask`; and built-in episodes (rollout/sessions.py `BookTurns`, an
`Answers`), whose environment's `step` is a plain call, answered within the loop (`take_turns`),
no thread each. An engine that runs whole episodes itself (`RolloutEngine.runs_episodes`: the
in-process engine, every turn through one KV cache, rollout/hf.py `respond=`) declares it and
takes built-in episodes in one call instead. Turn k of row r draws its noise from
seed_key(seeds[r], k), its first from seeds[r], so an episode's tokens do not depend on the
episodes that shared its calls.

Time limits: an episode whose environment holds the turn longer than `env.turn_timeout_s` (from
its start or its last reply to its next request or its end) or that runs longer than
`env.episode_timeout_s` in all is ended: its pending and later requests are answered EpisodeOver,
the batch's turns stop waiting for it, and drive_batch counts it (env/timeouts, an environment
error) and leaves it out of its group's baseline and the loss, as an unscorable response. Its
thread is abandoned, not killed (Python cannot stop a thread stuck in a harness): nothing waits
on it again, and `watch`, the thread that drives the batch, waits with a timeout on every wait.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch
from torch import Tensor

from posttrain.envs.base import no_limit_as_none
from posttrain.envs.endpoint import RequestError
from posttrain.rollout.base import RolloutEngine, SamplingParams, seed_key


class EpisodeOver(RequestError):
    """The episode's token budget (env.max_tokens) is spent, or the episode was ended (a time
    limit, the step stopped): no more turns (the endpoint answers 400, as vLLM does to a request
    past the context length)."""


Asks = dict[int, tuple[list[int], int]]   # row -> (the ids its next turn follows, most new tokens)


class Answers(Protocol):
    """A synchronous driver of the turn loop (`take_turns`): the turns its episodes ask first,
    and, for each sampled turn, the asks that follow it (the row's next turn while its episode
    goes on; episodes that start now that it ended). A row that does not ask again has ended."""

    def opening(self) -> Asks: ...

    def answer(self, row: int, ids: list[int], logps: list[float], cut: bool) -> Asks: ...


class TurnBatcher:
    """Waits until every live episode has asked for its next turn (or ended), then samples all
    of them in one engine call; `ask` blocks its episode's thread until its turn is sampled.
    `watch` (the thread that drives the batch) ends each episode that passes a time limit and
    makes every engine call: the episodes' threads only ask. (Sampled from whichever episode
    thread asked last, a step's tensors came from a dozen threads, each with its own malloc arena
    that keeps its peak: a two-seat game's step grew the trainer to 13 GB, 22.8 GB by step 2.)

    `units`: the episode of each row, where an episode has several rows (its seats, Seated): an
    episode waits when one of its rows has asked (its other seats wait on that turn), its rows
    share the time limits, and a limit ends all of them. None: each row its own episode.

    `answers`: a synchronous driver (`Answers`) instead of threads: its rows are live from their
    first ask to their last turn, and `watch` hands it each sampled turn."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, n: int, *,
                 generator: torch.Generator | None = None, seeds: Tensor | None = None,
                 turn_timeout_s: float | None = None, episode_timeout_s: float | None = None,
                 units: list[int] | None = None, answers: Answers | None = None) -> None:
        self.engine, self.params, self.generator, self.seeds = engine, params, generator, seeds
        self.unit = list(units) if units is not None else list(range(n))
        self.answers = answers
        self.cond = threading.Condition()
        self.live = set(range(n)) if answers is None else set()
        self.pending: dict[int, tuple[list[int], int]] = {}
        self.results: dict[int, Any] = {}
        self.turn = [0] * n
        self.error: BaseException | None = None   # the engine's failure: the step's, re-raised
        # (inf: no limit, as None)
        self.turn_s, self.episode_s = no_limit_as_none(turn_timeout_s), no_limit_as_none(
            episode_timeout_s)
        self.started = time.monotonic()
        self.since = [self.started] * n           # when each row last got the turn back
        self.timed_out: dict[int, str] = {}       # rows a time limit ended: which limit
        self.outcomes: dict[int, Any] = {}        # rows that ended by themselves: `done`'s outcome

    def check(self, row: int) -> None:
        """(Under the lock.) Raise unless the row's episode may still ask: the engine's failure,
        or EpisodeOver for a row that has ended (a request that outlived a timed-out episode)."""
        if self.error is not None:
            raise self.error
        if row not in self.live:
            raise EpisodeOver("the episode has ended")

    def live_or_raise(self, row: int) -> None:
        """`check` for a client, before it does any work for a request (tokenising it)."""
        with self.cond:
            self.check(row)

    def ask(self, row: int, context: list[int], max_new: int) -> tuple[list[int], list[float], bool]:
        with self.cond:
            self.check(row)
            if row in self.pending:
                raise RuntimeError("an episode asked the policy twice at once")
            self.pending[row] = (context, max_new)
            self.cond.notify_all()   # (`watch` samples the turn once every live episode asked)
            while row not in self.results:
                self.cond.wait()
            out = self.results.pop(row)
        if isinstance(out, BaseException):
            raise out
        return out

    def done(self, row: int, outcome: Any = None, timed_out: str | None = None) -> bool:
        """The row's episode ended with `outcome` (`timed_out`: by the environment's own time
        limit, recorded as the batch's); a request of it still waiting is answered EpisodeOver.
        The outcome is stored here, under the lock, before the row leaves the live set: `watch`
        returns only once every finished episode's outcome is in `outcomes`. False: a time limit
        or a stop had ended it already (its outcome does not count)."""
        with self.cond:
            was_live = row in self.live
            if was_live and timed_out is not None:
                self.timed_out[row] = timed_out
            elif was_live:
                self.outcomes[row] = outcome
            self._end(row, "the episode ended while its request waited")
            return was_live   # (_end woke `watch`: the others may all be waiting for this one)

    def _end(self, row: int, why: str) -> None:
        """(Under the lock.) The row is no longer live; a request of it waiting is answered
        EpisodeOver. It never samples: `watch` does, once awake (every row it ends in a time
        limit's sweep first), and never again after a stop."""
        self.live.discard(row)
        if self.pending.pop(row, None) is not None:
            self.results[row] = EpisodeOver(why)
        self.cond.notify_all()

    def time_left(self) -> float | None:
        """Seconds until the batch's episodes pass env.episode_timeout_s (None: no limit)."""
        return None if self.episode_s is None else max(
            0.0, self.started + self.episode_s - time.monotonic())

    def watch(self) -> None:
        """Return once no episode is live, ending each that passes a time limit. Every wait has
        a timeout; interrupted (a stop signal), it ends every episode before re-raising."""
        try:
            with self.cond:
                if self.answers is not None:
                    self._asked(self.answers.opening())
                while self.live:
                    now = time.monotonic()
                    passed = [(r, self._passed(r, now)) for r in sorted(self.live)]
                    for row, limit in passed:   # (every expired row first: no turn is sampled
                        if limit is not None:   # for a row this sweep ends)
                            self.timed_out[row] = f"passed {limit}"
                            self._end(row, f"the episode passed {limit}")
                    if not self._run_if_ready() and self.live:
                        self.cond.wait(self._next_deadline(now) - now)
        except BaseException:
            if self.cond.acquire(timeout=10.0):   # (a turn being sampled holds it that long at most)
                self._stop()
                self.cond.release()
            raise

    def _stop(self) -> None:
        """(Under the lock.) The step was stopped: every episode ends at once, every waiting
        request is answered EpisodeOver, and the engine is not called again."""
        for row in self.pending:
            self.results[row] = EpisodeOver("the step was stopped")
        self.pending.clear()
        self.live.clear()
        self.cond.notify_all()

    def _passed(self, row: int, now: float) -> str | None:
        """The limit the row has passed, as its option and value, or None."""
        if self.episode_s is not None and now - self.started >= self.episode_s:
            return f"env.episode_timeout_s={self.episode_s:g}"
        if (self.turn_s is not None and not self._asking(row)
                and now - self.since[row] >= self.turn_s):
            return f"env.turn_timeout_s={self.turn_s:g}"
        return None

    def _next_deadline(self, now: float) -> float:
        """(Under the lock.) The earliest time a live row could pass a limit (at most 60 s on)."""
        times = [now + 60.0]
        if self.episode_s is not None:
            times.append(self.started + self.episode_s)
        if self.turn_s is not None:
            times += [self.since[r] + self.turn_s for r in self.live if not self._asking(r)]
        return max(min(times), now + 0.01)

    def _asking(self, row: int) -> bool:
        """(Under the lock.) Whether the row's episode waits on a turn (one of its rows asked)."""
        return any(self.unit[r] == self.unit[row] for r in self.pending)

    def _run_if_ready(self) -> bool:
        """(Under the lock.) Sample every pending turn once all live episodes wait; whether it
        did (a synchronous driver's rows have asked again by then: no wait before the next)."""
        waiting = {self.unit[r] for r in self.pending}
        if not self.pending or waiting != {self.unit[r] for r in self.live}:
            return False
        rows = sorted(self.pending)
        try:
            outs = self._sample(rows)
        except Exception as e:  # noqa: BLE001 - kept: drive_batch raises it once episodes end
            self.error = e
            outs = [e] * len(rows)
        now = time.monotonic()
        self.pending.clear()
        for r in rows:
            self.turn[r] += 1
        sampled = {self.unit[r] for r in rows}
        for r in range(len(self.since)):   # (the sampling's time is not the environment's turn)
            if self.unit[r] in sampled:
                self.since[r] = now
        if self.answers is None:
            self.results.update(zip(rows, outs))
        else:
            self._answer(rows, outs)
        self.cond.notify_all()
        return True

    def _answer(self, rows: list[int], outs: list[Any]) -> None:
        """(Under the lock.) A synchronous driver's sampled turns, handed over in row order."""
        for r, out in zip(rows, outs):
            if isinstance(out, BaseException):
                raise out
            asks = self.answers.answer(r, *out)
            if r not in asks:
                self.live.discard(r)
            self._asked(asks)

    def _asked(self, asks: Asks) -> None:
        """(Under the lock.) A synchronous driver's rows ask their next turns."""
        for r, ask in asks.items():
            self.pending[r] = ask
            self.live.add(r)

    def _sample(self, rows: list[int]) -> list[tuple[list[int], list[float], bool]]:
        seeds = None
        if self.seeds is not None:
            turn = torch.tensor([self.turn[r] for r in rows])
            base = self.seeds[rows]
            seeds = torch.where(turn == 0, base, seed_key(base, turn))
        out = self.engine.generate([self.pending[r][0] for r in rows], 1, self.params,
                                   self.generator, seeds=seeds)
        results = []
        for j, r in enumerate(rows):
            n = int(out.response_mask_B_T[j].sum())
            keep = min(n, self.pending[r][1])
            results.append((out.response_ids_B_T[j, :keep].tolist(),
                            out.logp_B_T[j, :keep].tolist(),
                            bool(out.truncated_B[j]) or keep < n))
        return results


def take_turns(engine: RolloutEngine, answers: Answers, n: int, params: SamplingParams, *,
               generator: torch.Generator | None = None, seeds: Tensor | None = None) -> None:
    """Run a synchronous driver's `n` rows through the turn loop until every episode has ended
    (`answers` keeps what was sampled)."""
    TurnBatcher(engine, params, n, generator=generator, seeds=seeds, answers=answers).watch()
