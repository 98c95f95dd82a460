"""Episodes an environment drives (envs/base.py `DrivesPolicy`): the environment's own loop (an
agent harness, a verifiers rollout, a client of the OpenAI-compatible endpoint) asks the policy
for each turn with chat messages, and posttrain records the exact tokens it trains on.

    step: B episodes in threads -> each asks policy.chat(messages) -> once every live episode
    has asked (or ended), one engine call samples all their turns -> each gets its reply

One batch per turn, whatever the threads' timing, and each row's noise keyed by its own seed
(turn k of row r: seeds[r] * 1_000_003 + k, as for built-in episodes: rollout/turns.py), so a
driven episode is as reproducible as a built-in one.

Tokens: the first request's messages are the prompt (the chat template applied once). A later
request whose messages repeat the conversation so far, the policy's reply as it was returned,
and add messages after it gets those messages appended as tokens (ReplyEncoder): the policy's own
tokens are never re-tokenised (TRL #5224). A request that rewrites the history (a template that
drops earlier reasoning, a harness that edits the reply) is a *fork*: the row restarts after the
prompt from the rendered conversation, the policy's earlier turns lose their place in the loss,
and the fork is counted (env/forks), never silently mis-masked.

Time limits (rollout/turns.py): an episode that holds its turn longer than
`env.turn_timeout_s`, or runs longer than `env.episode_timeout_s`, is ended, counted
(env/timeouts) and left out of its group's baseline and the loss; the batch goes on without it.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor

from posttrain.data.tasks import Problem
from posttrain.envs.base import Driven, Environment, EpisodeTimeout
from posttrain.model.prompts import ReplyEncoder, _ids
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.turns import EpisodeOver, TurnBatcher

__all__ = ["DrivenBatch", "EpisodeOver", "PolicyClient", "PolicyTurn", "Recorder", "Session",
           "TurnBatcher", "drive_batch", "plain", "text_of"]


@dataclass(frozen=True)
class PolicyTurn:
    text: str
    prompt_ids: list[int]             # what the policy read (the episode so far)
    completion_ids: list[int]         # what it sampled
    logprobs: list[float]             # log pi_old of each sampled token
    finish_reason: str                # 'stop' or 'length'
    tokens: list[str] = field(default_factory=list)   # each sampled token as text


def text_of(content: Any) -> str:
    """A message's text (OpenAI content parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a chat template takes it: its text, and its tool calls or tool-call id."""
    out = {"role": message.get("role", "user"), "content": text_of(message.get("content"))}
    out.update({k: message[k] for k in ("tool_calls", "tool_call_id", "name") if message.get(k)})
    return out


def same_turns(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(x.get("role") == y.get("role") and
                                    text_of(x.get("content")) == text_of(y.get("content"))
                                    for x, y in zip(a, b))


@dataclass
class Session:
    """One episode's tokens after its prompt: ids, log-probs, which the policy sampled."""

    prompt: list[int] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    policy: list[float] = field(default_factory=list)
    last_text: str = ""
    truncated: bool = False
    turns: int = 0
    forks: int = 0

    def append(self, ids: list[int], logps: list[float] | None) -> None:
        self.ids += ids
        self.logps += logps if logps is not None else [0.0] * len(ids)
        self.policy += [1.0 if logps is not None else 0.0] * len(ids)


class Recorder:
    """Turns chat requests into token ids for the sampler and records what was sampled."""

    def __init__(self, tokenizer, encoder: ReplyEncoder, template_kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.encoder, self.kwargs = tokenizer, encoder, template_kwargs

    def render(self, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        if not self.encoder.templated:
            raise ValueError("an environment that drives the policy sends chat messages: it needs "
                             "a tokenizer with a chat template and data.chat_template true")
        extra = dict(self.kwargs, **({"tools": tools} if tools else {}))
        return _ids(self.tokenizer.apply_chat_template([plain(m) for m in messages],
                                                       add_generation_prompt=True, tokenize=True,
                                                       **extra))

    def context(self, s: Session, messages: list[dict[str, Any]], tools: list | None,
                budget: int) -> list[int]:
        """The ids the next turn is sampled after, the environment's new messages recorded;
        EpisodeOver when they leave no room in the episode's `budget` of tokens."""
        if s.prompt is None:
            s.prompt, s.messages = self.render(messages, tools), list(messages)
            return list(s.prompt)
        k = len(s.messages)
        fork = not (len(messages) > k and same_turns(messages[:k], s.messages))
        if not fork:
            wrote_eos = bool(s.ids) and s.ids[-1] == self.tokenizer.eos_token_id
            extra, base = self.encoder.encode_messages(list(messages[k:]), wrote_eos), len(s.ids)
        else:   # the history was rewritten: the row restarts after the prompt
            full = self.render(messages, tools)
            if full[:len(s.prompt)] != s.prompt:
                raise ValueError("a driven episode changed its first prompt (the system prompt "
                                 "or first message) between turns; the row cannot follow it")
            extra, base = full[len(s.prompt):], 0
        if base + len(extra) >= budget:   # (as sessions.BookTurns: a reply that does not fit ends it)
            s.truncated = True
            raise EpisodeOver(f"the episode's {budget} tokens (env.max_tokens) are spent")
        if fork:
            s.ids, s.logps, s.policy, s.forks = [], [], [], s.forks + 1
        s.append(extra, None)
        s.messages = list(messages)
        return s.prompt + s.ids

    def context_ids(self, s: Session, ids: list[int], budget: int) -> list[int]:
        """`context` for a completions request: the token ids the client sends (text it sends
        is tokenised once, here); ids after the episode so far are the environment's."""
        if s.prompt is None:
            s.prompt = list(ids)
            return list(s.prompt)
        so_far = s.prompt + s.ids
        fork = ids[:len(so_far)] != so_far or len(ids) <= len(so_far)
        if fork and ids[:len(s.prompt)] != s.prompt:
            raise ValueError("a driven episode changed its first prompt between turns; the row "
                             "cannot follow it")
        extra, base = (ids[len(s.prompt):], 0) if fork else (ids[len(so_far):], len(s.ids))
        if base + len(extra) >= budget:
            s.truncated = True
            raise EpisodeOver(f"the episode's {budget} tokens (env.max_tokens) are spent")
        if fork:
            s.ids, s.logps, s.policy, s.forks = [], [], [], s.forks + 1
        s.append(extra, None)
        return s.prompt + s.ids

    def record(self, s: Session, ids: list[int], logps: list[float], truncated: bool) -> str:
        s.append(ids, logps)
        s.turns += 1
        s.truncated = truncated
        s.last_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        s.messages.append({"role": "assistant", "content": s.last_text})
        return s.last_text


class PolicyClient:
    """What a driving environment's episode talks to: `chat(messages)` is one policy turn.
    `max_tokens` can only lower the rollout's max_new_tokens; temperature, top_p and stop
    strings (`sampling`, ignored) are the rollout's: the trainer's log-probs are computed at them."""

    def __init__(self, row: int, session: Session, recorder: Recorder, batcher: TurnBatcher,
                 params: SamplingParams, budget: int) -> None:
        self.row, self.session, self.recorder, self.batcher = row, session, recorder, batcher
        self.params, self.budget = params, budget
        self.lock = threading.Lock()
        self.end_hooks: list[Callable[[], None]] = []

    def on_end(self, hook: Callable[[], None]) -> None:
        """`hook()` is called once the batch is over if a time limit or a stop ended this
        episode (its thread may never return): an environment releases what the episode holds
        (the agent environment: its endpoint session)."""
        self.end_hooks.append(hook)

    def chat(self, messages: list[dict[str, Any]], tools: list | None = None,
             max_tokens: int | None = None, **sampling: Any) -> PolicyTurn:
        with self.lock:
            self.batcher.live_or_raise(self.row)   # (an ended episode's request costs nothing)
            context = self.recorder.context(self.session, messages, tools, self.budget)
            return self._turn(context, max_tokens)

    def shown_as(self, content: str | None) -> None:
        """The last reply as the environment will send it back (a verifiers harness: its text
        without the tool calls parsed out of it); later requests are checked against this."""
        with self.lock:
            self.session.messages[-1]["content"] = content or ""

    def complete(self, prompt: str | list[int], max_tokens: int | None = None,
                 **sampling: Any) -> PolicyTurn:
        """A completions request: the prompt as text (tokenised here) or token ids."""
        with self.lock:
            self.batcher.live_or_raise(self.row)
            ids = (self.recorder.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                   if isinstance(prompt, str) else list(prompt))
            return self._turn(self.recorder.context_ids(self.session, ids, self.budget), max_tokens)

    def detached(self) -> "PolicyClient":
        """A client on the same row whose turns are recorded nowhere (a seat's further trace in
        one episode, Seated): sampled from the row's seed, its turns counted on the row."""
        return PolicyClient(self.row, Session(), self.recorder, self.batcher, self.params,
                            self.budget)

    def time_left(self) -> float | None:
        """Seconds until the episode passes its time limit (env.episode_timeout_s; None: none):
        an environment that waits on its own rollout waits no longer than this."""
        return self.batcher.time_left()

    def _turn(self, context: list[int], max_tokens: int | None) -> PolicyTurn:
        room = self.budget - len(self.session.ids)
        max_new = min(self.params.max_new_tokens, max_tokens or self.params.max_new_tokens, room)
        ids, logps, cut = self.batcher.ask(self.row, context, max_new)
        text = self.recorder.record(self.session, ids, logps, cut)
        tokens = [self.recorder.tokenizer.decode([t]) for t in ids]
        return PolicyTurn(text, context, ids, logps, "length" if cut else "stop", tokens)


@dataclass
class DrivenBatch:
    sessions: list[Session]
    results: list[Driven]
    counts: Counter = field(default_factory=Counter)
    errors: dict[str, str] = field(default_factory=dict)
    timed_out: list[bool] = field(default_factory=list)   # ended by a time limit: left out

    def record(self, r: int, out: Driven, count: str | None, error: str | None) -> None:
        """An episode's end, as its thread left it with the batcher (TurnBatcher.done)."""
        self.results[r] = out
        if count is not None:
            self.counts[count] += 1
        if error is not None:
            self.errors.setdefault("environment", error[-4000:])


def drive_batch(engine: RolloutEngine, tokenizer, env: Environment, problems: list[Problem],
                params: SamplingParams, settings, *, generator: torch.Generator | None = None,
                seeds: Tensor | None = None, units: list[dict[str, int]] | None = None) -> DrivenBatch:
    """Every row's episode (`problems`: one per row) driven by the environment in a daemon
    thread of its own; a failed episode gets reward 0 and is counted (env_errors), as a
    built-in's; one past a time limit is ended, counted (timeouts) and marked `timed_out`.
    `units`: episodes of several seats (Seated), each its seats' rows: one thread per episode,
    `drive_seats` with a client per seat."""
    B = len(problems)
    units = units or [{"": r} for r in range(B)]
    params = replace(params, max_episode_tokens=None)
    unit_of = [0] * B
    for u, rows in enumerate(units):
        for r in rows.values():
            unit_of[r] = u
    batcher = TurnBatcher(engine, params, B, generator=generator, seeds=seeds,
                          turn_timeout_s=getattr(settings, "turn_timeout_s", None),
                          episode_timeout_s=getattr(settings, "episode_timeout_s", None),
                          units=unit_of)
    recorder = Recorder(tokenizer, ReplyEncoder(tokenizer, settings.chat_template,
                                                settings.template_kwargs),
                        dict(settings.template_kwargs or {}))
    out = DrivenBatch([Session() for _ in range(B)], [Driven()] * B)
    clients = [PolicyClient(r, out.sessions[r], recorder, batcher, params, settings.max_tokens)
               for r in range(B)]
    for u, rows in enumerate(units):
        seated = {seat: clients[r] for seat, r in rows.items()}
        target, first = (drive_one, seated[""]) if "" in seated else (drive_seated, seated)
        threading.Thread(target=target, args=(env, first, problems[min(rows.values())]),
                         daemon=True, name=f"episode-{u}").start()
    try:
        batcher.watch()   # (every wait bounded: a hung episode is ended, never waited for)
    finally:   # (an episode a limit or a stop ended gives back what it holds)
        for r in range(B):
            if r not in batcher.outcomes:
                for hook in clients[r].end_hooks:
                    hook()
    if batcher.error is not None:   # the engine failed: the step fails, as a built-in's would
        raise batcher.error
    for r, (res, count, error) in sorted(batcher.outcomes.items()):
        out.record(r, res, count, error)
    for r, limit in sorted(batcher.timed_out.items()):
        out.sessions[r] = Session()   # (its thread may still write to the old one)
        out.counts.update(env_errors=1, timeouts=1)
        out.errors.setdefault("environment", f"episode {r} of the step timed out ({limit}): "
                              "ended, counted and left out of its group's baseline and the loss")
    out.timed_out = [r in batcher.timed_out for r in range(B)]
    return out


def drive_one(env: Environment, client: PolicyClient, problem: Problem) -> None:
    """One episode, in its thread: its end (the result, what to count, the error) left with
    the batcher, unless a time limit ended it first (the batch counts it then, and whatever the
    thread does later is ignored)."""
    r, batcher = client.row, client.batcher
    out, count, error, limit = Driven(), None, None, None
    try:
        out = env.drive(client, problem)
        if out.error is not None:   # (a failure the environment caught: a rubric's error)
            count, error = "env_errors", out.error
    except EpisodeTimeout as e:   # (the environment's own limit: counted as the batch's)
        limit = str(e)
    except EpisodeOver:   # (the harness let the budget's error through: the episode ends)
        count = "over_budget"
    except Exception:  # noqa: BLE001 - an episode's failure ends it, not the run
        if batcher.error is None:   # (else the engine's, raised for the step below)
            count, error = "env_errors", traceback.format_exc()
    finally:
        batcher.done(r, (out, count, error), limit)


def drive_seated(env: Environment, clients: dict[str, PolicyClient], problem: Problem) -> None:
    """One episode of several seats (Seated), in its thread: each seat's end left with the
    batcher for the seat's row, as `drive_one` leaves one."""
    batcher = next(iter(clients.values())).batcher
    ends, count, error, limit = {}, None, None, None
    try:
        ends = env.drive_seats(clients, problem)
    except EpisodeTimeout as e:
        limit = str(e)
    except EpisodeOver:
        count = "over_budget"
    except Exception:  # noqa: BLE001 - an episode's failure ends it, not the run
        if batcher.error is None:
            count, error = "env_errors", traceback.format_exc()
    finally:
        for seat, client in clients.items():
            out = ends.get(seat, Driven())
            seat_count, seat_error = (("env_errors", out.error) if out.error is not None
                                      else (count, error))
            batcher.done(client.row, (out, seat_count, seat_error), limit)
