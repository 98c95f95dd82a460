"""Held-out evaluation, the same for every command: greedy accuracy (split by domain and by each
boolean field of the problems' meta, such as 'carry'), or pass@k from sampled answers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posttrain.config.commands import TrainConfig
from posttrain.data.tasks import Problem
from posttrain.model.distributed import SINGLE, World, gather_objects
from posttrain.envs import Environment
from posttrain.rollout import EpisodeSettings, SamplingParams, episode_settings
from posttrain.sampling.collect import sample_and_score
from posttrain.sampling.setup import SamplingSetup


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalSettings:
    """How held-out answers are sampled: the answer's token budget and stop strings, problems per
    generation batch, and how an episode is encoded (one turn for most tasks)."""
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    batch_size: int = 100
    episodes: EpisodeSettings = EpisodeSettings()


def eval_settings(cfg: TrainConfig) -> EvalSettings:
    """A run's evaluation samples as it trains: its token budget, stop strings and episodes."""
    return EvalSettings(cfg.rollout.max_new_tokens, tuple(cfg.rollout.stop), cfg.eval_batch_size,
                        episode_settings(cfg))


@dataclass
class Answers:
    """Held-out answers so far: verdicts (problems x samples), the first answer's text and
    length per problem, and the episodes' counts (turns, tool calls, ...)."""
    correct: list[Tensor] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)


def answer(setup: SamplingSetup, chunk: list[Problem], params: SamplingParams, into: Answers, *,
           samples: int = 1, episodes: EpisodeSettings = EpisodeSettings()) -> None:
    """`samples` episodes for each problem of `chunk` (the setup's generator draws, if sampled),
    scored by the verifier (no reward model, no judge), added to `into`."""
    scored = sample_and_score(setup, chunk, samples, params, episodes=episodes, judged=False)
    ep = scored.episodes
    into.correct.append(ep.verdicts(scored.result.correct_B).reshape(len(chunk), samples))
    into.texts.extend(ep.transcripts[::samples])
    into.lengths.extend(ep.rollout.lengths_B[::samples].tolist())
    for key, v in ep.counts.items():
        into.counts[key] = into.counts.get(key, 0) + v
    if setup.env.max_turns > 1:   # the environment's own reward (a verifiers rubric's, guess-number's)
        into.counts["env_reward"] = into.counts.get("env_reward", 0) + float(ep.env_rewards_B.sum())


@dataclass
class Gathered:
    """Every rank's answers in problem order: verdicts (problems x samples), first texts, lengths."""
    correct: Tensor
    texts: list[str]
    lengths: list[int]


def gathered(answers: Answers, problems: list[Problem], samples: int, world: World) -> Gathered:
    """Every rank's answers back in problem order (problem i was answered by rank i % W)."""
    c = torch.cat(answers.correct) if answers.correct else torch.zeros(0, samples, dtype=torch.bool)
    if not world.distributed:
        return Gathered(c, answers.texts, answers.lengths)
    parts = gather_objects((c, answers.texts, answers.lengths), world)
    c = torch.zeros(len(problems), samples, dtype=torch.bool)
    texts, lengths = [""] * len(problems), [0] * len(problems)
    for r, (c_r, t_r, n_r) in enumerate(parts):
        c[r::world.size], texts[r::world.size], lengths[r::world.size] = c_r, t_r, n_r
    return Gathered(c, texts, lengths)


def evaluate(setup: SamplingSetup, problems: list[Problem], settings: EvalSettings, *,
             samples: int = 1, k: int = 1, temperature: float = 1.0) -> dict[str, Any]:
    """Greedy accuracy (samples=1), or pass@k from `samples` sampled answers per problem (the
    setup's generator draws); each answer is an episode in the setup's environment (a
    tool-using or multi-turn task is evaluated as it trains). Under torchrun each rank answers
    every W-th problem. The one evaluator: `train` before, during and after training, the
    offline stages' synthetic tasks, `posttrain eval`."""
    params = sampling_params(settings, samples, temperature)
    answers = Answers()
    mine = problems[setup.world.rank::setup.world.size]
    for start in range(0, len(mine), settings.batch_size):
        answer(setup, mine[start:start + settings.batch_size], params, answers, samples=samples,
               episodes=settings.episodes)
    return answers_metrics(answers, problems, samples, k, setup.env, setup.world)


def answers_metrics(answers: Answers, problems: list[Problem], samples: int, k: int,
                    env: Environment, world: World = SINGLE) -> dict[str, Any]:
    """eval_metrics of the answers so far (every rank's, in problem order; the episodes' counts
    per episode are this rank's own)."""
    episodes_here = max(len(answers.texts) * samples, 1)
    counts = {key: v / episodes_here for key, v in answers.counts.items()}
    return eval_metrics(problems, gathered(answers, problems, samples, world), k, env, counts)


def sampling_params(settings: EvalSettings, samples: int, temperature: float) -> SamplingParams:
    """Greedy for one answer per problem, else sampled at `temperature`."""
    greedy = samples == 1
    return SamplingParams(settings.max_new_tokens, temperature if not greedy else 1.0, 1.0,
                          greedy=greedy, stop=settings.stop)


def eval_metrics(problems: list[Problem], answers: Gathered, k: int, env: Environment,
                 counts: dict[str, float]) -> dict[str, Any]:
    """eval/accuracy (and pass@k when sampled), split by domain and by every boolean field of the
    problems' meta (e.g. 'carry' for addition); multi-turn: the episodes' counts; the answers'
    mean length; `_samples`: each problem's first answer."""
    c, texts, lengths = answers.correct, answers.texts, answers.lengths
    out: dict[str, Any] = {"eval/accuracy": c.float().mean().item() if len(c) else float("nan")}
    if c.shape[1] > 1:
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(c.shape[1], int(row.sum()), k) for row in c]))
    problems = problems[:len(c)]
    domains = sorted({p.domain for p in problems})
    if len(domains) > 1:
        for d in domains:
            idx = [i for i, p in enumerate(problems) if p.domain == d]
            out[f"eval/accuracy@{d}"] = c[idx].float().mean().item()
    for key in sorted({key for p in problems for key, v in p.meta.items() if isinstance(v, bool)}):
        for flag in (True, False):
            idx = [i for i, p in enumerate(problems) if p.meta.get(key) is flag]
            if idx:
                out[f"eval/accuracy_{key}={str(flag).lower()}"] = c[idx].float().mean().item()
    if env.max_turns > 1:   # per held-out episode: turns, tool calls, malformed calls, ...
        out.update({f"eval/{key}": v for key, v in sorted(counts.items())})
    out["_lengths"] = lengths
    out["_samples"] = [{"prompt": p.prompt, "answer": p.answer, "completion": t, "correct": bool(ok)}
                       for p, t, ok in zip(problems, texts, c[:, 0].tolist())]
    return out
