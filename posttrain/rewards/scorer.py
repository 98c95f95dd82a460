"""The reward of each response: verifiable checks, an optional format bonus, user functions and a
reward model, summed; the checks and functions run in the reward sandbox (rewards/pool.py)."""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.config.sections import RewardConfig
from posttrain.data.tasks import Problem
from posttrain.util.health import Tally
from posttrain.rewards.pool import Outcome, RewardPool
from posttrain.rewards.verifiers import VERIFIERS, is_bare_answer
from posttrain.sandbox.launch import decide
from posttrain.util.usercode import call_with_limits, load_function

log = logging.getLogger("posttrain")

__all__ = ["RewardResult", "Scorer"]


@dataclass
class RewardResult:
    rewards_B: Tensor                   # total reward per response, float32
    correct_B: Tensor                   # verifier verdict, bool
    failures: Counter = field(default_factory=Counter)   # 'timeout' / 'error' / 'nonfinite' / 'crash' counts
    model_scores_B: Tensor | None = None   # reward model scores (normalised), when one is used
    # each response's reward by source ("verifier", "format", a function's spec, "reward_model"),
    # summing to rewards_B (the per-token records show them)
    parts_B: list[dict[str, float]] = field(default_factory=list)
    # the LLM judge (rewards/judge.py): its scores in [0, 1] (nan: unscorable), which responses
    # every source could score (False: out of the baseline and the loss), and what it cost
    judge_scores_B: Tensor | None = None
    scored_B: Tensor | None = None
    judge_stats: dict[str, float] = field(default_factory=dict)
    # calls and failures per verifier, function and judge in this call (FailureWatch): the
    # result's own, so a batch scored in another thread (sampling ahead) never shares them and a
    # batch that is dropped takes its failures with it
    tallies: dict[str, Tally] = field(default_factory=dict)
    # responses no reward function scored (each asked returned None): out of the baseline and
    # the loss, as the judge's unscorable ones (scored_B False)
    unscored: int = 0


@dataclass(frozen=True)
class CallStyle:
    """How a reward function wants its arguments: one response (`prompt, completion, answer`) or
    TRL's batch signature (`prompts, completions, completion_ids, **columns`: lists over the
    whole batch, one call); and which of a row's other columns it takes (None: all, **kwargs)."""

    batched: bool
    accepts: frozenset[str] | None


# names only TRL's batch signature takes (a per-response function takes prompt, completion, answer)
TRL_NAMES = frozenset({"prompts", "completions", "completion_ids"})


def call_style(fn) -> CallStyle:
    """TRL's signature when the function names any of `prompts`, `completions`,
    `completion_ids`; else one response per call."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin or C function: the plain signature
        return CallStyle(False, frozenset({"prompt", "completion", "answer"}))
    batched = bool(TRL_NAMES & set(params))
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return CallStyle(batched, None)
    return CallStyle(batched, frozenset(params))


def reward_kwargs(style: CallStyle, problem: Problem, completion: str) -> dict[str, Any]:
    """A per-response reward function's arguments: the prompt (and a conversational row's
    messages), the completion, the answer, and every other column of the problem's row."""
    kwargs = {"prompt": problem.prompt, "completion": completion, "answer": problem.answer,
              **_columns(problem)}
    if problem.messages:
        kwargs["messages"] = list(problem.messages)
    return _accepted(style, kwargs)


def batch_kwargs(style: CallStyle, problems: list[Problem], completions: list[str],
                 completion_ids: list[list[int]] | None) -> dict[str, Any]:
    """TRL's arguments for one call over the whole batch, one entry per response: `prompts`
    (a conversational row's messages), `completions` (as assistant messages where the prompt is
    conversational, as TRL passes them), `completion_ids` (the tokens the policy sampled), the
    answer and every column (None where a row lacks it)."""
    rows = [{"prompts": list(p.messages) if p.messages else p.prompt,
             "completions": [{"role": "assistant", "content": c}] if p.messages else c,
             "answer": p.answer, **_columns(p)} for p, c in zip(problems, completions, strict=True)]
    kwargs = {k: [row.get(k) for row in rows] for k in dict.fromkeys(k for r in rows for k in r)}
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    return _accepted(style, kwargs)


def _columns(problem: Problem) -> dict[str, Any]:
    return {k: v for k, v in problem.meta.items() if k not in ("prompt", "completion", "answer")}


def _accepted(style: CallStyle, kwargs: dict[str, Any]) -> dict[str, Any]:
    return kwargs if style.accepts is None else {k: v for k, v in kwargs.items() if k in style.accepts}


# verifiers that only parse and compare the answer (posttrain/rewards/verifiers.py): `math`
# (math-verify: a LaTeX grammar, and sympy's parser only on text a pattern limited to digits and
# arithmetic signs), `countdown` (an `ast` walk of + - * / on integers), `exact` (string equality)
PARSE_ONLY_VERIFIERS = frozenset({"math", "countdown", "exact"})


def runs_model_text(cfg: RewardConfig, verifier: str | None) -> str | None:
    """What of the scorers may run the model's answers as code (the sandbox's fallback is then
    never picked on its own, launch.decide): the user's reward functions (any code), and every
    verifier not known to only parse and compare (reasoning-gym's scorers: nine hand the answer
    to `eval` or sympy's `parse_expr`, data/gym.py; and any verifier added later). None: no
    verifier, or one in PARSE_ONLY_VERIFIERS, and no reward functions."""
    if cfg.functions:
        return f"your reward functions {list(cfg.functions)} on the model's answers"
    if verifier is not None and verifier not in PARSE_ONLY_VERIFIERS:
        return (f"the verifier {verifier!r} (not one known to only parse and compare the answer: "
                f"{', '.join(sorted(PARSE_ONLY_VERIFIERS))}) on the model's answers")
    return None


class Scorer:
    """reward = correct_reward * verified + format_weight * well_formatted + sum(user functions)
              + model_weight * reward_model(prompt, completion)."""

    def __init__(self, cfg: RewardConfig, task_verifier: str = "math",
                 system_prompt: str | None = None, autocast: str = "none",
                 run_dir: str | Path | None = None, judge: bool = True) -> None:
        self.cfg = cfg
        name = task_verifier if cfg.verifier == "math" and task_verifier != "math" else cfg.verifier
        self.verifier = None if name == "none" else name
        self.per_problem = cfg.verifier == "math"   # a task mixture names each problem's verifier
        # Loaded now, so a wrong 'module:function' fails before any model is loaded.
        self.functions = [(spec, load_function(spec)) for spec in cfg.functions]
        self._by_spec = dict(self.functions)
        self.styles = {spec: call_style(fn) for spec, fn in self.functions}
        self.sandbox = None if not cfg.workers else decide(
            cfg.sandbox, "the reward scorers (verifiers and reward functions reading the model's "
            "answers)", "reward.sandbox", runs=runs_model_text(cfg, self.verifier))
        self.pool = (RewardPool(tuple(cfg.functions), cfg.workers, cfg.timeout_s, self.sandbox,
                                memory_mb=cfg.memory_mb, verifiers=(self.verifier,) if self.verifier else ())
                     if cfg.workers else None)
        if self.pool is None:
            log.warning("reward.workers 0: the verifier and reward functions run in the trainer's "
                        "process on answers the model wrote (no crash isolation; a timeout the "
                        "callee can cancel): for debugging only")
        self.system_prompt, self.autocast = system_prompt, autocast
        self._reward_model = None
        # (`judge` False: a command that never scores with it, eval and generate)
        self.judge = make_judge(cfg, run_dir) if cfg.judge and judge else None

    def start(self) -> None:
        """Start the reward sandbox now (it starts on the first batch otherwise): a function that
        cannot be imported inside it is an error before any model loads; so is a judge's endpoint
        that does not answer."""
        if self.pool is not None:
            self.pool.start()
        if self.judge is not None:
            self.judge.check()

    def close(self, final: bool = False) -> None:
        """Stop the reward sandbox (a later call starts it again); `final`: the judge too."""
        if self.pool is not None:
            self.pool.close()
        if final and self.judge is not None:
            self.judge.close()
            self.judge = None

    @property
    def reward_model(self):
        """The RLHF reward model, loaded on first use (evaluation never needs it)."""
        if self._reward_model is None and self.cfg.model:
            from posttrain.rewards.model import RewardModel
            self._reward_model = RewardModel(self.cfg.model, self.cfg.model_normalize,
                                             self.cfg.model_batch_size, self.autocast,
                                             system_prompt=self.system_prompt)
        return self._reward_model

    def __call__(self, problems: list[Problem], completions: list[str],
                 with_model: bool = True, group_size: int = 1,
                 completion_ids: list[list[int]] | None = None) -> RewardResult:
        """`with_model`: add the reward model's and the judge's scores (evaluation reads the
        verifier alone); `group_size`: consecutive responses to one prompt (the judge's groups);
        `completion_ids`: the tokens the policy sampled (TRL-signature functions read them)."""
        result = self.verify_and_functions(problems, completions, completion_ids)
        if with_model and self.judge is not None:
            self.add_judge(result, problems, completions, group_size)
        if with_model and self.cfg.model:
            scores = self.reward_model([p.prompt for p in problems], completions)
            result.model_scores_B = scores
            result.rewards_B = result.rewards_B + self.cfg.model_weight * scores
            for part, score in zip(result.parts_B, (self.cfg.model_weight * scores).tolist()):
                part["reward_model"] = score
        return result

    def add_judge(self, result: RewardResult, problems: list[Problem], completions: list[str],
                  group_size: int) -> None:
        """The judge's weighted score added to each response's reward; an unscorable response
        keeps the rest of its reward for the logs and is marked out of the baseline and loss."""
        verdicts = self.judge([p.prompt for p in problems], completions,
                              [p.answer for p in problems], group_size)
        tally = result.tallies.setdefault("reward judge", Tally())
        for error in verdicts.errors:
            tally.add(True, error)
        for _ in range(verdicts.calls + verdicts.cache_hits - len(verdicts.errors)):
            tally.add(False)
        scores = torch.tensor([float("nan") if s is None else s for s in verdicts.scores])
        scored = ~scores.isnan() if result.scored_B is None else ~scores.isnan() & result.scored_B
        weighted = self.cfg.judge_weight * scores.nan_to_num(0.0)
        result.rewards_B = result.rewards_B + weighted
        for part, w in zip(result.parts_B, weighted.tolist()):
            part["judge"] = w      # (0 where unscorable: the parts still sum to the reward)
        result.judge_scores_B, result.scored_B = scores, scored
        result.judge_stats = {"calls": verdicts.calls, "cache_hits": verdicts.cache_hits,
                              "unscorable": verdicts.unscorable}

    def verify_and_functions(self, problems: list[Problem], completions: list[str],
                             completion_ids: list[list[int]] | None = None) -> RewardResult:
        """The verifier's verdict and the user functions' rewards for each response; every call
        runs in the worker pool (reward.workers 0: in this process), where an answer that makes a
        scorer raise, exit or hang is a failed call, not the trainer's problem."""
        calls, owners = self._calls(problems, completions, completion_ids)
        if self.pool is not None:
            outcomes = self.pool.map(calls)
        else:
            outcomes = [self._in_process(kind, target, kw) for kind, target, kw in calls]
        book = _Book(len(completions), self.cfg)
        for call, rows, out in zip(calls, owners, outcomes):
            book.add(call, rows, out)
        if self.cfg.format_weight:
            for i, text in enumerate(completions):
                book.parts[i]["format"] = self.cfg.format_weight * is_bare_answer(text)
        return book.result()

    def _calls(self, problems: list[Problem], completions: list[str],
               completion_ids: list[list[int]] | None = None):
        """(kind, target, kwargs) of every call, and the responses each scores: one each, but a
        function with TRL's signature is one call over all of them."""
        calls, owners = [], []
        for i, (problem, text) in enumerate(zip(problems, completions, strict=True)):
            name = self.verifier
            if self.per_problem and "verifier" in problem.meta:
                name = problem.meta["verifier"]
            if name is not None:
                calls.append(("verify", name, {"completion": text, "problem": problem}))
                owners.append([i])
            for spec, _ in self.functions:
                if not self.styles[spec].batched:
                    calls.append(("function", spec, reward_kwargs(self.styles[spec], problem, text)))
                    owners.append([i])
        for spec, _ in self.functions:
            if self.styles[spec].batched and problems:
                calls.append(("batch", spec, batch_kwargs(self.styles[spec], problems, completions,
                                                          completion_ids)))
                owners.append(list(range(len(problems))))
        return calls, owners

    def _in_process(self, kind: str, target: str, kwargs: dict[str, Any]) -> Outcome:
        """reward.workers 0: the call in this process (a SIGALRM timeout the callee can cancel)."""
        fn = VERIFIERS[target] if kind == "verify" else self._by_spec[target]
        n = len(kwargs["completions"]) if kind == "batch" else None
        value, status, error = call_with_limits(fn, kwargs, self.cfg.timeout_s * (n or 1), n)
        if kind == "verify" and status == "ok":
            value = float(bool(value))
        return Outcome(value, status, error)


class _Book:
    """Each response's reward parts by source, verdict, failures and tallies, as the calls'
    outcomes come in; which responses no reward function scored (each asked returned None)."""

    def __init__(self, n: int, cfg: RewardConfig) -> None:
        self.cfg, self.parts = cfg, [{} for _ in range(n)]
        self.correct, self.scored, self.passed = [False] * n, [0] * n, [0] * n
        self.failures: Counter = Counter()
        self.tallies: dict[str, Tally] = {}

    def add(self, call: tuple, rows: list[int], out: Outcome) -> None:
        kind, target, _ = call
        source = f"verifier {target!r}" if kind == "verify" else f"reward function {target!r}"
        tally = self.tallies.setdefault(source, Tally())
        for i, (value, status) in zip(rows, per_response(kind, rows, out)):
            tally.add(status not in ("ok", "unscored"), out.error)
            if kind == "verify":
                if status != "ok":
                    self.failures[f"verifier_{status}"] += 1
                self.correct[i] = status == "ok" and value == 1.0
                self.parts[i]["verifier"] = self.cfg.correct_reward * self.correct[i]
            elif status == "unscored":   # (TRL: None, not this function's to score)
                self.passed[i] += 1
            else:
                if status != "ok":
                    self.failures[status] += 1
                self.scored[i] += 1
                value = value if status == "ok" else self.cfg.fallback
                self.parts[i][target] = self.parts[i].get(target, 0.0) + value

    def result(self) -> RewardResult:
        rewards = [0.0] * len(self.parts)
        for i, part in enumerate(self.parts):   # (summed in order, as the reward always was)
            for value in part.values():
                rewards[i] += value
        unscored = [p > 0 and s == 0 for p, s in zip(self.passed, self.scored)]
        return RewardResult(torch.tensor(rewards, dtype=torch.float32),
                            torch.tensor(self.correct, dtype=torch.bool), self.failures,
                            parts_B=self.parts, tallies=self.tallies, unscored=sum(unscored),
                            scored_B=~torch.tensor(unscored) if any(unscored) else None)


def per_response(kind: str, rows: list[int], out: Outcome) -> list[tuple[float | None, str]]:
    """(value, status) of each response a call scored: a batch call's list read entry by entry
    (a float, None: unscored, or a bad value's status); one of the wrong length is an error."""
    if kind != "batch":
        return [(out.value, out.status)]
    if out.status != "ok":
        return [(None, out.status)] * len(rows)
    if not isinstance(out.value, list) or len(out.value) != len(rows):
        return [(None, "error")] * len(rows)
    return [(v, "ok") if isinstance(v, float) else (None, "unscored") if v is None else (None, v)
            for v in out.value]


def make_judge(cfg: RewardConfig, run_dir: str | Path | None):
    """The judge `reward.judge` names, its cache in the run folder unless told otherwise."""
    from posttrain.rewards.judge import Judge, JudgeSettings
    if cfg.judge_cache == "none" or (cfg.judge_cache is None and run_dir in (None, "none")):
        cache = None
    else:
        cache = Path(cfg.judge_cache or Path(run_dir) / "judge_cache.sqlite").expanduser()
    return Judge(JudgeSettings(cfg.judge, cfg.judge_model, cfg.judge_template, cfg.judge_group,
                               cfg.judge_concurrency, cfg.judge_rate, cfg.judge_retries,
                               cfg.judge_timeout_s, cfg.judge_max_tokens, cache,
                               cfg.judge_api_key_env))
