"""`posttrain generate`: a model's answers (or an environment's ground-truth demonstrations) to
training problems, written as SFT rows with their token ids (docs/algorithms.md §8: a short SFT
of the student on teacher outputs precedes distillation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.envs.base import Demonstrates
from posttrain.run.lifecycle import Job, Steps, finish_job, open_folder, start_job
from posttrain.rollout import SamplingParams
from posttrain.sampling.collect import sample_and_score
from posttrain.sampling.service import Sampling, open_sampling
from posttrain.sampling.setup import SamplingSetup
from posttrain.stages.common import write_jsonl


def generate(cfg, n: int, out: str | Path | None = None, *, samples: int = 1,
             only_correct: bool = True, model=None, tokenizer=None, demonstrate: bool = False,
             show_progress: bool = True) -> dict[str, Any]:
    """Teacher outputs for SFT (§8: a short SFT of the student on teacher outputs precedes
    distillation): `samples` episodes from each of the first `n` training problems of `cfg`'s
    task, greedy when samples == 1, written as JSONL rows {prompt, response, response_ids,
    answer, correct} to `out` (default: sft.jsonl in the run folder). A multi-turn or tool task's
    rows hold the whole episode: `prompt` as chat messages, `response_ids` with the environment's
    messages in it and `policy_mask` (1 on the policy's tokens, which `sft` trains on).
    `demonstrate`: ground-truth episodes instead of the model's (envs: `demonstration`), e.g.
    calculator calls that teach a tool format before RL. On the common lifecycle: threads, seed,
    the run folder, batches of problems under `max_minutes` and stop signals (the rows so far
    are written)."""
    if out is None and not cfg.writes_folder:
        raise ValueError("generate: no --out and --run_dir none: the rows need a file")
    job = start_job("generate", cfg, None, show_progress)
    with open_sampling(job, model, tokenizer, sample=not demonstrate) as sampling:
        open_folder(job, cfg.to_dict())
        rows, signal_name = generate_rows(job, sampling, n, samples=samples,
                                          only_correct=only_correct, demonstrate=demonstrate)
    out = Path(out) if out is not None else job.run_dir / "sft.jsonl"
    write_jsonl(out, rows)
    summary = {"written": len(rows), "generated": min(n, job.steps_done * cfg.eval_batch_size) * (
        1 if demonstrate else samples), "out": str(out),
        "run_dir": str(job.run_dir) if job.run_dir else None}
    if signal_name is not None:
        summary["stopped_by"] = signal_name
    return finish_job(job, summary)


def generate_rows(job: Job, sampling: Sampling, n: int, *, samples: int = 1,
                  only_correct: bool = True, demonstrate: bool = False
                  ) -> tuple[list[dict[str, Any]], str | None]:
    """The first `n` training problems in batches of `eval_batch_size` (the common frame: its
    time budget, progress bar and stop signals). Returns (the rows, the signal that stopped it or
    None)."""
    cfg, rows = job.cfg, []
    r, size = cfg.rollout, cfg.eval_batch_size
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, greedy=samples == 1, stop=r.stop)
    with Steps(job, -(-n // size), "generate") as steps:
        for step in steps:
            with steps.timed(step):
                problems = sampling.prompts.next(min(size, n - (step - 1) * size))
                rows.extend(demonstration_rows(problems, sampling.env, sampling.tokenizer, cfg)
                            if demonstrate else sample_rows(sampling, problems, params,
                                                            samples=samples,
                                                            only_correct=only_correct))
    return rows, steps.stop_signal


def sample_rows(sampling: SamplingSetup, problems: list[Problem], params: SamplingParams, *,
                samples: int = 1, only_correct: bool = True) -> list[dict[str, Any]]:
    """`samples` scored episodes for each problem (sampled with `params`, drawn from the
    setup's generator), as SFT rows (only the correct ones with `only_correct`)."""
    scored = sample_and_score(sampling, problems, samples, params, judged=False)
    ep = scored.episodes
    correct = ep.verdicts(scored.result.correct_B).tolist()
    return [{**row, "correct": ok}
            for row, ok in zip(episode_rows(ep, scored.problems, sampling.env, sampling.tokenizer,
                                            sampling.cfg), correct)
            if ok or not only_correct]


def episode_rows(ep, problems, env, tokenizer, cfg) -> list[dict[str, Any]]:
    """SFT rows of sampled episodes. The response as the teacher wrote it, its stop string
    included: a student warmed up on it ends its answers as the teacher does, which the
    distillation that follows compares token by token (stripped, the student learned to end with
    EOS where the teacher writes a blank line, docs/distillation.md, MOPD); and its token ids,
    which `sft` trains on (the text may re-tokenise differently)."""
    from posttrain.model.prompts import prompt_messages
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
    from posttrain.model.prompts import ReplyEncoder, prompt_messages
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
