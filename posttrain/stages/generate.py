"""`posttrain generate`: a model's answers (or an environment's ground-truth demonstrations) to
training problems, written as SFT rows with their token ids (docs/algorithms.md §8: a short SFT
of the student on teacher outputs precedes distillation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.envs.base import Demonstrates
from posttrain.models import load_policy, load_tokenizer, resolve_model_path
from posttrain.stages.common import write_jsonl


def generate(cfg, n: int, out: str | Path, samples: int = 1, only_correct: bool = True,
             model=None, tokenizer=None, demonstrate: bool = False) -> dict[str, Any]:
    """Teacher outputs for SFT (§8: a short SFT of the student on teacher outputs precedes
    distillation): `samples` episodes from each of the first `n` training problems of `cfg`'s
    task, greedy when samples == 1, written as JSONL rows {prompt, response, response_ids,
    answer, correct}. A multi-turn or tool task's rows hold the whole episode: `prompt` as chat
    messages, `response_ids` with the environment's messages in it and `policy_mask` (1 on the
    policy's tokens, which `sft` trains on). `demonstrate`: ground-truth episodes instead of the
    model's (envs: `demonstration`), e.g. calculator calls that teach a tool format before RL."""
    from posttrain.rewards.scorer import Scorer
    from posttrain.rollout import SamplingParams, close_engine, make_engine
    from posttrain.distributed import SINGLE
    from posttrain.data.source import Sampler, build_task
    from posttrain.envs import for_tokenizer, make_env
    from posttrain.rollout import vllm_options

    task = build_task(cfg.data)
    env = make_env(cfg.env, task)
    scorer = Scorer(cfg.reward, task.verifier)
    path = cfg.model.path
    if model is None:
        path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        tokenizer = load_tokenizer(path)
        model = None if demonstrate else load_policy(path, cfg.model.dtype)
    env = for_tokenizer(env, tokenizer)
    sampler = Sampler(task, cfg.seed)
    if demonstrate:
        rows = demonstration_rows(sampler.next(n), env, tokenizer, cfg)
        write_jsonl(out, rows)
        return {"written": len(rows), "generated": n, "out": str(out)}
    engine = make_engine(cfg.rollout.backend, model, tokenizer,
                         **vllm_options(cfg, path, model, SINGLE))
    r = cfg.rollout
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, greedy=samples == 1, stop=r.stop)
    try:
        rows = sample_rows(engine, tokenizer, env, sampler, scorer, n, samples, params, cfg,
                           only_correct)
    finally:
        close_engine(engine)
        scorer.close()
    write_jsonl(out, rows)
    return {"written": len(rows), "generated": n * samples, "out": str(out)}


def sample_rows(engine, tokenizer, env, sampler, scorer, n: int, samples: int, params, cfg,
                only_correct: bool) -> list[dict[str, Any]]:
    """`samples` scored episodes for each of `n` problems, as SFT rows (only the correct ones
    with `only_correct`)."""
    from posttrain.rollout import episode_settings
    from posttrain.rollout.episodes import run_episodes
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(cfg.seed)
    for start in range(0, n, cfg.eval_batch_size):
        problems = sampler.next(min(cfg.eval_batch_size, n - start))
        ep = run_episodes(engine, tokenizer, env, problems, samples, params, episode_settings(cfg), gen)
        per_response = [p for p in problems for _ in range(samples)]
        res = scorer(per_response, ep.completions)
        correct = ep.verdicts(res.correct_B).tolist()
        rows += [{**row, "correct": ok}
                 for row, ok in zip(episode_rows(ep, per_response, env, tokenizer, cfg), correct)
                 if ok or not only_correct]
    return rows


def episode_rows(ep, problems, env, tokenizer, cfg) -> list[dict[str, Any]]:
    """SFT rows of sampled episodes. The response as the teacher wrote it, its stop string
    included: a student warmed up on it ends its answers as the teacher does, which the
    distillation that follows compares token by token (stripped, the student learned to end with
    EOS where the teacher writes a blank line, docs/distillation.md, MOPD); and its token ids,
    which `sft` trains on (the text may re-tokenise differently)."""
    from posttrain.prompts import prompt_messages
    r = ep.rollout
    rows = []
    for i, p in enumerate(problems):
        m = r.response_mask_B_T[i].cpu() > 0
        ids = r.response_ids_B_T[i].cpu()[m].tolist()
        text = (ep.completions[i] if r.policy_mask_B_T is None   # (one turn: the answer's text)
                else tokenizer.decode(ids, skip_special_tokens=True))
        row = {"prompt": p.prompt, "response": text, "response_ids": ids, "answer": p.answer}
        if r.policy_mask_B_T is not None or p.messages:   # an episode: its messages and masks
            row["prompt"] = prompt_messages(p, env.system_prompt(cfg.data.system_prompt))
        if r.policy_mask_B_T is not None:
            row["policy_mask"] = [int(x) for x in r.policy_mask_B_T[i].cpu()[m].tolist()]
            row["transcript"] = ep.transcripts[i]
        rows.append(row)
    return rows


def demonstration_rows(problems, env, tokenizer, cfg) -> list[dict[str, Any]]:
    """Ground-truth episodes of `env` (its `demonstration(problem)`: the messages an expert
    writes and receives) as SFT rows with token ids and policy masks."""
    from posttrain.prompts import ReplyEncoder, prompt_messages
    if not isinstance(env, Demonstrates):
        raise ValueError(f"environment {env.name!r} has no demonstrations; generate episodes "
                         "from a model instead (drop --demonstrate)")
    enc = ReplyEncoder(tokenizer, cfg.data.chat_template, dict(cfg.data.chat_template_kwargs))
    rows = []
    for p in problems:
        ids, mask = [], []
        for k, message in enumerate(env.demonstration(p)):
            if message["role"] == "assistant":
                turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            else:
                turn = enc.encode(message, policy_wrote_eos=False)
            ids += turn
            mask += [int(message["role"] == "assistant")] * len(turn)
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
        rows.append({"prompt": prompt_messages(p, env.system_prompt(cfg.data.system_prompt)),
                     "response": tokenizer.decode(ids, skip_special_tokens=True),
                     "response_ids": ids, "policy_mask": mask, "answer": p.answer,
                     "transcript": tokenizer.decode(ids)})
    return rows
