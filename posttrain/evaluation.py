"""Held-out evaluation, the same for every command: greedy accuracy (split by each boolean field of
the problems' meta, e.g. 'carry', and by domain), or pass@k from sampled answers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from posttrain.config import TrainConfig
from posttrain.data.tasks import Problem
from posttrain.distributed import SINGLE, World, gather_objects
from posttrain.envs import Environment, SingleTurn
from posttrain.rewards.scorer import Scorer
from posttrain.rollout import RolloutEngine, SamplingParams, episode_settings
from posttrain.rollout.episodes import run_episodes


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(model, tokenizer, engine: RolloutEngine, problems: list[Problem], scorer: Scorer,
             cfg: TrainConfig, samples: int = 1, k: int = 1, temperature: float = 1.0,
             generator: torch.Generator | None = None, world: World = SINGLE,
             env: Environment | None = None) -> dict[str, Any]:
    """Greedy accuracy (samples=1), or pass@k from `samples` sampled answers per problem; each
    answer is an episode in `env` (a tool-using or multi-turn task is evaluated as it trains).

    Also splits accuracy by every boolean field of the problems' meta (e.g. 'carry' for addition).
    """
    env = env or SingleTurn()
    greedy = samples == 1
    params = SamplingParams(cfg.rollout.max_new_tokens, temperature if not greedy else 1.0,
                            1.0, greedy=greedy, stop=cfg.rollout.stop)
    correct, texts, counts = [], [], {}
    all_problems, problems = problems, problems[world.rank::world.size]   # each rank: a share
    for start in range(0, len(problems), cfg.eval_batch_size):
        chunk = problems[start:start + cfg.eval_batch_size]
        episodes = run_episodes(engine, tokenizer, env, chunk, samples, params,
                                episode_settings(cfg), generator)
        res = scorer([p for p in chunk for _ in range(samples)], episodes.completions, with_model=False)
        correct.append(episodes.verdicts(res.correct_B).reshape(len(chunk), samples))
        texts.extend(episodes.transcripts[::samples])
        for k, v in episodes.counts.items():
            counts[k] = counts.get(k, 0) + v
    c = torch.cat(correct) if correct else torch.zeros(0, samples, dtype=torch.bool)
    episodes_here = max(len(texts) * samples, 1)   # this rank's (its counts are its own)
    if world.distributed:   # put the shares back in order: problem i was evaluated by rank i % W
        parts = gather_objects((c, texts), world)
        c = torch.zeros(len(all_problems), samples, dtype=torch.bool)
        texts = [""] * len(all_problems)
        for r, (c_r, t_r) in enumerate(parts):
            c[r::world.size] = c_r
            texts[r::world.size] = t_r
        problems = all_problems
    out: dict[str, Any] = {"eval/accuracy": c.float().mean().item() if len(c) else float("nan")}
    if not greedy:
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(samples, int(row.sum()), k) for row in c]))
    domains = sorted({p.domain for p in problems})
    if len(domains) > 1:
        for d in domains:
            idx = [i for i, p in enumerate(problems) if p.domain == d]
            out[f"eval/accuracy@{d}"] = c[idx].float().mean().item()
    keys = {key for p in problems for key, v in p.meta.items() if isinstance(v, bool)}
    for key in sorted(keys):
        for flag in (True, False):
            idx = [i for i, p in enumerate(problems) if p.meta.get(key) is flag]
            if idx:
                out[f"eval/accuracy_{key}={str(flag).lower()}"] = c[idx].float().mean().item()
    if env.max_turns > 1:   # per held-out episode: turns, tool calls, malformed calls, ...
        out.update({f"eval/{k}": v / episodes_here for k, v in sorted(counts.items())})
    out["_samples"] = [{"prompt": p.prompt, "answer": p.answer, "completion": t, "correct": bool(ok)}
                       for p, t, ok in zip(problems, texts, c[:, 0].tolist())]
    return out
