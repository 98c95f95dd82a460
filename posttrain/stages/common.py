"""What the offline stages share: responses as token ids, length buckets, one run's lifecycle
(start, schedule and resume, the optimizer step, checkpoints and stop signals, the final model),
the data-parallel shares, and the held-out greedy answers of a synthetic task.

Every rank builds the same batches (same seed) and runs its contiguous share of each; a rank's
loss is weighted by the *global* batch's pair or token count, so the averaged gradient is the
one-process gradient of the whole batch (`model/distributed.py`). Reference passes and held-out
evaluations are split over the ranks and gathered; rank 0 logs and saves.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.config.commands import StageConfig
from posttrain.data.formats import chat_messages
from posttrain.data.tasks import Problem
from posttrain.model.distributed import SINGLE, World, device_for, gather_objects, wrap
from posttrain.model.loading import add_lora, freeze_lower_layers, load_model, load_policy
from posttrain.run.lifecycle import Job, Steps, open_folder, start_job, stop_job
from posttrain.sampling.evaluation import EvalSettings
from posttrain.sampling.service import Sampling
from posttrain.model.prompts import encode_prompts
from posttrain.rewards.scorer import Scorer
from posttrain.rollout.episodes import EpisodeSettings
from posttrain.rollout import make_engine
from posttrain.config.sections import RewardConfig
from posttrain.run.learner import Learner
from posttrain.run.optim import make_adamw, make_scheduler

log = logging.getLogger("posttrain.stages")


def response_ids(tokenizer, text: str, max_len: int, ids: list[int] | None = None) -> list[int]:
    """The response's tokens, ending in EOS (the model must learn to stop): the teacher's own
    `ids` when given, else the text tokenised. Re-tokenising decoded text can merge tokens (the
    teacher's '\n' '\n' comes back as one '\n\n' token): a student fine-tuned on the text then
    writes a token the teacher never does, 10 nats of KL at that position when distillation follows."""
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = list(ids)[:max_len - 1]
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


def length_buckets(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Batches of similar length (sorted within shuffled windows of 50 batches), so padding is not
    most of the compute; the batch order is shuffled."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 50
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def encode_prompts_of(tokenizer, cfg: StageConfig, prompts: list) -> list[list[int]]:
    """Prompts as text, or as chat messages (a conversational row, an episode's prompt)."""
    problems = [Problem(p, "") if isinstance(p, str) else
                Problem("", "", messages=chat_messages(p, "prompt")) for p in prompts]
    return encode_prompts(tokenizer, problems, cfg.data.system_prompt)


@dataclass(kw_only=True)
class OfflineJob(Job):
    """An sft / dpo / reward-model run: the common lifecycle's fields (Job) and what
    `start_offline` built: the rows and their encoded prompts, and the learner (run/learner.py:
    the model, its optimizer and schedule, the checkpoint and the final save)."""

    cfg: StageConfig
    rows: list[dict[str, Any]]
    learner: Learner
    prompts: list[list[int]]
    rng: random.Random
    device: torch.device
    saved: dict[str, Any] = field(default_factory=dict)   # the stage's state at the checkpoint resumed

    @property
    def model(self):
        return self.learner.model

    @property
    def tokenizer(self):
        return self.learner.tokenizer

    def schedule(self, total_steps: int) -> None:
        """Set the learning-rate schedule once the number of optimizer steps is known; on resume,
        restore the optimizer, schedule and RNG states of the checkpoint."""
        o = self.cfg.optim
        self.learner.scheduler = make_scheduler(self.learner.optimizer, total_steps,
                                                o.warmup_steps, o.schedule)
        if self.state is not None:
            self.learner.restore(self.state, self.generator)
            self.start_step, self.saved = self.state["step"], self.state["stage"]
            self.train_seconds = self.state.get("train_s", 0.0)
        self.steps_done = self.start_step

    def optimizer_step(self, loss: Tensor) -> float:
        """One optimizer step; `loss` is this rank's part of the global batch loss (times the world
        size, which the gradient average divides out). Returns the learning rate it used."""
        loss.backward()
        lr = self.learner.optimizer.param_groups[0]["lr"]
        _, stepped = self.learner.optimizer_step()
        self.learner.optimizer.zero_grad(set_to_none=True)
        self.learner.count_skipped(not stepped)
        return lr


def train_batches(st: OfflineJob, batches: list, step_fn, state) -> dict[str, Any] | None:
    """The stage's loop over its batches: `step_fn(step, batch)` for every batch after the ones a
    resumed run already took, and a checkpoint (weights, optimizer, schedule, RNG and `state()`:
    what the stage needs to finish as if it had never stopped, its before-training figures, a
    DPO reference's log-probs) on the configured cadence and when SIGINT / SIGTERM arrives.
    Returns None, or the summary of a run a signal stopped."""
    with Steps(st, len(batches), st.command, save_last=False) as steps:
        for step in steps:
            with steps.timed(step):
                step_fn(step, batches[step - 1])
            if steps.checkpoint_due(step):
                with steps.saving(step):
                    save_stage(st, step, state)
    if steps.stop_signal is None:
        return None
    return stop_job(st, steps.stop_signal, {"run_dir": str(st.run_dir)})


def save_stage(st: OfflineJob, step: int, state) -> None:
    """The learner's checkpoint with the stage's state, the log rows and the clock."""
    extra = {"stage": state(), "log_rows": st.logger.line_counts(), "train_s": st.train_seconds}
    st.learner.save(st.run_dir, step, st.generator, extra, st.cfg.to_dict(),
                    keep=st.cfg.checkpoint.keep)


def _load_lm(path: str | Path, resumed: bool = False):
    return load_policy(path)


def load_stage_model(job: Job, model, tokenizer, load):
    """The starting model (`load(path)`; resuming: the checkpoint's, `load(path, resumed=True)`),
    its attention kernel, pad token and frozen lower layers. LoRA: the base model (the given one,
    or model.path; it never changes) with fresh adapters, or the checkpoint's when resuming."""
    cfg = job.cfg
    if job.ckpt is not None and not cfg.lora.rank:   # (the checkpoint's model, whatever was given)
        model, tokenizer, _ = load_model(cfg.model, folder=job.ckpt / "model",
                                         load=lambda path: load(path, resumed=True))
    else:
        model, tokenizer, _ = load_model(cfg.model, model, tokenizer, load=load)
    if cfg.lora.rank:
        return add_lora(model, cfg.lora, job.ckpt / "adapter" if job.ckpt else None), tokenizer
    freeze_lower_layers(model, cfg.freeze_layers)
    return model, tokenizer


def stage_optimizer(cfg: StageConfig, model, world: World) -> torch.optim.Optimizer:
    """AdamW; a freshly initialised head (reward model's `score`) may learn faster than the body
    it reads (`head_lr`)."""
    head = getattr(model, "score", None) if cfg.head_lr is not None else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    groups = [{"params": [p for p in model.parameters() if id(p) not in head_ids and p.requires_grad],
               "lr": cfg.optim.lr}]
    if head_ids:
        groups.append({"params": list(head.parameters()), "lr": cfg.head_lr})
    o = cfg.optim
    return make_adamw(groups, o.lr, (o.beta1, o.beta2), o.weight_decay,
                      sharded=world.strategy == "fsdp")


def start_offline(command: str, cfg: StageConfig, model, tokenizer, rows: list[dict], *,
                  load=None, resume: str | Path | None = None, show_progress: bool = True,
                  prompts_of: Callable[[Any], list[list[int]]] | None = None) -> OfflineJob:
    """The common start (threads, seed, world, resume point) on rows read and checked before any
    model loads (data/formats.py); the model loaded (`load`), placed and wrapped; the run folder
    opened; the rows' prompts encoded: `prompts_of(tokenizer)`, by default each row's prompt
    field as the policy is prompted."""
    cfg.validate()   # (a StageConfig built in code has not been checked yet)
    job = start_job(command, cfg, resume, show_progress)
    if job.world.distributed and cfg.batch_size < job.world.size:
        raise ValueError(f"batch_size={cfg.batch_size} is smaller than the {job.world.size} ranks: "
                         "each rank needs a share of every batch")
    model, tokenizer = load_stage_model(job, model, tokenizer, load or _load_lm)
    device = device_for(job.world)
    model = wrap(model.to(device), job.world)      # FSDP2: the decoder layers sharded, in place
    open_folder(job, cfg.to_dict())
    prompts = (prompts_of(tokenizer) if prompts_of is not None else
               encode_prompts_of(tokenizer, cfg, [r[cfg.data.prompt_field] for r in rows]))
    learner = Learner(model=model, tokenizer=tokenizer, optimizer=stage_optimizer(cfg, model, job.world),
                      optim=cfg.optim, world=job.world)
    return OfflineJob(**job.parts(), rows=rows, learner=learner, prompts=prompts,
                      rng=random.Random(cfg.seed), device=device)


def share_of_batch(batch: list[int], world: World) -> tuple[list[int], float]:
    """This rank's contiguous part of a global batch, with weight 1. A rank left with nothing (a
    final batch smaller than the world) runs the batch's first row with weight 0, so that every
    rank still takes part in FSDP's collectives and the gradient all-reduce."""
    if not world.distributed:
        return batch, 1.0
    per = -(-len(batch) // world.size)
    mine = batch[world.rank * per:(world.rank + 1) * per]
    return (mine, 1.0) if mine else (batch[:1], 0.0)


def sharded_rows(fn, n: int, chunk: int, world: World) -> tuple[Tensor, ...]:
    """fn(indices) -> a tuple of per-row tensors, for rows 0..n-1, with the rows split over the
    ranks (contiguous shares, `chunk` rows per call) and gathered back in order on every rank.
    Every rank makes the same number of calls (padding with row 0), as FSDP's forward requires."""
    per = -(-n // world.size)
    mine = list(range(min(world.rank * per, n), min((world.rank + 1) * per, n)))
    parts = []
    for start in range(0, per, chunk):
        idx = mine[start:start + chunk]
        out = fn(idx or [0])
        if idx:
            parts.append(tuple(t.detach().cpu() for t in out))
    local = tuple(torch.cat(cols) for cols in zip(*parts)) if parts else None
    shares = [s for s in gather_objects(local, world) if s is not None]
    return tuple(torch.cat(cols) for cols in zip(*shares))


def save_final_model(st: OfflineJob, extra_files: dict[str, str] | None = None) -> str:
    """Save the final model once (rank 0; FSDP shards are gathered first)."""
    return st.learner.save_final(st.run_dir / "final_model", extra_files)


@torch.no_grad()
def held_out_behaviour(model, tokenizer, task, cfg: StageConfig, world: World | None = None,
                       max_new_tokens: int = 48) -> dict[str, float]:
    """Greedy answers to a synthetic task's held-out problems by the one evaluator
    (evaluation.evaluate), with no stop string (the model must end its answer itself):
    eval/accuracy by the verifier and eval/length_mean. Under torchrun each rank answers its
    share (FSDP: with the full weights gathered once)."""
    settings = EvalSettings(max_new_tokens, (), 50, EpisodeSettings(cfg.data.system_prompt))
    sampling = Sampling(cfg=cfg, engine=make_engine("hf", model, tokenizer), tokenizer=tokenizer,
                        scorer=Scorer(RewardConfig(), task.verifier), world=world or SINGLE)
    res = sampling.evaluate(model, task.eval_problems, settings)
    lengths = res.pop("_lengths")
    return {"eval/accuracy": res["eval/accuracy"],
            "eval/length_mean": sum(lengths) / max(len(lengths), 1)}


def synthetic_task(cfg: StageConfig):
    from posttrain.data.tasks import make_task
    task = make_task(cfg.data.synthetic, 2)
    task.build_eval(cfg.data.eval_size, 1234)
    return task


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
