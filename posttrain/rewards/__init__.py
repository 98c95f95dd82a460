"""Rewards: verifiable checks, an optional format bonus and user functions, summed per response."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.config import RewardConfig
from posttrain.data.tasks import Problem
from posttrain.rewards.safe import call_with_limits, load_function
from posttrain.rewards.verifiers import VERIFIERS, is_bare_answer, overlong_penalty

__all__ = ["RewardResult", "Scorer", "overlong_penalty"]


@dataclass
class RewardResult:
    rewards_B: Tensor                   # total reward per response, float32
    correct_B: Tensor                   # verifier verdict, bool
    failures: Counter = field(default_factory=Counter)   # 'timeout' / 'error' / 'nonfinite' counts


class Scorer:
    """reward = correct_reward * verified + format_weight * well_formatted + sum(user functions)."""

    def __init__(self, cfg: RewardConfig, task_verifier: str = "math") -> None:
        self.cfg = cfg
        name = task_verifier if cfg.verifier == "math" and task_verifier != "math" else cfg.verifier
        self.verify = None if name == "none" else VERIFIERS[name]
        self.per_problem = cfg.verifier == "math"   # a task mixture names each problem's verifier
        # Loaded now, so a wrong 'module:function' fails before any model is loaded.
        self.functions = [(spec, load_function(spec)) for spec in cfg.functions]

    def __call__(self, problems: list[Problem], completions: list[str]) -> RewardResult:
        rewards, correct, failures = [], [], Counter()
        for problem, text in zip(problems, completions, strict=True):
            verify = self.verify
            if self.per_problem and "verifier" in problem.meta:
                verify = VERIFIERS[problem.meta["verifier"]]
            ok = bool(verify(text, problem)) if verify else False
            r = self.cfg.correct_reward * ok
            if self.cfg.format_weight:
                r += self.cfg.format_weight * is_bare_answer(text)
            for spec, fn in self.functions:
                value, status = call_with_limits(
                    fn, {"prompt": problem.prompt, "completion": text, "answer": problem.answer},
                    self.cfg.timeout_s)
                if status != "ok":
                    failures[status] += 1
                    value = self.cfg.fallback
                r += value
            rewards.append(r)
            correct.append(ok)
        return RewardResult(torch.tensor(rewards, dtype=torch.float32),
                            torch.tensor(correct, dtype=torch.bool), failures)
