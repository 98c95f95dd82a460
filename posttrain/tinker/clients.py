"""Each training client's own run folder, `RUN_DIR/clients/ID/`, laid out as a training run's, so
`posttrain view RUN_DIR/clients/*` and TensorBoard show a served session as they show `train`:

    config.json         the client's base model and LoRA settings
    metrics.jsonl       each forward_backward's and optim_step's numbers (`op/metric`) at the
                        client's step: the optimizer step its gradients go into (1 for those
                        before the first optim_step), as `train` numbers a step's batch and update
    tensorboard/        the same numbers
    tokens/step_N.parquet
                        the first `log_tokens` datums of the step's forward_backwards, token by
                        token, with the numbers the loss read (rl/token_records.py's columns):

        token_ids, tokens   the datum's target tokens (position t predicts target_t)
        logp                log pi_theta(target_t) in that forward_backward
        logp_sampler        the sampler's log-prob (`logprobs`: the RL losses' input)
        ratio               exp(logp - logp_sampler)
        adv                 the per-token weight: `advantages` (RL losses) or `weights` (cross_entropy)
        in_loss             1 where that weight is not 0

A served session has no rewards, answers or groups (its client scores its samples), so a record
carries none: the viewer shows the tokens without a verdict.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.logs.trackers import TRACKERS, TrackerContext, missing_package
from posttrain.rl.token_records import write_step
from posttrain.tinker.models import TrainingRun
from posttrain.tinker.revisions import safe
from posttrain.tinker.wire import ForwardBackward

LOG_TOKENS = 8   # datums recorded token by token a step and client (`tinker-serve --log_tokens`)


class ClientLogs:
    """The run folders of a server's training clients."""

    def __init__(self, run_dir: Path, tokenizer, log_tokens: int = LOG_TOKENS) -> None:
        self.root, self.tokenizer, self.log_tokens = run_dir / "clients", tokenizer, log_tokens
        self.trackers: dict[str, Any] = {}          # model id -> its TensorBoard writer
        self.tokens: dict[str, tuple[int, list[dict[str, Any]]]] = {}   # model id -> (step, rows)

    def folder(self, run: TrainingRun, base_model: str) -> Path:
        """The client's folder, made with its config.json the first time."""
        path = self.root / safe(run.model_id)
        if not path.is_dir():
            path.mkdir(parents=True)
            (path / "config.json").write_text(json.dumps(
                {"command": "tinker-serve", "model_id": run.model_id, "base_model": base_model,
                 "lora": run.lora}, indent=1))
        return path

    def log(self, run: TrainingRun, base_model: str, row: dict[str, Any]) -> None:
        """One forward_backward's or optim_step's row, as `op/metric` at the client's step (an
        optim_step's row: the step it took, or skipped; the next step's records start afresh)."""
        folder = self.folder(run, base_model)
        step = int(row.get("step", run.steps + 1))
        if row["op"] == "optim_step":
            self.tokens.pop(run.model_id, None)
        numbers = {f"{row['op']}/{k}": v for k, v in row.items()
                   if k not in ("op", "step") and isinstance(v, (int, float))}
        with (folder / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **numbers}) + "\n")
        tracker = self.trackers.get(run.model_id)
        if tracker is None and not missing_package("tensorboard"):
            ctx = TrackerContext(folder, run.model_id)
            tracker = self.trackers[run.model_id] = TRACKERS["tensorboard"](ctx)
        if tracker is not None:
            tracker.log(step, numbers)

    def record(self, run: TrainingRun, base_model: str, req: ForwardBackward, logp: list[Tensor]) -> None:
        """The step's first `log_tokens` datums token by token (tokens/step_N.parquet, rewritten
        as the step's forward_backwards arrive)."""
        step, rows = self.tokens.get(run.model_id, (run.steps + 1, []))
        for d, lp in zip(req.data, logp):
            if len(rows) >= self.log_tokens:
                break
            rows.append(datum_record(step, len(rows), req.loss_fn, d, lp, self.tokenizer))
        self.tokens[run.model_id] = (step, rows)
        if rows:
            write_step(self.folder(run, base_model), step, rows)

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()


def datum_record(step: int, row: int, loss_fn: str, d, logp: Tensor, tokenizer) -> dict[str, Any]:
    """A datum as the viewer's per-token record (see the module's docstring)."""
    targets = d.inputs["target_tokens"].reshape(-1).long().tolist()
    weight = d.inputs.get("advantages", d.inputs.get("weights"))
    weight = (weight.reshape(-1).float() if weight is not None else torch.ones(len(targets)))
    sampler = d.inputs.get("logprobs")
    rec: dict[str, Any] = {
        "step": step, "row": row, "group": row, "prompt": f"{loss_fn} datum ({len(targets)} positions)",
        "completion": tokenizer.decode(targets), "truncated": False, "length": len(targets),
        "updated": True, "token_ids": targets, "tokens": [tokenizer.decode([t]) for t in targets],
        "policy": [1] * len(targets), "in_loss": [int(w != 0) for w in weight.tolist()],
        "logp": logp.float().tolist(), "adv": weight.tolist(),
    }
    if sampler is not None:
        s = sampler.reshape(-1).float()
        rec["logp_sampler"] = s.tolist()
        rec["ratio"] = torch.exp(logp.float() - s).tolist()
    return rec
