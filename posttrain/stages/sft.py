"""`posttrain sft`: supervised fine-tuning on (prompt, response) rows (docs/algorithms.md §8, the
warm-up before distillation): the negative log-likelihood of the response tokens (of the
policy's own tokens, for an episode written by `posttrain generate`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config.commands import StageConfig
from posttrain.model.distributed import global_sum
from posttrain.rollout.forward import pack, sequence_logprobs
from posttrain.losses.preference import sft_loss
from posttrain.run.lifecycle import finish_job
from posttrain.stages.common import (held_out_behaviour, length_buckets, response_ids,
                                     save_final_model, share_of_batch, start_offline,
                                     synthetic_task, train_batches)


def _teacher_ids(tokenizer, path: str, rows: list[dict], response_field: str) -> list[list[int] | None]:
    """Each row's `response_ids` (written by `posttrain generate`), checked against its text."""
    out: list[list[int] | None] = []
    for i, row in enumerate(rows, start=1):
        ids = row.get("response_ids")
        if ids is not None:
            if (not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < len(tokenizer)
                                                     for t in ids)):
                raise ValueError(f"{path}: line {i}: field 'response_ids' must be a list of token "
                                 f"ids below the vocabulary size {len(tokenizer)}")
            if tokenizer.decode(ids, skip_special_tokens=True) != row[response_field]:
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


def sft(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True,
        resume: str | Path | None = None) -> dict[str, Any]:
    """Supervised fine-tuning on (prompt, response): negative log-likelihood of response tokens.
    With --data.synthetic TASK: on ground-truth answers, with the held-out greedy accuracy before and
    after (a quick way to make a domain teacher for distillation). `resume`: a run folder whose
    latest checkpoint the run continues from, to the same final weights."""
    task = synthetic_task(cfg) if cfg.data.synthetic else None
    rows = synthetic_answers(task, cfg.data.n_pairs, cfg.seed) if task is not None else None
    st = start_offline("sft", cfg, model, tokenizer, [cfg.data.prompt_field, cfg.data.response_field],
                       rows=rows, resume=resume, show_progress=show_progress)
    ids = _teacher_ids(st.tokenizer, cfg.data.train_path, st.rows, cfg.data.response_field)
    responses = [response_ids(st.tokenizer, r[cfg.data.response_field], cfg.max_len, t)
                 for r, t in zip(st.rows, ids)]
    masks = _policy_masks(cfg.data.train_path, st.rows, responses)
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
