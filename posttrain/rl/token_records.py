"""Per-token records of a step (docs/viewer.md): for a few whole groups a step, every response
token with the numbers the update used on it, written to `tokens/step_NNNNNN.parquet` in the run
folder. `posttrain view` draws them token by token.

Per token (float32 lists, one per response; absent where the run has no such quantity):

    logp_sampler   log pi of the sampler (the rollout engine) at sampling time
    logp_old       log pi_old as the update read it (single update: pi_theta's own, detached)
    logp           log pi_theta at the update's last pass over the row
    ratio          exp(logp - logp_old)                                          §3
    clip           -1 / +1: the objective's clip removed the gradient on the low / high side  §5
    entropy        H(pi_theta(. | y_<t)) at that pass
    adv            A_t, as the loss read it (after any whitening)                §2, §5, §6
    logp_ref, kl_ref             log pi_ref and the KL estimator's value         §5
    logp_teacher, kl_teacher     the teacher's log-prob; log pi_old - log pi_teacher with pi_old
                                 as the advantage stage read it (batch.old_logp_B_T)   §8
    kl_teacher_exact             the full-vocabulary reverse KL (distill_loss exact / forward)
    value, return, gae_delta     V_old, the GAE return, r_t + gamma V_{t+1} - V_t      §5
    is_weight      the off-policy correction's weight (another engine sampled)   §3
    policy         1 on the policy's tokens, 0 on an environment's (tool results, feedback)
    in_loss        1 on the tokens the loss sees

Per response: the step, its row and group, prompt, answer, completion, reward, its parts,
correct, truncated, length, and `updated` (false for a group the update skipped because its
advantages were all 0: no forward ran on it, so logp / ratio / entropy are null).

Stored in Parquet (pyarrow, already installed by `datasets`): columnar and compressed, a few
kilobytes a step, and readable by pandas, DuckDB or `datasets` as well as by the viewer. Each step's file is written to a
temporary name and renamed, so a viewer reading a run that is still writing never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.sampling.batch import ScoredBatch
from posttrain.logs.metrics import TOKENS_DIR


def traced_rows(batch_size: int, group_size: int, n: int) -> list[int]:
    """The rows recorded each step: the first ceil(n / G) whole groups (a group shows what the
    advantage compares: the other answers to the same prompt), at most the batch."""
    n_groups = math.ceil(n / group_size) if n > 0 else 0
    return list(range(min(n_groups * group_size, batch_size)))


class TokenTrace:
    """Collects per-token values of the traced rows from the update's passes. A row seen several
    times (epochs, minibatches) keeps the values of its last pass: how far the policy had moved
    from pi_old, and what the clip did then. Tensors stay on their device until `write`."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = set(rows)
        self.values: dict[str, dict[int, Tensor]] = {}

    def record(self, rows: Tensor, **per_token: Tensor | None) -> None:
        """Keep each given (b, T) quantity for the traced rows among `rows` (b row indices)."""
        hits = [(j, r) for j, r in enumerate(rows.tolist()) if r in self.rows]
        if not hits:
            return
        for name, values in per_token.items():
            if values is not None:
                store = self.values.setdefault(name, {})
                for j, r in hits:
                    store[r] = values[j].detach().clone()

    def row(self, name: str, r: int, length: int) -> list[float] | list[int] | None:
        v = self.values.get(name, {}).get(r)
        if v is None:
            return None
        v = v[:length].cpu()
        return v.tolist() if not v.is_floating_point() else v.float().tolist()


def td_residuals(token_rewards_B_T: Tensor, values_B_T: Tensor, mask_B_T: Tensor,
                 gamma: float) -> Tensor:
    """GAE's one-step residuals (§5):  delta_t = r_t + gamma V_{t+1} - V_t,  V after the last
    token = 0 (the same recursion `advantages.gae` sums)."""
    v = values_B_T * mask_B_T
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    return (token_rewards_B_T + gamma * next_v - v) * mask_B_T


def batch_quantities(batch: ScoredBatch, gamma: float) -> dict[str, Tensor | None]:
    """The per-token quantities the batch itself carries (the stages before the update)."""
    deltas = None
    if batch.token_rewards_B_T is not None and batch.old_values_B_T is not None:
        deltas = td_residuals(batch.token_rewards_B_T, batch.old_values_B_T, batch.loss_mask_B_T, gamma)
    kl_teacher = None
    if batch.teacher_logp_B_T is not None:
        kl_teacher = (batch.old_logp_B_T - batch.teacher_logp_B_T) * batch.loss_mask_B_T
    return {"logp_sampler": batch.rollout.logp_B_T, "adv": batch.adv_B_T,
            "logp_ref": batch.ref_logp_B_T, "logp_teacher": batch.teacher_logp_B_T,
            "kl_teacher": kl_teacher, "value": batch.old_values_B_T, "return": batch.returns_B_T,
            "gae_delta": deltas}


def step_rows(step: int, batch: ScoredBatch, trace: TokenTrace, tokenizer,
              gamma: float = 1.0, version: int | None = None) -> list[dict[str, Any]]:
    """One record per traced response: its texts, reward, per-token lists, and the weight
    version that sampled it with its staleness against `version`, the weights trained (step
    numbers; without a version per response, the weights trained sampled it)."""
    version = step - 1 if version is None else version
    from_batch = batch_quantities(batch, gamma)
    ro, G = batch.rollout, batch.rollout.group_size
    policy = ro.policy_tokens_B_T
    out = []
    for r in sorted(trace.rows):
        if r >= len(batch.problems):
            continue
        length = int(ro.response_mask_B_T[r].sum())
        ids = ro.response_ids_B_T[r, :length].tolist()
        rec: dict[str, Any] = {
            "step": step, "row": r, "group": r // G, "prompt": batch.problems[r].prompt,
            "answer": str(batch.problems[r].answer),
            "completion": (batch.transcripts or batch.completions)[r],
            "reward": float(batch.rewards_B[r]), "correct": bool(batch.correct_B[r]),
            "truncated": bool(ro.truncated_B[r]), "length": length,
            "reward_parts": json.dumps(batch.reward_parts[r] if batch.reward_parts else {}),
            "updated": r in trace.values.get("logp", {}),
            "weight_version": sampled_by(batch, r, version),
            "staleness": version - sampled_by(batch, r, version),
            "token_ids": ids, "tokens": [tokenizer.decode([i]) for i in ids],
            "policy": [int(x) for x in policy[r, :length].tolist()],
            "in_loss": [int(x) for x in batch.loss_mask_B_T[r, :length].tolist()],
        }
        for name, values in from_batch.items():
            if values is not None:
                rec[name] = values[r, :length].float().cpu().tolist()
        for name in trace.values:
            rec[name] = trace.row(name, r, length)
        out.append(rec)
    return out


def sampled_by(batch: ScoredBatch, row: int, version: int) -> int:
    """The weight version that sampled response `row` (batch.version_B; else `version`)."""
    return version if batch.version_B is None else int(batch.version_B[row])


INT_LISTS = {"token_ids": "int32", "policy": "int8", "in_loss": "int8", "clip": "int8"}
SCALARS = {"step": "int32", "row": "int32", "group": "int32", "prompt": "string",
           "answer": "string", "completion": "string", "reward": "float32", "correct": "bool",
           "truncated": "bool", "length": "int32", "reward_parts": "string", "updated": "bool",
           "weight_version": "int32", "staleness": "int32"}


def schema(names: list[str]):
    """Column types: the per-token numbers as float32 (the precision the update computed them
    in), flags as int8, token texts as strings."""
    import pyarrow as pa
    col = {}
    for n in names:
        if n in SCALARS:
            col[n] = pa.type_for_alias(SCALARS[n])
        elif n == "tokens":
            col[n] = pa.list_(pa.string())
        else:
            col[n] = pa.list_(pa.type_for_alias(INT_LISTS.get(n, "float32")))
    return pa.schema(list(col.items()))


def write_step(run_dir: Path, step: int, rows: list[dict[str, Any]]) -> Path | None:
    """tokens/step_NNNNNN.parquet, atomically (a temporary name, then a rename)."""
    if not rows:
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = run_dir / TOKENS_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"step_{step:06d}.parquet"
    tmp = path.with_suffix(".parquet.tmp")
    names = list(dict.fromkeys(k for row in rows for k in row))
    table = pa.Table.from_pylist(rows, schema=schema(names))
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return path


def step_of(path: Path) -> int:
    return int(path.stem.split("_")[1])


def drop_after(run_dir: Path, step: int) -> None:
    """Remove the records of steps after `step` (a resumed run redoes them)."""
    folder = run_dir / TOKENS_DIR
    if folder.is_dir():
        for f in folder.glob("step_*.parquet"):
            if step_of(f) > step:
                f.unlink()
        for f in folder.glob("*.tmp"):
            f.unlink()
