"""The offline stages around RL: SFT (docs/algorithms.md §8, the warm-up before distillation), DPO
(§9, the closed-form counterpart of the KL-regularised objective) and Bradley-Terry reward models
(§1). Short loops with no rollout; they share the trainer's prompt encoding, its response-only
forward pass, its logging and its data parallelism:

    torchrun --nproc-per-node N -m posttrain.cli sft|dpo|reward-model ... [--parallel.strategy fsdp]

Every rank builds the same batches (same seed) and runs its contiguous share of each; a rank's
loss is weighted by the *global* batch's pair or token count, so the averaged gradient is the
one-process gradient of the whole batch (`distributed.py`). Reference passes and held-out
evaluations are split over the ranks and gathered; rank 0 logs and saves.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from posttrain.checkpoint import restore_rng, resume_point, save_checkpoint
from posttrain.config import StageConfig
from posttrain.data import read_rows
from posttrain.data.files import chat_messages
from posttrain.data.tasks import Problem
from posttrain.distributed import (World, average_gradients, barrier, device_for,
                                   full_state_dict, full_weights_for_generation, gather_objects,
                                   global_sum, init_world, load_optimizer_state, wrap)
from posttrain.envs.base import Demonstrates
from posttrain.lifecycle import Lifecycle, resume_command
from posttrain.logging import MetricsLogger, NullLogger, resume_logs
from posttrain.losses import dpo_loss, sequence_logprob, sft_loss
from posttrain.models import (freeze_lower_layers, load_policy, load_tokenizer, resolve_model_path,
                              save_model)
from posttrain.forward import pack, sequence_logprobs
from posttrain.prompts import encode_prompts
from posttrain.run import make_adamw, make_scheduler, seed_everything
from posttrain.update import check_nonfinite_streak, step_if_finite

log = logging.getLogger(__name__)


def _response_ids(tokenizer, text: str, max_len: int, ids: list[int] | None = None) -> list[int]:
    """The response's tokens, ending in EOS (the model must learn to stop): the teacher's own
    `ids` when given, else the text tokenised. Re-tokenising decoded text can merge tokens (the
    teacher's '\n' '\n' comes back as one '\n\n' token): a student fine-tuned on the text then
    writes a token the teacher never does, 10 nats of KL at that position when distillation follows."""
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = list(ids)[:max_len - 1]
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


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
        out.append(mask + [1] * (len(resp) - len(mask)))   # the EOS _response_ids appended
    return out


def _check_rows(path: str, rows: list[dict], fields: list[str]) -> None:
    """Missing, empty and (for pairs) identical fields are reported with file, line and field."""
    if not rows:
        raise ValueError(f"{path}: no rows")
    where = "line" if str(path).endswith((".jsonl", ".json")) else "row"
    for i, row in enumerate(rows, start=1):
        for f in fields:
            v = row.get(f)
            if v is None or (isinstance(v, str) and not v.strip()):
                raise ValueError(f"{path}: {where} {i}: field {f!r} is missing or empty")
        if len(fields) == 3 and row[fields[1]] == row[fields[2]]:
            raise ValueError(f"{path}: {where} {i}: {fields[1]!r} and {fields[2]!r} are identical")


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


def _encode(tokenizer, cfg: StageConfig, prompts: list) -> list[list[int]]:
    """Prompts as text, or as chat messages (a conversational row, an episode's prompt)."""
    problems = [Problem(p, "") if isinstance(p, str) else
                Problem("", "", messages=chat_messages(p, "prompt")) for p in prompts]
    return encode_prompts(tokenizer, problems, cfg.data.system_prompt)


@dataclass
class _Stage:
    """What `_start` built, and where a resumed run stands."""
    rows: list[dict[str, Any]]
    model: Any
    tokenizer: Any
    prompts: list[list[int]]
    optimizer: torch.optim.Optimizer
    run_dir: Path
    logger: MetricsLogger | NullLogger
    rng: random.Random
    world: World
    device: torch.device
    scheduler: Any = None
    max_grad_norm: float = 1.0
    resume_state: dict[str, Any] | None = None   # resuming: the checkpoint's saved state
    start_step: int = 0                  # optimizer steps already taken
    saved: dict[str, Any] = field(default_factory=dict)   # the stage's state at that checkpoint
    max_nonfinite_steps: int = 3         # consecutive skipped (non-finite) steps that stop the run
    nonfinite_streak: int = 0

    def schedule(self, cfg: StageConfig, total_steps: int) -> None:
        """Set the learning-rate schedule once the number of optimizer steps is known; on resume,
        restore the optimizer, schedule and RNG states of the checkpoint."""
        self.scheduler = make_scheduler(self.optimizer, total_steps, cfg.optim.warmup_steps,
                                        cfg.optim.schedule)
        state = self.resume_state
        if state is not None:
            load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            restore_rng(state["rng"], torch.Generator())
            self.start_step, self.saved = state["step"], state["stage"]


def run_steps(st: _Stage, cfg: StageConfig, batches: list, step_fn, state, desc: str,
              show_progress: bool) -> dict[str, Any] | None:
    """The stages' loop: `step_fn(step, batch)` for every batch after the ones a resumed run
    already took, and a checkpoint (weights, optimizer, schedule, RNG and `state()`: what the
    stage needs to finish as if it had never stopped, its before-training figures, a DPO
    reference's log-probs) every `cfg.checkpoint` steps or minutes and when SIGINT / SIGTERM
    arrives. Returns None, or the summary of a run a signal stopped (checkpoint written)."""
    bar = tqdm(total=len(batches), initial=st.start_step, desc=desc,
               disable=not (show_progress and st.world.main))
    lifecycle = Lifecycle(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes, st.world)
    with lifecycle:
        for step in range(st.start_step + 1, len(batches) + 1):
            step_fn(step, batches[step - 1])
            bar.update(1)
            save, stop = lifecycle.after_step(step)
            if (save and step < len(batches)) or stop:
                save_checkpoint(st.run_dir, step, st.model, st.tokenizer, st.optimizer,
                                st.scheduler, torch.Generator(),
                                {"stage": state(), "log_rows": st.logger.line_counts()}, asdict(cfg),
                                world=st.world, keep=cfg.checkpoint.keep)
                lifecycle.saved()
            if stop:
                bar.close()
                st.logger.close()
                summary = {"run_dir": str(st.run_dir), "steps": step,
                           "stopped_by": lifecycle.stop_signal,
                           "resume": resume_command(desc, st.run_dir)}
                _write_summary(st, summary)
                log.warning("stopped by %s after step %d; continue with: %s",
                            lifecycle.stop_signal, step, summary["resume"])
                return summary
    bar.close()
    return None


def _write_summary(st: _Stage, summary: dict[str, Any]) -> None:
    if st.world.main:
        (st.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _load_lm(path: str | Path, resumed: bool = False):
    return load_policy(path)


def _start(cfg: StageConfig, model, tokenizer, fields: list[str],
           rows: list[dict] | None = None, load=None, resume: str | Path | None = None) -> _Stage:
    """Read and check the data (before any model loads), join the process group under torchrun,
    seed, load (`load(path)`; resuming: the latest checkpoint's weights,
    `load(path, resumed=True)`), place and wrap the model, open the run folder and write its
    config.json."""
    cfg.validate()   # (a StageConfig built in code has not been checked yet)
    load = load or _load_lm
    run_dir = Path(resume or cfg.run_dir)
    point = resume_point(run_dir) if resume else None   # the newest checkpoint that loads
    if resume and point is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir}/checkpoints")
    ckpt, state = point if point is not None else (None, None)
    if rows is None:
        rows = read_rows(cfg.data.train_path)
        _check_rows(cfg.data.train_path, rows, fields)
    world = init_world(cfg.parallel.strategy)
    if world.distributed and cfg.batch_size < world.size:
        raise ValueError(f"batch_size={cfg.batch_size} is smaller than the {world.size} ranks: "
                         "each rank needs a share of every batch")
    seed_everything(cfg.seed)
    if ckpt is not None:
        tokenizer, model = load_tokenizer(ckpt / "model"), load(ckpt / "model", resumed=True)
    elif model is None:
        path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        tokenizer, model = load_tokenizer(path), load(path)
    if cfg.model.attention != "auto":
        model.set_attn_implementation(cfg.model.attention)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    freeze_lower_layers(model, cfg.freeze_layers)
    device = device_for(world)
    model = wrap(model.to(device), world)      # FSDP2: the decoder layers sharded, in place
    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    barrier(world)
    # a freshly initialised head (reward model's `score`) may learn faster than the body it reads
    head = getattr(model, "score", None) if cfg.head_lr is not None else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    groups = [{"params": [p for p in model.parameters() if id(p) not in head_ids and p.requires_grad],
               "lr": cfg.optim.lr}]
    if head_ids:
        groups.append({"params": list(head.parameters()), "lr": cfg.head_lr})
    o = cfg.optim
    optimizer = make_adamw(groups, o.lr, (o.beta1, o.beta2), o.weight_decay,
                           sharded=world.strategy == "fsdp")
    logger = NullLogger()
    if world.main:
        logger = MetricsLogger(run_dir, tensorboard=False, resume=ckpt is not None)
        if state is not None:   # rows a killed run wrote after its last checkpoint are redone
            resume_logs(logger, state)
    return _Stage(rows, model, tokenizer, _encode(tokenizer, cfg, [r[cfg.data.prompt_field] for r in rows]),
                  optimizer, run_dir, logger, random.Random(cfg.seed), world, device,
                  max_grad_norm=o.max_grad_norm, resume_state=state,
                  max_nonfinite_steps=o.max_nonfinite_steps)


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


def _step(stage: _Stage, loss: Tensor) -> float:
    """One optimizer step; `loss` is this rank's part of the global batch loss (times the world
    size, which the gradient average divides out). Returns the learning rate it used."""
    loss.backward()
    params = list(stage.model.parameters())   # after backward: FSDP2 has re-registered its shards
    average_gradients(params, stage.world)
    lr = stage.optimizer.param_groups[0]["lr"]
    _, stepped = step_if_finite(params, stage.optimizer, stage.scheduler, stage.max_grad_norm,
                                stage.world)
    stage.optimizer.zero_grad(set_to_none=True)
    stage.nonfinite_streak = 0 if stepped else stage.nonfinite_streak + 1
    check_nonfinite_streak(stage.nonfinite_streak, stage.max_nonfinite_steps)
    return lr


def _finish(stage: _Stage, extra_files: dict[str, str] | None = None) -> str:
    """Save the final model once (rank 0; FSDP shards are gathered first)."""
    stage.logger.close()
    folder = stage.run_dir / "final_model"
    weights = full_state_dict(stage.model, stage.world)
    if stage.world.main:
        save_model(stage.model, stage.tokenizer, folder, weights, extra_files)
    barrier(stage.world)
    return str(folder)


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
    st = _start(cfg, model, tokenizer, [cfg.data.prompt_field, cfg.data.response_field], rows=rows,
                resume=resume)
    ids = _teacher_ids(st.tokenizer, cfg.data.train_path, st.rows, cfg.data.response_field)
    responses = [_response_ids(st.tokenizer, r[cfg.data.response_field], cfg.max_len, t)
                 for r, t in zip(st.rows, ids)]
    masks = _policy_masks(cfg.data.train_path, st.rows, responses)
    lengths = [len(p) + len(r) for p, r in zip(st.prompts, responses)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(cfg, len(batches))
    summary: dict[str, Any] = {"run_dir": str(st.run_dir), **st.saved.get("summary", {})}
    if task is not None and st.resume_state is None:
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
        lr = _step(st, loss * st.world.size)
        losses.append(global_sum(loss.detach(), st.world).item())
        width = r.prompt_ids_B_L.shape[1] + r.response_ids_B_T.shape[1]
        st.logger.log(step, {"loss/sft": losses[-1], "optim/lr": lr,
                             "perf/step_s": time.perf_counter() - t0,
                             "perf/padding_frac": 1 - sum(lengths[i] for i in mine) / (len(mine) * width)})

    if (stopped := run_steps(st, cfg, batches, step_fn,
                             lambda: {"summary": summary, "losses": losses}, "sft", show_progress)):
        return stopped
    if task is not None:
        summary["behaviour_after"] = held_out_behaviour(st.model, st.tokenizer, task, cfg, st.world)
        st.logger.log(len(batches), summary["behaviour_after"])
    summary.update(steps=len(batches), first_loss=losses[0], last_loss=losses[-1],
                   final_model=_finish(st))
    _write_summary(st, summary)
    return summary


def _pair_responses(tok, cfg: StageConfig, rows: list[dict]) -> tuple[list, list]:
    """Token ids of each pair's chosen and rejected responses (EOS-terminated, max_len)."""
    return ([_response_ids(tok, str(r[cfg.data.chosen_field]), cfg.max_len) for r in rows],
            [_response_ids(tok, str(r[cfg.data.rejected_field]), cfg.max_len) for r in rows])


def _pair_logp(st: _Stage, cfg: StageConfig, data, batch: list[int]) -> tuple[Tensor, Tensor]:
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
def _all_pair_logp(st: _Stage, cfg: StageConfig, data) -> tuple[Tensor, Tensor]:
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


def _public(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


def _dpo_step(st: _Stage, cfg: StageConfig, step: int, batch: list[int], data, ref) -> float:
    """One DPO optimizer step on a global batch of pairs (this rank's share); returns the
    batch's implicit-reward accuracy."""
    world = st.world
    mine, weight = share_of_batch(batch, world)
    idx = torch.tensor(mine)
    pol_c, pol_r = _pair_logp(st, cfg, data, mine)
    out = dpo_loss(pol_c, pol_r, ref[0][idx].to(st.device), ref[1][idx].to(st.device), cfg.beta)
    share = weight / len(batch)           # the mean over the global batch, this rank's part
    lr = _step(st, out.loss.sum() * share * world.size)
    margin = out.chosen_rewards - out.rejected_rewards
    loss, acc, margin, chosen, rejected = (global_sum(torch.stack([
        out.loss.detach().sum(), (margin > 0).float().sum(), margin.sum(),
        out.chosen_rewards.sum(), out.rejected_rewards.sum()]) * share, world)).tolist()
    st.logger.log(step, {"loss/dpo": loss, "optim/lr": lr, "dpo/reward_accuracy": acc,
                         "dpo/margin": margin,
                         "dpo/chosen_reward": chosen, "dpo/rejected_reward": rejected})
    return acc


def dpo(cfg: StageConfig, model=None, tokenizer=None, show_progress: bool = True, *,
        as_reward_model: bool = False, resume: str | Path | None = None) -> dict[str, Any]:
    """DPO (§9) on (prompt, chosen, rejected) pairs from --data.train_path or --data.synthetic TASK.

    The reference is the starting model, frozen: its log-probs of every pair are computed once
    up front and the copy is dropped, so training holds one model (and epochs > 1 cost no extra
    reference passes; a checkpoint keeps them, so a resumed run needs no reference at all).
    Held-out pairs give the implicit-reward accuracy and margin (per pair kind); with --data.synthetic,
    greedy answers to the held-out problems show the behaviour itself before and after: accuracy
    and length.

    `as_reward_model` (reward-model --reward_form log_ratio): the same training read as a
    Bradley-Terry reward model r = beta log pi/pi_ref; metrics under rm/, no greedy answers, and
    the saved LM carries reward_stats.json (beta, the reference, held-out score statistics).
    """
    from posttrain.rewards.model import STATS_FILE
    fields = [cfg.data.prompt_field, cfg.data.chosen_field, cfg.data.rejected_field]
    train_rows, eval_rows, source = preference_rows(cfg)
    # the reward model scores against its reference for good: name it before any work
    reference = _reference_spec(cfg.model.path) if as_reward_model else None
    st = _start(cfg, model, tokenizer, fields, rows=train_rows, resume=resume)
    tok, world = st.tokenizer, st.world
    prefix = "rm" if as_reward_model else "dpo"
    train_data = (st.prompts, *_pair_responses(tok, cfg, train_rows))
    eval_data = (_encode(tok, cfg, [r[cfg.data.prompt_field] for r in eval_rows]),
                 *_pair_responses(tok, cfg, eval_rows))
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in zip(*train_data)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(cfg, len(batches))
    task = synthetic_task(cfg) if cfg.data.synthetic and not as_reward_model else None
    if st.resume_state is not None:
        summary, (ref_train, ref_eval) = st.saved["summary"], st.saved["reference"]
    else:
        t0 = time.perf_counter()
        ref_train, ref_eval = _all_pair_logp(st, cfg, train_data), _all_pair_logp(st, cfg, eval_data)
        summary = {"run_dir": str(st.run_dir), "source": source, "train_pairs": len(train_rows),
                   "eval_pairs": len(eval_rows), "reference_s": time.perf_counter() - t0}
        if as_reward_model:       # pi = pi_ref: every implicit reward is 0, every pair a tie
            summary["eval_before"] = _public(_implicit_reward_metrics(*ref_eval, ref_eval, cfg.beta,
                                                                      eval_rows, prefix))
            st.logger.log(0, summary["eval_before"])
        if task is not None:
            summary["behaviour_before"] = held_out_behaviour(st.model, tok, task, cfg, world)
            st.logger.log(0, summary["behaviour_before"])
    t_start, acc = time.perf_counter(), [float("nan")]

    def step_fn(step: int, batch: list[int]) -> None:
        acc[0] = _dpo_step(st, cfg, step, batch, train_data, ref_train)

    if (stopped := run_steps(st, cfg, batches, step_fn,
                             lambda: {"summary": summary, "reference": (ref_train, ref_eval)},
                             "reward-model" if as_reward_model else "dpo", show_progress)):
        return stopped
    summary["train_minutes"] = (time.perf_counter() - t_start) / 60
    after = _implicit_reward_metrics(*_all_pair_logp(st, cfg, eval_data), ref_eval, cfg.beta,
                                     eval_rows, prefix)
    summary["eval_after"] = _public(after)
    st.logger.log(len(batches), summary["eval_after"])
    if task is not None:
        summary["behaviour_after"] = held_out_behaviour(st.model, tok, task, cfg, world)
        st.logger.log(len(batches), summary["behaviour_after"])
    extra = None
    if as_reward_model:
        extra = {STATS_FILE: json.dumps({"form": "log_ratio", "beta": cfg.beta, "reference": reference,
                                         "mean": after["_mean"], "std": after["_std"],
                                         "source": source, "max_len": cfg.max_len})}
    summary.update(steps=len(batches), reward_accuracy_last=acc[0], final_model=_finish(st, extra))
    _write_summary(st, summary)
    return summary


def _reference_spec(model: str) -> str:
    """How a log-ratio reward model names its reference: a built-in name as given (resolved on
    each machine), a folder as its absolute path. Fails now if neither."""
    resolve_model_path(model)
    return str(Path(model).resolve()) if Path(model).is_dir() else model


@torch.no_grad()
def held_out_behaviour(model, tokenizer, task, cfg: StageConfig, world: World | None = None,
                       max_new_tokens: int = 48) -> dict[str, float]:
    """Greedy answers to the task's held-out problems (no stop string: the model must end its
    answer itself): accuracy by the verifier and response length. Under torchrun each rank
    answers a contiguous share (FSDP: with the full weights gathered once)."""
    from posttrain.config import RewardConfig
    from posttrain.distributed import SINGLE
    from posttrain.rewards import Scorer
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine

    world = world or SINGLE
    all_problems = task.eval_problems
    per = -(-len(all_problems) // world.size)
    problems = all_problems[world.rank * per:(world.rank + 1) * per]
    engine = HFRolloutEngine(model, tokenizer)
    scorer = Scorer(RewardConfig(), task.verifier)
    correct, lengths = [], []
    with full_weights_for_generation(model, world):
        for i in range(0, len(problems), 50):
            chunk = problems[i:i + 50]
            rollout = engine.generate(_encode(tokenizer, cfg, [p.prompt for p in chunk]), 1,
                                      SamplingParams(max_new_tokens, greedy=True))
            texts = tokenizer.batch_decode(rollout.response_ids_B_T.masked_fill(
                rollout.response_mask_B_T == 0, tokenizer.pad_token_id), skip_special_tokens=True)
            correct += scorer(chunk, texts, with_model=False).correct_B.tolist()
            lengths += rollout.lengths_B.tolist()
    shares = gather_objects((correct, lengths), world)
    correct = [c for share in shares for c in share[0]]
    lengths = [n for share in shares for n in share[1]]
    n = max(len(all_problems), 1)
    return {"behaviour/accuracy": sum(correct) / n, "behaviour/length_mean": sum(lengths) / n}


def preference_rows(cfg: StageConfig) -> tuple[list[dict], list[dict], str]:
    """(train pairs, held-out pairs, source) from --data.synthetic TASK or --data.train_path
    [--data.eval_path]; the rows are checked (file, line, field) before any model loads."""
    fields = [cfg.data.prompt_field, cfg.data.chosen_field, cfg.data.rejected_field]
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
    train_rows = read_rows(cfg.data.train_path)
    _check_rows(cfg.data.train_path, train_rows, fields)
    if cfg.data.eval_path:
        eval_rows = read_rows(cfg.data.eval_path)
        _check_rows(cfg.data.eval_path, eval_rows, fields)
    else:
        if len(train_rows) < 5:
            raise ValueError(f"{cfg.data.train_path}: {len(train_rows)} pairs; at least 5 are needed "
                             "(a fifth is held out for evaluation), or give --data.eval_path FILE")
        order = random.Random(cfg.seed).sample(range(len(train_rows)), len(train_rows))
        n_eval = min(cfg.data.eval_size, len(train_rows) // 5)
        eval_rows = [train_rows[i] for i in order[:n_eval]]
        train_rows = [train_rows[i] for i in order[n_eval:]]
    return train_rows, eval_rows, cfg.data.train_path


def synthetic_task(cfg: StageConfig):
    from posttrain.data.tasks import make_task
    task = make_task(cfg.data.synthetic, 2)
    task.build_eval(cfg.data.eval_size, 1234)
    return task


def load_reward_model_start(path: str | Path, resumed: bool = False):
    """A reward model to train: the body from `path`, a one-label score head initialised to
    zero (r = 0 for everything at the start); `resumed`: a checkpoint's, head included."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    if not resumed:
        torch.nn.init.zeros_(model.score.weight)
    return model


def _bradley_terry_step(st: _Stage, cfg: StageConfig, step: int, batch: list[int], scores,
                        chosen: list[list[int]]) -> None:
    """One reward-model optimizer step on a global batch of pairs (this rank's share):
    -log sigmoid(r_c - r_r), plus lm_coef x the next-token loss on the chosen responses."""
    from posttrain.losses import bradley_terry_loss
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
    logged["optim/lr"] = _step(st, loss * world.size)
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
    if cfg.reward_form == "log_ratio":
        # the Bradley-Terry loss on r = beta log pi/pi_ref is DPO's loss, term for term
        for name, unset in (("head_lr", None), ("lm_coef", 0.0), ("end_of_turn", False)):
            if getattr(cfg, name) != unset:
                raise ValueError(f"{name}={getattr(cfg, name)!r} applies to reward_form=score_head "
                                 "only (a log-ratio reward model has no score head)")
        return dpo(cfg, model, tokenizer, show_progress, as_reward_model=True, resume=resume)
    from posttrain.losses import pairwise_accuracy
    from posttrain.rewards.model import STATS_FILE, encode_responses, pair_scores

    fields = [cfg.data.prompt_field, cfg.data.chosen_field, cfg.data.rejected_field]
    train_rows, eval_rows, source = preference_rows(cfg)
    st = _start(cfg, model, tokenizer, fields, rows=train_rows, load=load_reward_model_start,
                resume=resume)
    tok, world = st.tokenizer, st.world
    st.model.config.pad_token_id = tok.pad_token_id
    if cfg.lm_coef > 0:
        from posttrain.rewards.model import tied_lm_head
        tied_lm_head(st.model)                # refuse an untied model before any training

    def encode(rows, heads: list[list[int]]):
        return (heads,
                encode_responses(tok, [str(r[cfg.data.chosen_field]) for r in rows], cfg.end_of_turn),
                encode_responses(tok, [str(r[cfg.data.rejected_field]) for r in rows], cfg.end_of_turn))

    def scores(idx, heads, chosen, rejected, chosen_nll=False):
        return pair_scores(st.model, [heads[i] for i in idx], [chosen[i] for i in idx],
                           [rejected[i] for i in idx], tok.pad_token_id, cfg.model.autocast, chosen_nll)

    eval_parts = encode(eval_rows, _encode(tok, cfg, [r[cfg.data.prompt_field] for r in eval_rows]))

    @torch.no_grad()
    def evaluate_pairs() -> dict[str, float]:
        st.model.eval()
        c, r = sharded_rows(lambda idx: scores(idx, *eval_parts)[:2], len(eval_rows), 32, world)
        st.model.train()
        out = {"rm/eval_accuracy": pairwise_accuracy(c, r).item(),
               "rm/eval_margin": (c - r).mean().item(),
               "_mean": torch.cat([c, r]).mean().item(), "_std": torch.cat([c, r]).std().item()}
        kinds = sorted({row.get("kind") for row in eval_rows if row.get("kind")})
        for kind in kinds:
            idx = torch.tensor([i for i, row in enumerate(eval_rows) if row.get("kind") == kind])
            out[f"rm/eval_accuracy@{kind}"] = pairwise_accuracy(c[idx], r[idx]).item()
        return out

    heads, chosen, rejected = encode(train_rows, st.prompts)    # prompts encoded by _start
    lengths = [len(h) + max(len(c), len(r)) for h, c, r in zip(heads, chosen, rejected)]
    batches = [b for _ in range(cfg.optim.epochs) for b in length_buckets(lengths, cfg.batch_size, st.rng)]
    st.schedule(cfg, len(batches))
    before = st.saved.get("eval_before")
    if before is None:
        before = _public(evaluate_pairs())
        st.logger.log(0, before)
    t_start = time.perf_counter()
    st.model.train()
    if (stopped := run_steps(st, cfg, batches,
                             lambda step, batch: _bradley_terry_step(
                                 st, cfg, step, batch,
                                 lambda mine: scores(mine, heads, chosen, rejected, cfg.lm_coef > 0),
                                 chosen),
                             lambda: {"eval_before": before}, "reward-model", show_progress)):
        return stopped
    train_minutes = (time.perf_counter() - t_start) / 60
    after = evaluate_pairs()
    st.logger.log(len(batches), _public(after))
    stats = json.dumps({"mean": after["_mean"], "std": after["_std"], "source": source,
                        "end_of_turn": cfg.end_of_turn})
    summary = {"run_dir": str(st.run_dir), "final_model": _finish(st, {STATS_FILE: stats}),
               "steps": len(batches), "train_pairs": len(train_rows), "eval_pairs": len(eval_rows),
               "train_minutes": train_minutes, "eval_before": before, "eval_after": _public(after)}
    _write_summary(st, summary)
    return summary


def generate(cfg, n: int, out: str | Path, samples: int = 1, only_correct: bool = True,
             model=None, tokenizer=None, demonstrate: bool = False) -> dict[str, Any]:
    """Teacher outputs for SFT (§8: a short SFT of the student on teacher outputs precedes
    distillation): `samples` episodes from each of the first `n` training problems of `cfg`'s
    task, greedy when samples == 1, written as JSONL rows {prompt, response, response_ids,
    answer, correct}. A multi-turn or tool task's rows hold the whole episode: `prompt` as chat
    messages, `response_ids` with the environment's messages in it and `policy_mask` (1 on the
    policy's tokens, which `sft` trains on). `demonstrate`: ground-truth episodes instead of the
    model's (envs: `demonstration`), e.g. calculator calls that teach a tool format before RL."""
    from posttrain.rewards import Scorer
    from posttrain.rollout import SamplingParams, episode_settings, make_engine
    from posttrain.rollout.episodes import run_episodes
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
    write_jsonl(out, rows)
    return {"written": len(rows), "generated": n * samples, "out": str(out)}


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


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
