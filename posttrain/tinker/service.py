"""What each Tinker route does, over the models (models.py), the sampler revisions and
checkpoints (revisions.py) and sampling (sampler.py). server.py turns HTTP into these calls;
the work runs on the worker (futures.py), one request at a time.

Ids have the shapes the SDK builds itself: a session `sess-N`, a training client
`SESSION:train:N`, a sampling session `SESSION:sample:N`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from posttrain.tinker.clients import LOG_TOKENS, ClientLogs
from posttrain.tinker.models import Models
from posttrain.tinker.revisions import (Revision, Revisions, folder_of, list_checkpoints,
                                        read_checkpoint, tinker_path, write_checkpoint)
from posttrain.tinker.sampler import (HFSampler, check_fields, num_samples, prompt_tokens,
                                      sampling_params)
from posttrain.tinker.wire import ForwardBackward, WireError, forward_backward_output, sample_response


class TinkerService:
    """The state of a Tinker server: sessions, training clients, sampler revisions."""

    def __init__(self, models: Models, run_dir: Path, seed: int = 0, log_tokens: int = LOG_TOKENS,
                 sampler=None) -> None:
        self.models, self.run_dir = models, run_dir
        self.sampling = sampler or HFSampler(models)   # (sampler.py; --sampler vllm: sampler_vllm.py)
        self.revisions = Revisions()
        self.sessions: dict[str, float] = {}         # session id -> last heartbeat (monotonic)
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self._sessions = 0
        self.instance = uuid.uuid4().hex[:8]    # (ids, and so checkpoint paths, never repeat across restarts)
        self.metrics = run_dir / "metrics.jsonl"
        self.clients = ClientLogs(run_dir, models.tokenizer, log_tokens)   # RUN_DIR/clients/ID/

    # -- answered at once (no future) ------------------------------------------------------
    def create_session(self) -> str:
        with self.lock:
            self._sessions += 1
            sid = f"sess-{self._sessions}-{self.instance}"
            self.sessions[sid] = time.monotonic()
            return sid

    def heartbeat(self, session_id: str) -> bool:
        if session_id not in self.sessions:
            return False
        self.sessions[session_id] = time.monotonic()
        return True

    def get_info(self, model_id: str) -> dict[str, Any]:
        run = self.models.run(model_id)
        return {"model_id": model_id, "type": "get_info", "is_lora": True,
                "lora_rank": int(run.lora["rank"]), "model_name": self.models.name,
                "model_data": {"arch": type(self.models.base).__name__,
                               "model_name": self.models.name,
                               "tokenizer_id": str(self.models.tokenizer.name_or_path)}}

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        """A sampling session on the base model or on saved sampler weights (a path)."""
        sid = f"{body.get('session_id')}:sample:{int(body.get('sampling_session_seq_id', 0))}"
        if body.get("model_path"):
            meta = json.loads((folder_of(self.run_dir, body["model_path"]) / "run.json").read_text())
            self.revisions.add(Revision(sid, self.models.name, meta["lora"], None, body["model_path"]))
        else:
            self.check_base(body.get("base_model"))
            self.revisions.add(Revision(sid, self.models.name, None, None))
        return sid

    def check_base(self, name: str | None) -> None:
        if name is not None and name not in self.models.names:
            raise WireError(f"base_model {name!r} is not served here; this server has "
                            f"{self.models.name!r} (posttrain tinker-serve --model.path)")

    def sampler(self, sampler_id: str) -> dict[str, Any]:
        r = self.revisions.get(sampler_id)
        return {"sampler_id": sampler_id, "base_model": r.base_model, "model_path": r.path}

    def checkpoints(self, model_id: str) -> dict[str, Any]:
        return {"checkpoints": list_checkpoints(self.run_dir, model_id)}

    # -- run by the worker -----------------------------------------------------------------
    def create_model(self, body: dict[str, Any], model_id: str) -> dict[str, Any]:
        self.check_base(body.get("base_model"))
        lora = dict(body.get("lora_config") or {})
        if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise WireError(f"optimizer_config {body['optimizer_config']}: only adamw is served")
        self.models.create(model_id, lora)
        self.models.model().eval()
        return {"model_id": model_id, "type": "create_model"}

    def forward_backward(self, reqs: list[ForwardBackward]) -> list[bytes | Exception]:
        """forward_backward (or forward) requests, of one client or several, as one batch; a
        request that fails its checks is answered with its error alone."""
        errors = [self.models.error_of(req) for req in reqs]
        good = [req for req, e in zip(reqs, errors) if e is None]
        results = iter(self.models.forward_backward(good) if good else [])
        out: list[bytes | Exception] = []
        for req, error in zip(reqs, errors):
            result = error if error is not None else next(results)
            out.append(result if isinstance(result, Exception) else self.answer(req, *result, len(good)))
        return out

    def answer(self, req: ForwardBackward, logp: list[torch.Tensor], metrics: dict[str, float],
               batch: int) -> bytes:
        self.log(req.model_id, {"op": "forward" if req.forward_only else "forward_backward",
                                "loss_fn": req.loss_fn, "datums": len(req.data),
                                "batched_with": batch - 1, **metrics})
        if not req.forward_only:
            self.clients.record(self.models.run(req.model_id), self.models.name, req, logp)
        return forward_backward_output(logp, metrics)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("optimizer_params") is not None:
            raise WireError("optim_step: only adam_params are served (AdamW)")
        step = self.models.run(body["model_id"]).steps + 1      # (the step taken, or skipped)
        metrics = self.models.optim_step(body["model_id"], body.get("adam_params") or {})
        self.log(body["model_id"], {"op": "optim_step", "step": step, **metrics,
                                    "lr": float((body.get("adam_params") or {}).get("learning_rate", 1e-4))})
        return {"metrics": metrics, "type": "optim_step"}

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """save_state: the adapter and its AdamW state."""
        run = self.models.run(body["model_id"])
        path = tinker_path(run.model_id, "weights", body.get("path") or f"step{run.steps}")
        self.check_new(path, bool(body.get("overwrite")))
        write_checkpoint(self.run_dir, path, self.adapter_state(run.adapter), self.meta(run),
                         run.optimizer.state_dict())
        return {"path": path, "type": "save_weights"}

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        """A sampler revision: named, written to disk too; unnamed, a sampling session at once."""
        run = self.models.run(body["model_id"])
        state = {k: v.detach().clone() for k, v in self.adapter_state(run.adapter).items()}
        out: dict[str, Any] = {"type": "save_weights_for_sampler"}
        if body.get("path"):
            out["path"] = tinker_path(run.model_id, "sampler_weights", body["path"])
            self.check_new(out["path"], True)
            write_checkpoint(self.run_dir, out["path"], state, self.meta(run))
            return out       # (a sampling session is made from the path when asked)
        session = run.model_id.split(":")[0]
        sid = f"{session}:sample:{int(body.get('sampling_session_seq_id', 0))}"
        out["sampling_session_id"] = sid
        self.revisions.add(Revision(sid, self.models.name, dict(run.lora), state))
        return out

    def check_new(self, path: str, overwrite: bool) -> None:
        from posttrain.tinker.revisions import PATH, safe
        m = PATH.match(path)
        if not overwrite and (self.run_dir / "tinker" / safe(m["run"]) / m["kind"] / m["name"]).exists():
            raise WireError(f"{path} exists: save under another name or with overwrite=True")

    def load_weights(self, body: dict[str, Any], model_id: str) -> dict[str, Any]:
        """A training client from a checkpoint (a new one, or the client named, in place)."""
        state, meta, opt = read_checkpoint(folder_of(self.run_dir, body.get("path", "")),
                                           bool(body.get("optimizer")))
        if model_id in self.models.runs:
            from peft import set_peft_model_state_dict
            run = self.models.run(model_id)
            if int(meta["lora"]["rank"]) != int(run.lora["rank"]):
                raise WireError(f"{body['path']} has LoRA rank {meta['lora']['rank']}, this "
                                f"client {run.lora['rank']}")
            set_peft_model_state_dict(self.models.peft, state, adapter_name=run.adapter)
            run.optimizer.zero_grad(set_to_none=True)      # (pending gradients were the old weights')
            if opt is None:                                # (weights only: Adam starts over)
                run.optimizer.state.clear()
        else:
            run = self.models.create(model_id, meta["lora"], state)
            self.models.model().eval()
        if opt is not None:
            run.optimizer.load_state_dict(opt)
        run.steps = int(meta.get("steps", 0))
        return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

    def check_sample(self, body: dict[str, Any]) -> int:
        """A sample request's fields, checked before it joins a batch; its number of samples."""
        self.revisions.get(body.get("sampling_session_id", ""))
        check_fields(body)
        params, _ = sampling_params(body.get("sampling_params") or {})
        length = len(prompt_tokens(body)) + params.max_new_tokens
        limit = getattr(self.models.base.config, "max_position_embeddings", None)
        if limit and length > limit:
            raise WireError(f"prompt + max_tokens = {length} tokens: over the model's {limit} positions")
        return num_samples(body)

    def asample(self, bodies: list[dict[str, Any]]) -> list[bytes]:
        """Sample requests that share a sampling session and settings, as one batch."""
        revision = self.revisions.get(bodies[0].get("sampling_session_id", ""))
        if revision.state is None and revision.lora is not None:   # (a saved path: read now)
            state, _, _ = read_checkpoint(folder_of(self.run_dir, revision.path), False)
            revision = dataclasses.replace(revision, state=state)
        return [sample_response(seqs, logp)
                for seqs, logp in self.sampling(revision, bodies, self.generator)]

    # -- helpers -----------------------------------------------------------------------------
    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict
        return get_peft_model_state_dict(self.models.peft, adapter_name=adapter,
                                         save_embedding_layers=False)

    def meta(self, run) -> dict[str, Any]:
        return {"model_id": run.model_id, "base_model": self.models.name, "lora": run.lora,
                "steps": run.steps}

    def log(self, model_id: str, row: dict[str, Any]) -> None:
        """A forward_backward's or optim_step's row in metrics.jsonl (every client's) and in the
        client's own run folder (clients.py)."""
        with self.metrics.open("a") as f:
            f.write(json.dumps({"time": time.time(), "model_id": model_id, **row}) + "\n")
        self.clients.log(self.models.run(model_id), self.models.name, row)

    def close(self) -> None:
        """The trackers' files closed and the sampler's engine stopped (the server stopped)."""
        self.clients.close()
        self.sampling.close()
