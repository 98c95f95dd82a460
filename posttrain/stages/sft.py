"""`posttrain sft`: supervised fine-tuning (docs/algorithms.md §8, the warm-up before distillation)
on (prompt, response) rows and TRL's prompt-completion and language-modeling rows: the negative
log-likelihood of the response tokens (of the policy's own tokens, for an episode written by
`posttrain generate`; of the assistant's messages, for a conversation)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from posttrain.config.commands import StageConfig
from posttrain.data import read_rows
from posttrain.data.formats import Demonstration, demonstration, read_each, row_label
from posttrain.model.distributed import global_sum
from posttrain.rollout.forward import pack, sequence_logprobs
from posttrain.losses.common import masked
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


def sft_rows(cfg: StageConfig, task=None, path: str | None = None) -> tuple[list[dict], list[Demonstration]]:
    """The rows (a file's: `path`, by default data.train_path; or the synthetic task's answers)
    and their demonstrations, checked (file, line, field) before any model loads: TRL's
    prompt-completion (the completion in `data.response_field` or 'completion'), 'messages' and
    'text' rows (data/formats.py)."""
    cfg.validate()
    d = cfg.data
    if task is not None and path is None:
        rows, path = synthetic_answers(task, d.n_pairs, cfg.seed), f"synthetic:{d.synthetic}"
    elif not (path or d.train_path):
        raise ValueError("sft: give --data.train_path FILE or --data.synthetic TASK")
    else:
        path = path or d.train_path
        rows = read_rows(path)
    return rows, read_each(path, rows, partial(demonstration, prompt_field=d.prompt_field,
                                               response_field=d.response_field), row_label(path))


@dataclass
class Examples:
    """SFT examples as token ids: each one's prompt, response (EOS-terminated) and loss mask
    (None: every response token is trained on)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    masks: list[list[int]] | None

    def packed(self, tokenizer, rows: list[int], device):
        return pack(tokenizer, [self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                    device, None if self.masks is None else [self.masks[i] for i in rows])


def encode_examples(tokenizer, cfg: StageConfig, path: str, rows: list[dict],
                    demos: list[Demonstration], prompts: list[list[int]] | None = None) -> Examples:
    """The rows' prompts as the policy is prompted (`prompts`: already encoded) and their
    responses (stages/rows.py); an episode's `policy_mask` (posttrain generate) masks the
    environment's tokens."""
    ids = _teacher_ids(tokenizer, path, rows, demos, cfg.data.response_field)
    out = [demo_response(tokenizer, cfg, demo, t) for demo, t in zip(demos, ids)]
    responses = [r for r, _ in out]
    prompts = prompts if prompts is not None else [demo_prompt_ids(tokenizer, cfg, d) for d in demos]
    episodes = _policy_masks(path, rows, responses)
    if episodes is None and all(m is None for _, m in out):
        return Examples(prompts, responses, None)
    return Examples(prompts, responses, [m if m is not None else episodes[i] if episodes else [1] * len(r)
                                         for i, (r, m) in enumerate(out)])


def held_out_rows(cfg: StageConfig) -> tuple[list[dict], list[Demonstration]] | None:
    """data.eval_path's rows, checked before any model loads; eval_every needs them."""
    if not cfg.data.eval_path:
        if cfg.eval_every:
            raise ValueError(f"sft: eval_every={cfg.eval_every} measures the NLL of held-out rows: "
                             "give --data.eval_path FILE, or drop eval_every")
        return None
    return sft_rows(cfg, path=cfg.data.eval_path)


@torch.no_grad()
def held_out_nll(st, examples: Examples) -> dict[str, float]:
    """eval/nll = -sum log pi(y_t | x, y_<t) / (number of loss tokens) over every held-out
    example (docs/algorithms.md §8: SFT's loss, token-weighted over the whole set), in batches
    of `batch_size` in file order; under torchrun each rank runs its share of each batch."""
    model, cfg, world = st.model, st.cfg, st.world
    training, t0 = model.training, time.perf_counter()
    model.eval()
    nll = tokens = 0.0
    n = len(examples.prompts)
    for start in range(0, n, cfg.batch_size):
        mine, weight = share_of_batch(list(range(start, min(start + cfg.batch_size, n))), world)
        r = examples.packed(st.tokenizer, mine, st.device)
        logp = sequence_logprobs(model, r, torch.arange(len(mine)), 1.0, autocast=cfg.model.autocast).logp
        mask = r.policy_tokens_B_T
        nll += global_sum(-weight * masked(logp.float(), mask).sum(), world).item()
        tokens += global_sum(weight * mask.sum().float(), world).item()
    model.train(training)
    return {"eval/nll": nll / tokens, "perf/eval_s": time.perf_counter() - t0}


@dataclass
class SftSteps:
    """One optimizer step on a batch of examples (the mean NLL of their loss tokens), and the
    held-out NLL every `eval_every` steps; `losses` and `summary` are kept in the checkpoint."""

    st: Any
    data: Examples
    evals: Examples | None
    losses: list[float]
    summary: dict[str, Any]

    def __call__(self, step: int, batch: list[int]) -> None:
        st, cfg, t0 = self.st, self.st.cfg, time.perf_counter()
        mine, weight = share_of_batch(batch, st.world)
        r = self.data.packed(st.tokenizer, mine, st.device)
        logp = sequence_logprobs(st.model, r, torch.arange(len(mine)), 1.0, autocast=cfg.model.autocast).logp
        tokens = global_sum(weight * r.policy_tokens_B_T.sum(), st.world)   # an episode: the policy's
        loss = weight * sft_loss(logp, r.policy_tokens_B_T, tokens)
        lr = st.optimizer_step(loss * st.world.size)
        self.losses.append(global_sum(loss.detach(), st.world).item())
        width = r.prompt_ids_B_L.shape[1] + r.response_ids_B_T.shape[1]
        rows = sum(len(self.data.prompts[i]) + len(self.data.responses[i]) for i in mine)
        metrics = {"loss/sft": self.losses[-1], "optim/lr": lr, "perf/step_s": time.perf_counter() - t0,
                   "perf/padding_frac": 1 - rows / (len(mine) * width)}
        if self.evals is not None and cfg.eval_every and step % cfg.eval_every == 0:
            metrics.update(held_out_nll(st, self.evals))
            self.summary["eval_nll_after"] = metrics["eval/nll"]
        st.logger.log(step, metrics)

    def measure(self, task, when: str, nll: bool = True) -> None:
        """The figures before or after training, in the summary and logged: the synthetic task's
        greedy behaviour, the held-out NLL (unless `nll` is False: the last step measured it)."""
        st, logged = self.st, {}
        if task is not None:
            self.summary[f"behaviour_{when}"] = held_out_behaviour(st.model, st.tokenizer, task,
                                                                   st.cfg, st.world)
            logged.update(self.summary[f"behaviour_{when}"])
        if self.evals is not None and nll:
            logged.update(held_out_nll(st, self.evals))
            self.summary[f"eval_nll_{when}"] = logged["eval/nll"]
        if logged:
            st.logger.log(st.steps_done, logged)


def sft(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True,
        resume: str | Path | None = None) -> dict[str, Any]:
    """Supervised fine-tuning on (prompt, response): negative log-likelihood of response tokens
    (the whole model, or LoRA adapters). With --data.eval_path: the held-out rows' NLL before,
    every eval_every steps and after. With --data.synthetic TASK: on ground-truth answers, with
    the held-out greedy accuracy before and after (a quick way to make a domain teacher for
    distillation). `resume`: a run folder whose latest checkpoint the run continues from, to the
    same final weights."""
    task = synthetic_task(cfg) if cfg.data.synthetic else None
    rows, demos = sft_rows(cfg, task)
    held_out = held_out_rows(cfg)
    st = start_offline("sft", cfg, model, tokenizer, rows, resume=resume, show_progress=show_progress,
                       prompts_of=lambda tok: [demo_prompt_ids(tok, cfg, d) for d in demos])
    data = encode_examples(st.tokenizer, cfg, cfg.data.train_path, rows, demos, st.prompts)
    evals = encode_examples(st.tokenizer, cfg, cfg.data.eval_path, *held_out) if held_out else None
    lengths = [len(p) + len(r) for p, r in zip(data.prompts, data.responses)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(len(batches))
    steps = SftSteps(st, data, evals, st.saved.get("losses", []),
                     {"run_dir": str(st.run_dir), **st.saved.get("summary", {})})
    if st.state is None:
        steps.measure(task, "before")
    if (stopped := train_batches(st, batches, steps, lambda: {"summary": steps.summary,
                                                               "losses": steps.losses})):
        return stopped
    measured_last = evals is not None and cfg.eval_every and st.steps_done % cfg.eval_every == 0
    if task is not None or (evals is not None and not measured_last):
        steps.measure(task, "after", nll=not measured_last)
    summary = steps.summary
    summary.update(steps=st.steps_done, first_loss=steps.losses[0], last_loss=steps.losses[-1],
                   final_model=save_final_model(st))
    finish_job(st, summary)
    return summary
