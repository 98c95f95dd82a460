"""`posttrain dpo`: DPO (docs/algorithms.md §9, the closed-form counterpart of the KL-regularised
objective) on (prompt, chosen, rejected) pairs, and the same training read as a Bradley-Terry
reward model r = beta log pi/pi_ref (`posttrain reward-model --reward_form log_ratio`, §1)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.config.commands import StageConfig
from posttrain.data import read_rows
from posttrain.data.formats import preference_pair, read_each, row_label
from posttrain.model.distributed import global_sum
from posttrain.rollout.forward import pack, sequence_logprobs
from posttrain.losses.common import sequence_logprob
from posttrain.losses.preference import dpo_loss
from posttrain.run.lifecycle import finish_job
from posttrain.stages.common import (OfflineJob, encode_prompts_of, held_out_behaviour,
                                     length_buckets, save_final_model, share_of_batch, sharded_rows,
                                     start_offline, synthetic_task, train_batches)
from posttrain.stages.rows import completion_ids


def preference_rows(cfg: StageConfig) -> tuple[list[dict], list[dict], str]:
    """(train pairs, held-out pairs, source) from --data.synthetic TASK or --data.train_path
    [--data.eval_path]: TRL's preference rows, explicit or implicit prompt, standard or
    conversational, checked (file, line, field) before any model loads; each row comes back with
    its prompt, chosen and rejected fields holding the pair's parts (data/formats.py)."""
    cfg.validate()
    if cfg.data.synthetic:   # pairs from ground truth: train on training problems, test on held-out
        from posttrain.data.preferences import synthetic_preferences
        task = synthetic_task(cfg)
        return (synthetic_preferences(task, cfg.data.n_pairs, cfg.seed,
                                      terse_wrong_share=cfg.data.terse_wrong_share),
                synthetic_preferences(task, cfg.data.eval_size, cfg.seed, held_out=True),
                f"synthetic:{cfg.data.synthetic}")
    if not cfg.data.train_path:
        raise ValueError("preference pairs: give --data.train_path FILE or --data.synthetic TASK")
    train_rows = _pairs_of(cfg, cfg.data.train_path)
    if cfg.data.eval_path:
        eval_rows = _pairs_of(cfg, cfg.data.eval_path)
    else:
        if len(train_rows) < 5:
            raise ValueError(f"{cfg.data.train_path}: {len(train_rows)} pairs; at least 5 are needed "
                             "(a fifth is held out for evaluation), or give --data.eval_path FILE")
        order = random.Random(cfg.seed).sample(range(len(train_rows)), len(train_rows))
        n_eval = min(cfg.data.eval_size, len(train_rows) // 5)
        eval_rows = [train_rows[i] for i in order[:n_eval]]
        train_rows = [train_rows[i] for i in order[n_eval:]]
    return train_rows, eval_rows, cfg.data.train_path


def _pairs_of(cfg: StageConfig, path: str) -> list[dict]:
    """The rows of `path`, each with its pair's parts in the prompt, chosen and rejected fields."""
    d = cfg.data
    rows = read_rows(path)
    pairs = read_each(path, rows, partial(preference_pair, prompt_field=d.prompt_field,
                                          chosen_field=d.chosen_field,
                                          rejected_field=d.rejected_field), row_label(path))
    return [{**row, d.prompt_field: p.prompt, d.chosen_field: p.chosen, d.rejected_field: p.rejected}
            for row, p in zip(rows, pairs)]


def _pair_responses(tok, cfg: StageConfig, rows: list[dict]) -> tuple[list, list]:
    """Token ids of each pair's chosen and rejected responses (EOS-terminated, max_len; a
    conversational one as the chat template writes it after the prompt)."""
    d = cfg.data
    return tuple([completion_ids(tok, d.system_prompt, r[d.prompt_field], r[name], cfg.max_len)
                  for r in rows] for name in (d.chosen_field, d.rejected_field))


def _pair_logp(st: OfflineJob, cfg: StageConfig, data, batch: list[int]) -> tuple[Tensor, Tensor]:
    """log pi(y_c|x), log pi(y_r|x) of the pairs `batch`, chosen and rejected in one forward
    (rows [c_0..c_n, r_0..r_n])."""
    prompts, chosen, rejected = data
    r = pack(st.tokenizer, [prompts[i] for i in batch] * 2,
             [chosen[i] for i in batch] + [rejected[i] for i in batch], st.device)
    logp = sequence_logprobs(st.model, r, torch.arange(2 * len(batch)), 1.0,
                             autocast=cfg.model.autocast).logp
    seq = sequence_logprob(logp, r.response_mask_B_T)
    return seq[:len(batch)], seq[len(batch):]


@torch.no_grad()
def _all_pair_logp(st: OfflineJob, cfg: StageConfig, data) -> tuple[Tensor, Tensor]:
    """_pair_logp of every pair, split over the ranks and gathered."""
    st.model.eval()
    out = sharded_rows(lambda idx: _pair_logp(st, cfg, data, idx), len(data[0]), 16, st.world)
    st.model.train()
    return out


def _implicit_reward_metrics(c: Tensor, r: Tensor, ref: tuple[Tensor, Tensor], beta: float,
                             rows: list[dict], prefix: str) -> dict[str, float]:
    """Held-out accuracy and margin of the implicit rewards beta log pi/pi_ref (per pair kind);
    '_mean' and '_std' of the rewards (a log-ratio reward model's normalisation) are private."""
    out = dpo_loss(c, r, *ref, beta)
    win = out.chosen_rewards > out.rejected_rewards
    rewards = torch.cat([out.chosen_rewards, out.rejected_rewards])
    accuracy_key = f"{prefix}/eval_accuracy" if prefix == "rm" else "dpo/eval_reward_accuracy"
    res = {accuracy_key: win.float().mean().item(),
           f"{prefix}/eval_margin": (out.chosen_rewards - out.rejected_rewards).mean().item(),
           "_mean": rewards.mean().item(), "_std": rewards.std().item()}
    for kind in sorted({row.get("kind") for row in rows if row.get("kind")}):
        idx = torch.tensor([i for i, row in enumerate(rows) if row.get("kind") == kind])
        res[f"{accuracy_key}@{kind}"] = win[idx].float().mean().item()
    return res


def public_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


def _dpo_step(st: OfflineJob, cfg: StageConfig, step: int, batch: list[int], data, ref) -> float:
    """One DPO optimizer step on a global batch of pairs (this rank's share); returns the
    batch's implicit-reward accuracy."""
    world = st.world
    mine, weight = share_of_batch(batch, world)
    idx = torch.tensor(mine)
    pol_c, pol_r = _pair_logp(st, cfg, data, mine)
    out = dpo_loss(pol_c, pol_r, ref[0][idx].to(st.device), ref[1][idx].to(st.device), cfg.beta)
    share = weight / len(batch)           # the mean over the global batch, this rank's part
    lr = st.optimizer_step(out.loss.sum() * share * world.size)
    margin = out.chosen_rewards - out.rejected_rewards
    loss, acc, margin, chosen, rejected = (global_sum(torch.stack([
        out.loss.detach().sum(), (margin > 0).float().sum(), margin.sum(),
        out.chosen_rewards.sum(), out.rejected_rewards.sum()]) * share, world)).tolist()
    st.logger.log(step, {"loss/dpo": loss, "optim/lr": lr, "dpo/reward_accuracy": acc,
                         "dpo/margin": margin,
                         "dpo/chosen_reward": chosen, "dpo/rejected_reward": rejected})
    return acc


@dataclass(frozen=True)
class PairReading:
    """How a run on preference pairs is read. DPO (`DPO`) reads the trained model as a policy:
    metrics under dpo/, and with a synthetic task its greedy answers before and after. A log-ratio
    reward model (stages/reward_model.py) reads the same training as r = beta log pi/pi_ref:
    metrics under rm/, the implicit-reward accuracy before training too, and files beside the
    final model that name its reference."""
    command: str                          # the resume command and the progress bar: dpo, reward-model
    prefix: str                           # held-out metrics under dpo/ or rm/
    answers: bool                         # greedy answers of a synthetic task before and after
    scores_before: bool                   # the held-out implicit-reward metrics before training
    # files saved beside the final model, from (cfg, the held-out metrics after, the data source)
    saved_files: Callable[[StageConfig, dict[str, float], str], dict[str, str]] | None = None


DPO = PairReading(command="dpo", prefix="dpo", answers=True, scores_before=False)


@dataclass(frozen=True)
class EncodedPairs:
    """A run's preference pairs as token ids, each a (prompts, chosen, rejected) triple of
    lists: the training pairs, the held-out pairs with their rows (a row's 'kind' splits the
    metrics), and where the pairs came from."""
    train: tuple[list, list, list]
    held_out: tuple[list, list, list]
    held_out_rows: list[dict]
    source: str


def dpo(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True, *,
        resume: str | Path | None = None) -> dict[str, Any]:
    """DPO (§9) on (prompt, chosen, rejected) pairs from --data.train_path or --data.synthetic TASK.

    The reference is the starting model, frozen: its log-probs of every pair are computed once
    up front and the copy is dropped, so training holds one model (and epochs > 1 cost no extra
    reference passes; a checkpoint keeps them, so a resumed run needs no reference at all).
    Held-out pairs give the implicit-reward accuracy and margin (per pair kind); with --data.synthetic,
    greedy answers to the held-out problems show the behaviour itself before and after: accuracy
    and length."""
    return train_on_pairs(cfg, DPO, model, tokenizer, show_progress, resume)


def train_on_pairs(cfg: StageConfig, reading: PairReading, model=None, tokenizer=None,
                   show_progress: bool = True, resume: str | Path | None = None) -> dict[str, Any]:
    """DPO's loop: the reference's log-probs once, then a DPO step per batch of pairs, read as
    `reading` says before and after."""
    if cfg.eval_every:   # (dpo and reward-model evaluate their held-out pairs before and after)
        raise ValueError(f"eval_every={cfg.eval_every} applies to sft (the held-out NLL); "
                         f"{reading.command} evaluates its held-out pairs before and after training")
    train_rows, eval_rows, source = preference_rows(cfg)
    st = start_offline(reading.command, cfg, model, tokenizer, train_rows, resume=resume,
                       show_progress=show_progress)
    tok = st.tokenizer
    train_data = (st.prompts, *_pair_responses(tok, cfg, train_rows))
    eval_data = (encode_prompts_of(tok, cfg, [r[cfg.data.prompt_field] for r in eval_rows]),
                 *_pair_responses(tok, cfg, eval_rows))
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in zip(*train_data)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(len(batches))
    task = synthetic_task(cfg) if cfg.data.synthetic and reading.answers else None
    if st.state is not None:
        summary, (ref_train, ref_eval) = st.saved["summary"], st.saved["reference"]
    else:
        pairs = EncodedPairs(train_data, eval_data, eval_rows, source)
        summary, ref_train, ref_eval = _reference_and_before(st, cfg, reading, pairs, task)
    acc = [float("nan")]

    def step_fn(step: int, batch: list[int]) -> None:
        acc[0] = _dpo_step(st, cfg, step, batch, train_data, ref_train)

    if (stopped := train_batches(st, batches, step_fn, lambda: {"summary": summary, "reference": (ref_train, ref_eval)})):
        return stopped
    after = _implicit_reward_metrics(*_all_pair_logp(st, cfg, eval_data), ref_eval, cfg.beta,
                                     eval_rows, reading.prefix)
    summary["eval_after"] = public_metrics(after)
    st.logger.log(st.steps_done, summary["eval_after"])
    if task is not None:
        summary["behaviour_after"] = held_out_behaviour(st.model, tok, task, cfg, st.world)
        st.logger.log(st.steps_done, summary["behaviour_after"])
    extra = reading.saved_files(cfg, after, source) if reading.saved_files else None
    summary.update(steps=st.steps_done, reward_accuracy_last=acc[0], final_model=save_final_model(st, extra))
    finish_job(st, summary)
    return summary


def _reference_and_before(st: OfflineJob, cfg: StageConfig, reading: PairReading,
                          pairs: EncodedPairs, task) -> tuple[dict, tuple, tuple]:
    """The reference's log-probs of every training and held-out pair (the starting model's), and
    the figures before training: (summary, reference of the training pairs, of the held-out)."""
    eval_rows = pairs.held_out_rows
    t0 = time.perf_counter()
    ref_train = _all_pair_logp(st, cfg, pairs.train)
    ref_eval = _all_pair_logp(st, cfg, pairs.held_out)
    summary = {"run_dir": str(st.run_dir), "source": pairs.source, "train_pairs": len(pairs.train[0]),
               "eval_pairs": len(eval_rows), "reference_s": time.perf_counter() - t0}
    if reading.scores_before:       # pi = pi_ref: every implicit reward is 0, every pair a tie
        summary["eval_before"] = public_metrics(_implicit_reward_metrics(*ref_eval, ref_eval, cfg.beta,
                                                                  eval_rows, reading.prefix))
        st.logger.log(0, summary["eval_before"])
    if task is not None:
        summary["behaviour_before"] = held_out_behaviour(st.model, st.tokenizer, task, cfg, st.world)
        st.logger.log(0, summary["behaviour_before"])
    return summary, ref_train, ref_eval
