"""`posttrain reward-model`: a Bradley-Terry reward model (docs/algorithms.md §1) on (prompt,
chosen, rejected) pairs: a scalar head on the last token, saved as an
AutoModelForSequenceClassification with reward_stats.json; `--reward_form log_ratio` trains
r = beta log pi/pi_ref with DPO's loop instead (stages/preference.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from posttrain.config.commands import StageConfig
from posttrain.model.distributed import global_sum
from posttrain.model.loading import resolve_model_path
from posttrain.run.lifecycle import finish_job
from posttrain.stages.common import (OfflineJob, encode_prompts_of, length_buckets,
                                     save_final_model, share_of_batch, sharded_rows, start_offline,
                                     train_batches)
from posttrain.stages.preference import PairReading, public_metrics, preference_rows, train_on_pairs
from posttrain.stages.rows import scored_ids


def load_reward_model_start(path: str | Path, resumed: bool = False):
    """A reward model to train: the body from `path`, a one-label score head initialised to
    zero (r = 0 for everything at the start); `resumed`: a checkpoint's, head included."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    if not resumed:
        torch.nn.init.zeros_(model.score.weight)
    return model


def _bradley_terry_step(st: OfflineJob, cfg: StageConfig, step: int, batch: list[int], scores,
                        chosen: list[list[int]]) -> None:
    """One reward-model optimizer step on a global batch of pairs (this rank's share):
    -log sigmoid(r_c - r_r), plus lm_coef x the next-token loss on the chosen responses."""
    from posttrain.losses.preference import bradley_terry_loss
    world = st.world
    mine, weight = share_of_batch(batch, world)
    c, r, nll = scores(mine)
    losses = bradley_terry_loss(c, r)
    share = weight / len(batch)           # the mean over the global batch, this rank's part
    loss = losses.sum() * share
    logged = {}
    if nll is not None:                   # mean over the global batch's chosen tokens
        n_tokens = global_sum(torch.tensor(weight * sum(len(chosen[i]) for i in mine),
                                           dtype=torch.float32, device=st.device), world)
        lm = nll.sum() * weight / n_tokens
        loss = loss + cfg.lm_coef * lm
        logged["loss/chosen_nll"] = global_sum(lm.detach(), world).item()
    logged["optim/lr"] = st.optimizer_step(loss * world.size)
    bt, acc = (global_sum(torch.stack([losses.detach().sum(), (c > r).float().sum()]) * share,
                          world)).tolist()
    st.logger.log(step, {"loss/bradley_terry": bt, "rm/train_accuracy": acc, **logged})


def reward_model(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True,
                 resume: str | Path | None = None) -> dict[str, Any]:
    """Train a Bradley-Terry reward model (§1) on (prompt, chosen, rejected) pairs:
    loss -log sigmoid(r(x, y_c) - r(x, y_r)), r = a scalar head on the last token. Reports
    held-out pairwise accuracy (per pair kind when the rows have one) before and after, and saves
    an AutoModelForSequenceClassification (one label) with reward_stats.json for normalisation.
    With --reward_form log_ratio, r = beta log pi/pi_ref instead (see StageConfig.reward_form)."""
    if cfg.eval_every:
        raise ValueError(f"eval_every={cfg.eval_every} applies to sft (the held-out NLL); "
                         "reward-model evaluates its held-out pairs before and after training")
    if cfg.lora.rank:   # (a score head would stay frozen under peft; the log-ratio LM would merge)
        raise ValueError(f"lora.rank={cfg.lora.rank}: reward-model trains every weight; LoRA "
                         "applies to sft and dpo (drop --lora.rank)")
    train = log_ratio_reward_model if cfg.reward_form == "log_ratio" else score_head_reward_model
    return train(cfg, model, tokenizer, show_progress, resume)


def log_ratio_reward_model(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True,
                           resume: str | Path | None = None) -> dict[str, Any]:
    """r = beta log pi/pi_ref: the Bradley-Terry loss on this r is DPO's loss, term for term, so
    DPO's loop trains it, read as a reward model (metrics under rm/, no greedy answers); the saved
    LM carries reward_stats.json (beta, the reference, held-out score statistics)."""
    for name, unset in (("head_lr", None), ("lm_coef", 0.0), ("end_of_turn", False)):
        if getattr(cfg, name) != unset:
            raise ValueError(f"{name}={getattr(cfg, name)!r} applies to reward_form=score_head "
                             "only (a log-ratio reward model has no score head)")
    # the reward model scores against its reference for good: name it before any work
    reference = _reference_spec(cfg.model.path)
    reading = PairReading(command="reward-model", prefix="rm", answers=False, scores_before=True,
                          saved_files=partial(_log_ratio_stats, reference=reference))
    return train_on_pairs(cfg, reading, model, tokenizer, show_progress, resume)


def _log_ratio_stats(cfg: StageConfig, after: dict[str, float], source: str,
                     reference: str) -> dict[str, str]:
    from posttrain.rewards.model import STATS_FILE
    return {STATS_FILE: json.dumps({"form": "log_ratio", "beta": cfg.beta, "reference": reference,
                                    "mean": after["_mean"], "std": after["_std"],
                                    "source": source, "max_len": cfg.max_len})}


@dataclass
class ScoredPairs:
    """A score-head reward model's view of pairs: their token ids, and r(x, y) of both sides."""
    st: OfflineJob
    cfg: StageConfig

    def encode(self, rows: list[dict], heads: list[list[int]]) -> tuple[list, list, list]:
        """(prompt heads, chosen, rejected) token ids of `rows`, whose prompts are `heads` (a
        conversational response rendered by the chat template: stages/rows.py::scored_ids)."""
        tok, d, eot = self.st.tokenizer, self.cfg.data, self.cfg.end_of_turn
        return (heads, *([scored_ids(tok, d.system_prompt, r[d.prompt_field], r[name], eot)
                          for r in rows] for name in (d.chosen_field, d.rejected_field)))

    def scores(self, idx: list[int], heads, chosen, rejected, chosen_nll: bool = False):
        """r(x, y_c), r(x, y_r) of the pairs `idx` (and the chosen responses' next-token loss)."""
        from posttrain.rewards.model import pair_scores
        return pair_scores(self.st.model, [heads[i] for i in idx], [chosen[i] for i in idx],
                           [rejected[i] for i in idx], self.st.tokenizer.pad_token_id,
                           autocast=self.cfg.model.autocast, chosen_nll=chosen_nll)

    @torch.no_grad()
    def evaluate(self, parts: tuple, rows: list[dict]) -> dict[str, float]:
        """Held-out pairwise accuracy and margin (per pair kind); '_mean' and '_std' of the scores
        (the saved normalisation) are private."""
        from posttrain.losses.preference import pairwise_accuracy
        self.st.model.eval()
        c, r = sharded_rows(lambda idx: self.scores(idx, *parts)[:2], len(rows), 32, self.st.world)
        self.st.model.train()
        out = {"rm/eval_accuracy": pairwise_accuracy(c, r).item(),
               "rm/eval_margin": (c - r).mean().item(),
               "_mean": torch.cat([c, r]).mean().item(), "_std": torch.cat([c, r]).std().item()}
        for kind in sorted({row.get("kind") for row in rows if row.get("kind")}):
            idx = torch.tensor([i for i, row in enumerate(rows) if row.get("kind") == kind])
            out[f"rm/eval_accuracy@{kind}"] = pairwise_accuracy(c[idx], r[idx]).item()
        return out


def score_head_reward_model(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True,
                            resume: str | Path | None = None) -> dict[str, Any]:
    """A scalar head on the last token, trained with the Bradley-Terry loss (see reward_model)."""
    from posttrain.rewards.model import STATS_FILE
    train_rows, eval_rows, source = preference_rows(cfg)
    st = start_offline("reward-model", cfg, model, tokenizer, train_rows,
                       load=load_reward_model_start, resume=resume, show_progress=show_progress)
    st.model.config.pad_token_id = st.tokenizer.pad_token_id
    if cfg.lm_coef > 0:
        from posttrain.rewards.model import tied_lm_head
        tied_lm_head(st.model)                # refuse an untied model before any training
    pairs = ScoredPairs(st, cfg)
    eval_parts = pairs.encode(eval_rows, encode_prompts_of(
        st.tokenizer, cfg, [r[cfg.data.prompt_field] for r in eval_rows]))
    heads, chosen, rejected = pairs.encode(train_rows, st.prompts)   # prompts encoded by start_offline
    lengths = [len(h) + max(len(c), len(r)) for h, c, r in zip(heads, chosen, rejected)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(len(batches))
    before = st.saved.get("eval_before")
    if before is None:
        before = public_metrics(pairs.evaluate(eval_parts, eval_rows))
        st.logger.log(0, before)
    st.model.train()

    def step_fn(step: int, batch: list[int]) -> None:
        _bradley_terry_step(st, cfg, step, batch, lambda mine: pairs.scores(
            mine, heads, chosen, rejected, cfg.lm_coef > 0), chosen)

    if (stopped := train_batches(st, batches, step_fn, lambda: {"eval_before": before})):
        return stopped
    after = pairs.evaluate(eval_parts, eval_rows)
    st.logger.log(st.steps_done, public_metrics(after))
    stats = json.dumps({"mean": after["_mean"], "std": after["_std"], "source": source,
                        "end_of_turn": cfg.end_of_turn})
    summary = {"run_dir": str(st.run_dir), "final_model": save_final_model(st, {STATS_FILE: stats}),
               "steps": st.steps_done, "train_pairs": len(train_rows), "eval_pairs": len(eval_rows),
               "eval_before": before, "eval_after": public_metrics(after)}   # (+ train_minutes)
    finish_job(st, summary)
    return summary


def _reference_spec(model: str) -> str:
    """How a log-ratio reward model names its reference: a built-in name as given (resolved on
    each machine), a folder as its absolute path. Fails now if neither."""
    resolve_model_path(model)
    return str(Path(model).resolve()) if Path(model).is_dir() else model
