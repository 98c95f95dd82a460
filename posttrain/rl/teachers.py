"""Who scores the student's tokens in distillation (docs/algorithms.md §8).

One frozen teacher (any local model, e.g. an earlier checkpoint of the student), the student's own
current weights shown privileged context (OPSD), or one teacher per domain (MOPD). Teachers are
resolved and their tokenizers checked before the student is loaded; their weights are loaded on
first use, and two domains naming the same model share one copy.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from posttrain.util.errors import ConfigError
from posttrain.config.sections import TeacherConfig
from posttrain.model.loading import check_same_tokenizer, load_policy, load_tokenizer, resolve_model_path

SELF = "self"


class Teachers:
    def __init__(self, cfg: TeacherConfig, student_tokenizer, cache_dir: str | None = None,
                 preloaded=None) -> None:
        self.cfg = cfg
        self.routes: dict[str, str] = dict(cfg.domains) if cfg.domains else {"*": cfg.path}
        self._paths: dict[str, Path | str] = {}
        self._models: dict[str, torch.nn.Module] = {}
        self.student = None
        if preloaded is not None:              # tests and notebooks: one teacher object given
            self._models[cfg.path or "*"] = preloaded.eval().requires_grad_(False)
            self._paths[cfg.path or "*"] = cfg.path or "*"
        for name in set(self.routes.values()):
            if name == SELF or name in self._paths:
                continue
            path = resolve_model_path(name, cache_dir)
            check_same_tokenizer(student_tokenizer, load_tokenizer(path))
            self._paths[name] = path

    def bind_student(self, model) -> None:
        """OPSD scores with the live student weights (no copy, no gradient)."""
        self.student = model
        self.device = next(model.parameters()).device

    @property
    def loaded(self) -> int:
        return len(self._models)

    def model_for(self, domain: str):
        name = self.routes.get(domain, self.routes.get("*"))
        if name is None:
            raise ConfigError(f"no teacher for domain {domain!r}; teacher.domains names "
                              f"{sorted(self.routes)}")
        if name == SELF:
            return self.student
        if name not in self._models:
            self._models[name] = load_policy(self._paths[name], self.cfg.dtype).eval().requires_grad_(
                False).to(getattr(self, "device", "cpu"))
        return self._models[name]

    def response_logits(self, view, rows: Tensor, domains: list[str], autocast: str) -> Tensor:
        """Full-vocabulary teacher logits (b, T, V) of responses `rows` (whole groups) of `view`,
        each group from its domain's teacher: exact-KL distillation computes them micro-batch by
        micro-batch in the update instead of holding (B, T, V) for the whole batch."""
        from posttrain.rollout.forward import response_logits
        row_domains = [domains[int(r)] for r in rows]
        out = None
        for domain in sorted(set(row_domains)):
            sel = torch.tensor([k for k, d in enumerate(row_domains) if d == domain])
            sub = rows[sel]
            logits = response_logits(self.model_for(domain), view, sub, autocast=autocast)
            if out is None:
                out = logits.new_empty((len(rows), *logits.shape[1:]))
            out[sel] = logits
        return out

    def logprobs(self, view, domains: list[str], scorer) -> Tensor:
        """Teacher log-probs of every response in `view`, each group scored by its domain's teacher.

        `scorer(model, sub_view)` returns (b, T) log-probs for a row subset of whole groups.
        """
        G = view.group_size
        out = torch.zeros_like(view.logp_B_T)
        group_domains = domains[::G]
        for domain in sorted(set(group_domains)):
            groups = torch.tensor([i for i, d in enumerate(group_domains) if d == domain])
            rows = (groups[:, None] * G + torch.arange(G)).reshape(-1)
            sub = view.select(rows)
            logp = scorer(self.model_for(domain), sub)
            out[rows, :logp.shape[1]] = logp
        return out
