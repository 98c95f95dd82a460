"""Episodes: the policy and an environment taking turns (envs/base.py), as one `Rollout`.

    prompt -> policy turn 1 -> environment message -> policy turn 2 -> ... -> the episode ends

An episode's response holds every token after the prompt, the environment's messages included
(they are context for the later turns); `Rollout.policy_mask_B_T` is 1 only on the tokens the
policy sampled, so losses, KL, teacher terms and aggregation count those alone. An engine that
declares it runs episodes (`runs_episodes`: the in-process engine, every turn through one KV
cache, rollout/hf.py `respond=`) takes them in one call; on another (vLLM) they go through the
turn loop (rollout/turns.py), one engine call a turn with the conversation so far (its prefix
cache keeps the earlier turns' keys and values), as do episodes that wait for an environment's
session (rollout/sessions.py). A single-turn task is the one-turn case: one `generate` call,
exactly as before episodes existed.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from posttrain.data.tasks import Problem
from posttrain.envs.base import (DescribesTools, DrivesPolicy, Environment, EnvironmentFull,
                                 EpisodeTimeout, HoldsSessions, OpensEpisodes, Reply, StartsBatch)
from posttrain.util.health import Tally
from posttrain.util.usercode import as_reward
from posttrain.model.prompts import ReplyEncoder, encode_prompts, left_pad
from posttrain.rollout.base import Rollout, RolloutEngine, SamplingParams, runs_episodes
from posttrain.rollout.sessions import BookTurns, EpisodeRows, opened, refuse_untaskable_groups
from posttrain.rollout.turns import take_turns


@dataclass(frozen=True)
class EpisodeSettings:
    system_prompt: str | None = None
    chat_template: bool = True
    template_kwargs: dict[str, Any] | None = None
    max_tokens: int = 256               # the whole episode (policy and environment tokens)
    max_reply_tokens: int = 64          # one environment message
    turn_timeout_s: float | None = 300.0       # the environment's time per turn (None: no limit)
    episode_timeout_s: float | None = 1800.0   # a driven episode's wall time (None: no limit)


@dataclass
class Episodes:
    rollout: Rollout
    completions: list[str]              # each episode's last policy turn (what the verifier reads)
    transcripts: list[str]              # the whole episode as text (logs)
    env_rewards_B: Tensor               # the environment's rewards, summed over the episode
    env_correct: list[bool | None]      # the environment's verdict (None: the verifier decides)
    counts: Counter                     # turns, tool_calls, malformed_calls, ... over the batch
    errors: dict[str, str] = field(default_factory=dict)   # 'environment' / 'tools': the first failure
    parts: list[dict[str, float]] | None = None   # a driving environment's reward by source, per episode
    timed_out: list[bool] | None = None  # ended by a time limit (EpisodeTimeout): left out
    left_out: list[bool] | None = None   # a seat's row that does not train (Driven.left_out)

    def scored(self, judged_B: Tensor | None, device) -> Tensor | None:
        """(B,) bool: the responses that count (None: all): the judge could score them, their
        episode ended within its time limits and their seat trains; the rest leave their group's
        baseline and the loss."""
        out = [a or b for a, b in zip(self.timed_out or [False] * len(self.completions),
                                      self.left_out or [False] * len(self.completions))]
        if not any(out):
            return None if judged_B is None else judged_B.to(device)
        ok = ~torch.tensor(out, dtype=torch.bool, device=device)
        return ok if judged_B is None else ok & judged_B.to(device)

    def tallies(self) -> dict[str, Tally]:
        """Calls and failures of the environment and its tools in this batch (FailureWatch)."""
        c, out = self.counts, {}
        calls = c.get("turns", 0) + c.get("timeouts", 0)   # (a turn that timed out never ended)
        if calls:
            out["environment"] = Tally(calls, c.get("env_errors", 0), self.errors.get("environment"))
        if c.get("tool_calls"):   # (a tool refusing the model's arguments is not broken)
            out["tools"] = Tally(c["tool_calls"], c.get("tools_broken", 0), self.errors.get("tools"))
        return out

    def verdicts(self, verified_B: Tensor) -> Tensor:
        """(B,) bool: the environment's verdict where it gave one, else the verifier's."""
        return torch.tensor([v if v is not None else bool(c)
                             for v, c in zip(self.env_correct, verified_B.tolist())], dtype=torch.bool)

    def metrics(self) -> dict[str, float]:
        """Per-episode means of the counts (env/turns, env/tool_calls, ...)."""
        n = max(len(self.completions), 1)
        return {f"env/{k}": v / n for k, v in sorted(self.counts.items())}


def run_episodes(engine: RolloutEngine, tokenizer, env: Environment, problems: list[Problem],
                 group_size: int, params: SamplingParams, *,
                 settings: EpisodeSettings = EpisodeSettings(),
                 generator: torch.Generator | None = None, seeds: Tensor | None = None) -> Episodes:
    """`group_size` episodes from each problem; `seeds` as for `RolloutEngine.generate`. Every
    episode is reset before its first turn, so that what reset showed opens its prompt
    (OpensEpisodes); episodes that do not all fit in the environment's sessions (HoldsSessions)
    queue for one (rollout/sessions.py). Each episode's session is given back once the batch ends."""
    G = group_size
    if isinstance(env, DrivesPolicy):
        return driven_episodes(engine, tokenizer, env, problems, G, params, settings=settings,
                               generator=generator, seeds=seeds)
    book = _Book(env, problems, G, tokenizer, settings)
    try:
        return _episodes(engine, book, params, generator=generator, seeds=seeds)
    finally:
        book.end_all()


def _episodes(engine: RolloutEngine, book: _Book, params: SamplingParams, *,
              generator: torch.Generator | None = None, seeds: Tensor | None = None) -> Episodes:
    env, G, tokenizer, settings = book.env, book.G, book.tokenizer, book.settings
    if env.max_turns > 1:
        params = replace(params, stop=tuple(dict.fromkeys(params.stop + env.stop)),
                         max_episode_tokens=settings.max_tokens)
    encode = lambda problems: encode_prompts(   # noqa: E731 - the prompts of (opened) problems
        tokenizer, problems, env.system_prompt(settings.system_prompt), settings.chat_template,
        settings.template_kwargs, env.tool_schemas if isinstance(env, DescribesTools) else None)
    if book.start_all() and (env.max_turns == 1 or runs_episodes(engine)):   # one engine call
        prompts = encode([book.problem(i) for i in range(len(book.rows) // G)])
        if env.max_turns > 1:
            rollout = engine.generate(prompts, G, params, generator, seeds=seeds,
                                      respond=book.respond)
            return book.episodes(rollout, book.last_text, _transcripts(tokenizer, rollout))
        rollout = engine.generate(prompts, G, params, generator, seeds=seeds)
        texts = _decode(tokenizer, rollout)
        for r, text in enumerate(texts):
            book.turn_ended(r, text)
        return book.episodes(rollout, texts, texts)
    # turn by turn (rollout/turns.py), and episodes that wait for a session (sessions.py)
    turns = BookTurns(book, encode, params.max_episode_tokens or params.max_new_tokens)
    take_turns(engine, turns, len(book.rows), replace(params, max_episode_tokens=None),
               generator=generator, seeds=seeds)
    rollout = padded_rollout(turns.rows(), G, tokenizer.pad_token_id, _device(engine))
    texts = book.last_text if env.max_turns == 1 else _transcripts(tokenizer, rollout)
    return book.episodes(rollout, book.last_text, texts)


def _transcripts(tokenizer, rollout: Rollout) -> list[str]:
    lengths = rollout.lengths_B.long().tolist()
    return [tokenizer.decode(row[:n]) for row, n in zip(rollout.response_ids_B_T.tolist(), lengths)]


def env_reward(value: Any) -> tuple[float, str | None]:
    """An environment's reward checked as a reward function's is (util/usercode.as_reward): a
    finite number, else 0 and why (counted as an environment error: FailureWatch stops a run
    whose environment keeps failing). NaN or Inf would reach every advantage of its group."""
    reward, status = as_reward(value)
    if status == "ok":
        return reward, None
    what = "not a finite number" if status == "nonfinite" else "not a number"
    return 0.0, f"the environment's reward {str(value)[:80]!r} is {what}: counted as 0"


def _masked_ids(tokenizer, rollout: Rollout) -> Tensor:
    m = rollout.response_mask_B_T.long()
    return rollout.response_ids_B_T * m + (1 - m) * tokenizer.pad_token_id


def _decode(tokenizer, rollout: Rollout) -> list[str]:
    return tokenizer.batch_decode(_masked_ids(tokenizer, rollout), skip_special_tokens=True)


class _Book:
    """Each episode's environment state, turn count, rewards and last turn's text; `respond` is
    what the engine calls when a policy turn ends."""

    def __init__(self, env: Environment, problems: list[Problem], G: int, tokenizer,
                 settings: EpisodeSettings) -> None:
        refuse_untaskable_groups(env, G)
        self.env, self.G, self.tokenizer, self.settings = env, G, tokenizer, settings
        if isinstance(env, StartsBatch):
            env.start_batch()
        self.rows = [p for p in problems for _ in range(G)]
        n = len(self.rows)
        self.counts: Counter = Counter()
        self.errors: dict[str, str] = {}
        self.timed_out = [False] * n
        self.states: list[Any] = [None] * n
        self.started, self.ended = [False] * n, [False] * n
        self.openings: dict[int, str] = {}   # problem index -> what its episodes' reset showed
        self.turns = [0] * n
        self.last_text = [""] * n
        self.rewards = [0.0] * n
        self.correct: list[bool | None] = [None] * n
        self.encoder = ReplyEncoder(tokenizer, settings.chat_template, settings.template_kwargs)
        self.eos_id = tokenizer.eos_token_id

    def start(self, r: int) -> bool:
        """Reset episode r; False when the environment has no room for it yet (EnvironmentFull)."""
        try:
            self.states[r] = self.env.reset(self.rows[r])
        except EnvironmentFull:
            return False
        except EpisodeTimeout as e:
            self.time_out(r, e)
        self.started[r] = True
        if not self.timed_out[r] and isinstance(self.env, OpensEpisodes):
            self.opens(r, self.env.opening(self.states[r]) or "")
        return True

    def start_all(self) -> bool:
        """Start every episode, in order, while the environment has room (HoldsSessions);
        False when some must wait for a session."""
        for r in range(len(self.rows)):
            limit = self.env.max_episodes if isinstance(self.env, HoldsSessions) else None
            if (limit is not None and r >= limit) or not self.start(r):
                return False
        return True

    def opens(self, r: int, text: str) -> None:
        """Record what episode r's reset showed: the same for every episode of its problem."""
        i = r // self.G
        seen = self.openings.setdefault(i, text)
        if text != seen:
            raise ValueError(
                f"the episodes of problem {i} of the batch opened differently ({seen[:60]!r} vs "
                f"{text[:60]!r}): a group's episodes must face the same task; hand reset the "
                "problem's task (its seed or a row's fields: docs/environments.md), or sample one "
                "episode per problem (rollout.group_size 1)")

    def problem(self, i: int) -> Problem:
        """Problem i as its episodes open (`opened`): the prompt they all see."""
        return opened(self.rows[i * self.G], self.openings.get(i))

    def end(self, r: int) -> None:
        """Episode r is over: its session goes back to the environment (HoldsSessions)."""
        if self.started[r] and not self.ended[r]:
            self.ended[r] = True
            if isinstance(self.env, HoldsSessions) and self.states[r] is not None:
                self.env.end(self.states[r])

    def end_all(self) -> None:
        for r in range(len(self.rows)):
            self.end(r)

    def time_out(self, r: int, e: EpisodeTimeout) -> None:
        """The episode passed a time limit: ended, counted, left out of the baseline and loss."""
        self.counts.update(env_errors=1, timeouts=1)
        self.errors.setdefault("environment", f"episode {r} of the step timed out: {e}")
        self.timed_out[r] = True

    def turn_ended(self, r: int, text: str) -> Reply | None:
        """Tell the environment; return its reply when the episode goes on."""
        self.turns[r] += 1
        self.last_text[r] = text
        self.counts["turns"] += 1
        if self.timed_out[r]:   # (its reset timed out: the episode is over)
            return None
        try:
            reply = self.env.step(self.states[r], text, self.turns[r])
        except EpisodeTimeout as e:
            self.time_out(r, e)
            return None
        except Exception:  # noqa: BLE001 - an environment's bug ends its episode, not the run
            self.counts["env_errors"] += 1
            self.errors.setdefault("environment", traceback.format_exc()[-4000:])
            return None
        if reply.counts.get("tools_broken") and reply.message is not None:
            self.errors.setdefault("tools", str(reply.message.get("content", ""))[:4000])
        reward, error = env_reward(reply.reward)
        if error is not None:
            self.counts["env_errors"] += 1
            self.errors.setdefault("environment", error)
        self.rewards[r] += reward
        if reply.correct is not None:
            self.correct[r] = bool(reply.correct)
        self.counts.update(reply.counts)
        if reply.message is None or self.turns[r] >= self.env.max_turns:
            return None
        return reply

    def respond(self, r: int, ids: list[int], reason: str) -> list[int] | None:
        reply = self.turn_ended(r, self.tokenizer.decode(ids, skip_special_tokens=True))
        if reply is None:
            return None
        message = dict(reply.message)
        message["content"] = self.encoder.cut(str(message.get("content", "")),
                                              self.settings.max_reply_tokens)
        return self.encoder.encode(message, policy_wrote_eos=bool(ids) and ids[-1] == self.eos_id)

    def episodes(self, rollout: Rollout, completions: list[str], transcripts: list[str]) -> Episodes:
        return Episodes(rollout, list(completions), list(transcripts),
                        torch.tensor(self.rewards, dtype=torch.float32), list(self.correct),
                        self.counts, dict(self.errors), timed_out=list(self.timed_out))


def driven_episodes(engine: RolloutEngine, tokenizer, env: Environment, problems: list[Problem],
                    G: int, params: SamplingParams, *, settings: EpisodeSettings = EpisodeSettings(),
                    generator: torch.Generator | None = None, seeds: Tensor | None = None) -> Episodes:
    """Episodes the environment drove (rollout/driven.py), as one Rollout: each group's rows
    must have started from the same prompt (they answer the same problem)."""
    from posttrain.rollout.driven import drive_batch
    if isinstance(env, StartsBatch):
        env.start_batch()
    rows = [p for p in problems for _ in range(G)]
    out = drive_batch(engine, tokenizer, env, rows, params, settings, generator=generator,
                      seeds=seeds)
    s = out.sessions
    for r, sess in enumerate(s):
        if sess.prompt is None:   # (an episode that never asked the policy: an empty answer)
            asked = [x.prompt for x in s[r - r % G:r - r % G + G] if x.prompt is not None]
            sess.prompt = asked[0] if asked else [tokenizer.eos_token_id]
    for r, sess in enumerate(s):
        if sess.prompt != s[r - r % G].prompt:
            raise ValueError(f"the driven episodes of problem {r // G} started from different "
                             "prompts; a group's episodes must answer the same prompt")
    for sess in s:
        if not sess.ids:   # (a row needs one token: the episode's end)
            sess.append([tokenizer.eos_token_id], None)
    episode_rows = EpisodeRows.of_sessions([s[i * G].prompt for i in range(len(problems))], s)
    rollout = padded_rollout(episode_rows, G, tokenizer.pad_token_id, _device(engine))
    rewards, counts, errors = driven_rewards(out)
    return Episodes(rollout, [x.last_text for x in s],
                    [tokenizer.decode(x.ids) for x in s], rewards,
                    [x.correct for x in out.results], counts, errors,
                    parts=[dict(x.parts) for x in out.results], timed_out=out.timed_out)


def driven_rewards(out) -> tuple[Tensor, Counter, dict[str, str]]:
    """Each driven row's reward (checked: a finite number, else 0 and an environment error), the
    batch's counts (turns, forks, the environment's own) and first errors (`out`: a DrivenBatch)."""
    counts, errors = Counter(out.counts), dict(out.errors)
    counts.update({"turns": sum(x.turns for x in out.sessions),
                   "forks": sum(x.forks for x in out.sessions)})
    rewards = []
    for res in out.results:
        counts.update(res.counts)
        reward, error = env_reward(res.reward)
        rewards.append(reward)
        if error is not None:
            counts["env_errors"] += 1
            errors.setdefault("environment", error)
    return torch.tensor(rewards, dtype=torch.float32), counts, errors


def _device(engine) -> torch.device:
    model = getattr(engine, "model", None)
    return next(model.parameters()).device if model is not None else torch.device("cpu")


def padded_rollout(rows: EpisodeRows, G: int, pad_id: int, device: torch.device) -> Rollout:
    """Episodes held as per-row lists, as one right-padded Rollout after their left-padded prompts."""
    B, T = len(rows.ids), max(len(x) for x in rows.ids)
    p_ids, p_mask = left_pad(rows.prompts, pad_id)
    resp = torch.full((B, T), pad_id, dtype=torch.long)
    mask, lp, pol = (torch.zeros(B, T) for _ in range(3))
    for r in range(B):
        n = len(rows.ids[r])
        resp[r, :n] = torch.tensor(rows.ids[r], dtype=torch.long)
        mask[r, :n] = 1.0
        lp[r, :n] = torch.tensor(rows.logps[r])
        pol[r, :n] = torch.tensor(rows.policy[r])
    return Rollout(p_ids.repeat_interleave(G, 0).to(device), p_mask.repeat_interleave(G, 0).to(device),
                   resp.to(device), mask.to(device), lp.to(device),
                   torch.tensor(rows.truncated, device=device), G, pol.to(device))
