"""`posttrain sft`: supervised fine-tuning (docs/algorithms.md §8, the warm-up before distillation)
on (prompt, response) rows and TRL's prompt-completion and language-modeling rows: the negative
log-likelihood of the response tokens (of the policy's own tokens, for an episode written by
`posttrain generate`; of the assistant's messages, for a conversation)."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from posttrain.config.commands import StageConfig
from posttrain.data import read_rows
from posttrain.data.formats import Demonstration, demonstration, read_each, row_label
from posttrain.model.distributed import global_sum
from posttrain.rollout.forward import pack, sequence_logprobs
from posttrain.losses.preference import sft_loss
from posttrain.run.lifecycle import finish_job
from posttrain.stages.common import (held_out_behaviour, length_buckets, save_final_model,
                                     share_of_batch, start_offline, synthetic_task, train_batches)
from posttrain.stages.rows import demo_prompt_ids, demo_response


def _teacher_ids(tokenizer, path: str, rows: list[dict], demos: list[Demonstration],
                 response_field: str) -> list[list[int] | None]:
    """Each row's `response_ids` (written by `posttrain generate`), checked against its text."""
    out: list[list[int] | None] = []
    for i, (row, demo) in enumerate(zip(rows, demos), start=1):
        ids = row.get("response_ids")
        if ids is not None:
            if (demo.completion is None or not isinstance(ids, list)
                    or not all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in ids)):
                raise ValueError(f"{path}: line {i}: field 'response_ids' must be a list of token "
                                 f"ids below the vocabulary size {len(tokenizer)}, beside a text "
                                 "response")
            if tokenizer.decode(ids, skip_special_tokens=True) != demo.completion:
                raise ValueError(f"{path}: line {i}: field 'response_ids' does not decode to field "
                                 f"{response_field!r}; regenerate the file or drop 'response_ids'")
        out.append(ids)
    return out


def _policy_masks(path, rows: list[dict], responses: list[list[int]]) -> list[list[int]] | None:
    """Each row's `policy_mask` (an episode written by `posttrain generate`: 1 on the tokens the
    policy wrote, 0 on the environment's), fitted to its response ids; None when no row has one."""
    if not any("policy_mask" in r for r in rows):
        return None
    out = []
    for i, (row, resp) in enumerate(zip(rows, responses), start=1):
        mask = row.get("policy_mask")
        ids = row.get("response_ids")
        if mask is None:
            out.append([1] * len(resp))
            continue
        if not (isinstance(ids, list) and isinstance(mask, list) and len(mask) == len(ids)
                and all(m in (0, 1) for m in mask)):
            raise ValueError(f"{path}: line {i}: field 'policy_mask' must be a list of 0/1, one per "
                             "entry of 'response_ids'")
        mask = mask[:len(resp)]
        out.append(mask + [1] * (len(resp) - len(mask)))   # the EOS response_ids appended
    return out


def synthetic_answers(task, n: int, seed: int) -> list[dict[str, Any]]:
    """SFT rows {prompt, response} on the task's training problems, answered from the ground
    truth as '12 + 34 = 46.'"""
    from posttrain.data.preferences import expression
    return [{"prompt": p.prompt, "response": f"{expression(p)} = {p.answer}."}
            for p in (task.train_problem(seed, i) for i in range(n))]


def sft_rows(cfg: StageConfig, task=None) -> tuple[list[dict], list[Demonstration]]:
    """The rows (a file's, or the synthetic task's answers) and their demonstrations, checked
    (file, line, field) before any model loads: TRL's prompt-completion (the completion in
    `data.response_field` or 'completion'), 'messages' and 'text' rows (data/formats.py)."""
    cfg.validate()
    d = cfg.data
    if task is not None:
        rows, path = synthetic_answers(task, d.n_pairs, cfg.seed), f"synthetic:{d.synthetic}"
    elif not d.train_path:
        raise ValueError("sft: give --data.train_path FILE or --data.synthetic TASK")
    else:
        rows, path = read_rows(d.train_path), d.train_path
    return rows, read_each(path, rows, partial(demonstration, prompt_field=d.prompt_field,
                                               response_field=d.response_field), row_label(path))


def _responses(st, cfg: StageConfig, demos: list[Demonstration]) -> tuple[list, list | None]:
    """(response ids, loss masks or None: all response tokens) of every example (stages/rows.py);
    an episode's `policy_mask` (posttrain generate) masks the environment's tokens."""
    path = cfg.data.train_path
    ids = _teacher_ids(st.tokenizer, path, st.rows, demos, cfg.data.response_field)
    out = [demo_response(st.tokenizer, cfg, demo, t) for demo, t in zip(demos, ids)]
    responses = [r for r, _ in out]
    episodes = _policy_masks(path, st.rows, responses)
    if episodes is None and all(m is None for _, m in out):
        return responses, None
    return responses, [m if m is not None else episodes[i] if episodes else [1] * len(r)
                       for i, (r, m) in enumerate(out)]


def sft(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True,
        resume: str | Path | None = None) -> dict[str, Any]:
    """Supervised fine-tuning on (prompt, response): negative log-likelihood of response tokens.
    With --data.synthetic TASK: on ground-truth answers, with the held-out greedy accuracy before and
    after (a quick way to make a domain teacher for distillation). `resume`: a run folder whose
    latest checkpoint the run continues from, to the same final weights."""
    task = synthetic_task(cfg) if cfg.data.synthetic else None
    rows, demos = sft_rows(cfg, task)
    st = start_offline("sft", cfg, model, tokenizer, rows, resume=resume, show_progress=show_progress,
                       prompts_of=lambda tok: [demo_prompt_ids(tok, cfg, d) for d in demos])
    responses, masks = _responses(st, cfg, demos)
    lengths = [len(p) + len(r) for p, r in zip(st.prompts, responses)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(len(batches))
    summary: dict[str, Any] = {"run_dir": str(st.run_dir), **st.saved.get("summary", {})}
    if task is not None and st.state is None:
        summary["behaviour_before"] = held_out_behaviour(st.model, st.tokenizer, task, cfg, st.world)
        st.logger.log(0, summary["behaviour_before"])
    losses: list[float] = st.saved.get("losses", [])

    def step_fn(step: int, batch: list[int]) -> None:
        t0 = time.perf_counter()
        mine, weight = share_of_batch(batch, st.world)
        r = pack(st.tokenizer, [st.prompts[i] for i in mine], [responses[i] for i in mine], st.device,
                 None if masks is None else [masks[i] for i in mine])
        logp = sequence_logprobs(st.model, r, torch.arange(len(mine)), 1.0, autocast=cfg.model.autocast).logp
        tokens = global_sum(weight * r.policy_tokens_B_T.sum(), st.world)   # an episode: the policy's
        loss = weight * sft_loss(logp, r.policy_tokens_B_T, tokens)
        lr = st.optimizer_step(loss * st.world.size)
        losses.append(global_sum(loss.detach(), st.world).item())
        width = r.prompt_ids_B_L.shape[1] + r.response_ids_B_T.shape[1]
        st.logger.log(step, {"loss/sft": losses[-1], "optim/lr": lr,
                             "perf/step_s": time.perf_counter() - t0,
                             "perf/padding_frac": 1 - sum(lengths[i] for i in mine) / (len(mine) * width)})

    if (stopped := train_batches(st, batches, step_fn, lambda: {"summary": summary, "losses": losses})):
        return stopped
    if task is not None:
        summary["behaviour_after"] = held_out_behaviour(st.model, st.tokenizer, task, cfg, st.world)
        st.logger.log(st.steps_done, summary["behaviour_after"])
    summary.update(steps=st.steps_done, first_loss=losses[0], last_loss=losses[-1],
                   final_model=save_final_model(st))
    finish_job(st, summary)
    return summary
