"""The environment a policy acts in: an episode starts from a problem, the policy speaks, the
environment answers (a tool result, feedback, the next question) or ends the episode, for any
number of turns up to a limit. A single-turn task is the one-turn case (`SingleTurn`).

The environment sees text and answers with chat messages; rollout/episodes.py turns its messages
into tokens with the chat template and feeds them to the sampler, whose loss mask leaves them out
(docs/environments.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.data.tasks import Problem


class EpisodeTimeout(TimeoutError):
    """An episode passed its time limit (env.turn_timeout_s, env.episode_timeout_s): it ends,
    is counted as an environment error (env/timeouts) and is left out of its group's baseline
    and the loss, as an unscorable response. An environment's reset, step or drive raises it."""


def no_limit_as_none(seconds: float | None) -> float | None:
    """A time limit as a wait takes it: None for none (None, or inf, which the options accept
    as "no limit" but Thread.join, Future.result and Timer refuse with OverflowError)."""
    return None if seconds is None or math.isinf(seconds) else float(seconds)


@dataclass(frozen=True)
class Reply:
    """What the environment does after one of the policy's turns."""

    message: dict[str, str] | None = None   # {"role": "tool" | "user", "content": ...}; None: the episode ends
    reward: float = 0.0                      # added to the episode's reward
    correct: bool | None = None              # the environment's own verdict (None: the task's verifier decides)
    counts: dict[str, int] = field(default_factory=dict)   # e.g. {"tool_calls": 1}, summed per step


class Environment(Protocol):
    """What every environment has. Optional hooks, each its own Protocol below and found with
    `isinstance`: `bind(tokenizer)` (BindsTokenizer), `tool_schemas` (DescribesTools),
    `demonstration(problem)` (Demonstrates), `start_batch()` (StartsBatch), `opening(state)`
    (OpensEpisodes), `end(state)` and `max_episodes` (HoldsSessions)."""

    name: str
    max_turns: int                     # the policy speaks at most this many times per episode
    stop: tuple[str, ...]              # extra stop strings that end a policy turn (a tool call's end)

    def system_prompt(self, base: str | None) -> str | None:
        """The system prompt of every episode (`base`: the configured one), e.g. with tool
        instructions."""
        ...

    def reset(self, problem: Problem) -> Any:
        """A new episode's state."""
        ...

    def step(self, state: Any, text: str, turn: int) -> Reply:
        """The policy wrote `text` as its turn number `turn` (1-based). On the last allowed turn
        the reply's message is ignored (the episode ends); its reward and verdict still count."""
        ...


@runtime_checkable
class BindsTokenizer(Protocol):
    """Optional hook: the environment adapted to the policy's tokenizer (a tool environment picks
    the chat template's own tool-call format); called once, before the first episode."""

    def bind(self, tokenizer: Any) -> Environment: ...


@runtime_checkable
class DescribesTools(Protocol):
    """Optional hook: function schemas handed to a chat template that renders tools itself
    (None: the system prompt describes them)."""

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None: ...


@runtime_checkable
class StartsBatch(Protocol):
    """Optional hook: told before each batch of episodes starts (a budget shared by the batch's
    episodes, such as the tool time of a step, restarts)."""

    def start_batch(self) -> None: ...


@runtime_checkable
class OpensEpisodes(Protocol):
    """Optional hook: what `reset` showed (the task: a question, a board, a goal) opens the
    episode: `opening(state)` goes after the problem's prompt, or in its place when the problem
    has none (rollout/episodes.py). `takes_task` False: reset cannot be handed a problem's task
    (no seed or other parameter a row fills), so the episodes of one problem could face different
    tasks; a problem then gets one episode (a group of more is refused)."""

    takes_task: bool

    def opening(self, state: Any) -> str | None: ...


class EnvironmentFull(RuntimeError):
    """An environment cannot start another episode now: its sessions are all taken by episodes
    of this batch. The episode waits until one of them ends (rollout/queued.py)."""


@runtime_checkable
class HoldsSessions(Protocol):
    """Optional hook: each episode holds one of a limited number of sessions (a served OpenEnv
    environment's), from `reset` until `end(state)` gives it back (called once an episode ends,
    however it ends; again is harmless). At most `max_episodes` run at once (None: no limit
    known); a reset past the limit raises EnvironmentFull."""

    @property
    def max_episodes(self) -> int | None: ...

    def end(self, state: Any) -> None: ...


@runtime_checkable
class Demonstrates(Protocol):
    """Optional hook: an expert's episode for a problem, as chat messages (SFT data that teaches
    the environment's format: `posttrain generate --demonstrate`)."""

    def demonstration(self, problem: Problem) -> list[dict[str, str]]: ...


@dataclass(frozen=True)
class Driven:
    """How an episode that the environment drove ended (DrivesPolicy)."""

    reward: float = 0.0                      # the episode's reward from the environment
    correct: bool | None = None              # its verdict (None: the task's verifier decides)
    parts: dict[str, float] = field(default_factory=dict)   # the reward by source (logged), in it
    counts: dict[str, int] = field(default_factory=dict)    # summed per step, as Reply.counts
    error: str | None = None                 # the episode failed (counted; most failing stops the run)
    # a seat whose turns do not train (an untrainable seat, one the episode did not play, Seated):
    # its row is left out of its group's baseline and the loss
    left_out: bool = False


@runtime_checkable
class DrivesPolicy(Protocol):
    """Optional hook: the environment runs each episode itself (an agent harness, a verifiers
    rollout) and asks the policy for every turn with `policy.chat(messages)`; the sampler
    answers every episode's request of a turn in one batch and records the exact tokens
    (rollout/driven.py). `reset` and `step` are not called."""

    def drive(self, policy: Any, problem: Problem) -> Driven: ...


@runtime_checkable
class Seated(Protocol):
    """Optional hook of a DrivesPolicy environment whose episode has several seats the policy
    plays (a game's two players, a proposer and a solver, an assistant and a simulated user):
    `seats(problem)` names them (the same for every problem of a run), and
    `drive_seats(policies, problem)` plays one episode with a policy client per seat and returns
    each seat's end. Each seat's turns are a row of their own, grouped with the same seat's rows
    of the problem's other episodes (rollout/seated.py); one seat is plain `drive`."""

    def seats(self, problem: Problem) -> tuple[str, ...]: ...

    def drive_seats(self, policies: dict[str, Any], problem: Problem) -> dict[str, Driven]: ...


class DrivingEnvironment:
    """The base of an environment that drives its episodes (DrivesPolicy): it has no turns of
    its own to take, so `reset` and `step` are refused; subclasses give `drive`."""

    name = "driving"
    max_turns = 4
    stop: tuple[str, ...] = ()
    tool_schemas = None

    def system_prompt(self, base: str | None) -> str | None:
        return base

    def reset(self, problem: Problem) -> Any:
        raise NotImplementedError(f"the {self.name} environment drives its episodes (drive)")

    def step(self, state: Any, text: str, turn: int) -> Reply:
        raise NotImplementedError(f"the {self.name} environment drives its episodes (drive)")


class SingleTurn:
    """One answer per problem, scored by the task's verifier and the reward functions."""

    name = "single_turn"
    max_turns = 1
    stop: tuple[str, ...] = ()

    def system_prompt(self, base: str | None) -> str | None:
        return base

    def reset(self, problem: Problem) -> Any:
        return None

    def step(self, state: Any, text: str, turn: int) -> Reply:
        return Reply()
