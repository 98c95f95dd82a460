"""A Bradley-Terry reward model as a reward source (RLHF).  docs/algorithms.md §1.

The model is an `AutoModelForSequenceClassification` with one label: r(x, y) is the score head
on the last token of (chat-templated prompt + response). `posttrain reward-model` trains one
(stages.reward_model) and saves `reward_stats.json` beside it (mean and std of its scores on
held-out responses) so the trainer can normalise scores to about zero mean and unit spread.

A reward model trained with `--reward_form log_ratio` is a causal LM instead, read as DPO's
implicit reward r(x, y) = beta log pi(y|x) / pi_ref(y|x) (§9) against the reference its
reward_stats.json names: the same Bradley-Terry loss, a reward that sums over the response's tokens.

The reward model reads text, not the policy's token ids: the completion is decoded and
re-tokenised with the reward model's own tokenizer, so a reward model from another family works.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.data.tasks import Problem
from posttrain.model.loading import load_tokenizer

if TYPE_CHECKING:
    from posttrain.rollout.base import Rollout

log = logging.getLogger("posttrain")

STATS_FILE = "reward_stats.json"


def end_of_turn_ids(tokenizer) -> list[int]:
    """The tokens the chat template puts after an assistant message (SmolLM2: '<|im_end|>' and a
    newline); the EOS token without a template."""
    if tokenizer.chat_template is None:
        return [tokenizer.eos_token_id]
    marker = "\u2063posttrain\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": marker}], tokenize=False)
    suffix = text[text.index(marker) + len(marker):]
    return tokenizer(suffix, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]


def encode_parts(tokenizer, prompts: list[str], responses: list[str],
                 system_prompt: str | None = None, end_of_turn: bool = False
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the chat-templated prompt (with generation prompt) and of the response text,
    followed by the template's end-of-turn tokens if `end_of_turn` (the score is then read where
    a finished turn ends, as on any templated conversation)."""
    from posttrain.model.prompts import encode_prompts   # the policy's own prompt format
    heads = encode_prompts(tokenizer, [Problem(p, "") for p in prompts], system_prompt)
    return heads, encode_responses(tokenizer, responses, end_of_turn)


def encode_responses(tokenizer, responses: list[str], end_of_turn: bool = False) -> list[list[int]]:
    """Token ids of response texts as a reward model reads them (see encode_parts)."""
    tail = end_of_turn_ids(tokenizer) if end_of_turn else []
    return [tokenizer(r, add_special_tokens=False)["input_ids"] + tail for r in responses]


class PairScores(NamedTuple):
    chosen: Tensor                      # r(x, y_chosen) per pair
    rejected: Tensor                    # r(x, y_rejected) per pair
    chosen_nll: Tensor | None = None    # summed next-token NLL of each chosen response (if asked)


def _response_states(model, prompt_ids: list[list[int]], responses: list[list[int]],
                     group_size: int, pad_id: int, autocast: str) -> tuple[Tensor, Tensor]:
    """(hidden (b, T+1, H) predicting each response token and one step past the last, the padded
    response ids (b, T+1)), each prompt run once per group of `group_size` responses."""
    from posttrain.rollout.forward import response_hidden
    from posttrain.rollout.forward import pack
    # one dummy token after each response: the hidden state that "predicts" it is the one at
    # the response's last token, the one the score head reads
    rollout = replace(pack(_Pad(pad_id), [p for p in prompt_ids for _ in range(group_size)],
                           [t + [pad_id] for t in responses]), group_size=group_size)
    device = next(model.parameters()).device
    hidden = response_hidden(model.base_model, rollout.to(device), autocast=autocast)
    return hidden, rollout.response_ids_B_T.to(device)


def _score_last(model, hidden: Tensor, responses: list[list[int]]) -> Tensor:
    device = hidden.device
    last = torch.tensor([len(t) for t in responses], device=device)
    h_last = hidden[torch.arange(len(responses), device=device), last]
    with torch.autocast(device.type, enabled=False):
        return model.score(h_last.to(model.score.weight.dtype)).squeeze(-1).float()


def group_scores(model, prompt_ids: list[list[int]], responses: list[list[int]], group_size: int,
                 pad_id: int, autocast: str = "none") -> Tensor:
    """r(x, y) for groups of `group_size` responses to one prompt (responses of prompt i at rows
    i*G .. i*G+G-1), with each prompt run once (the trainer's prompt-shared forward). Equal to
    scoring each full sequence's last token; cheaper when the prompt is most of the tokens."""
    hidden, _ = _response_states(model, prompt_ids, responses, group_size, pad_id, autocast)
    return _score_last(model, hidden, responses)


def grouped_rollout(prompt_ids: list[list[int]], responses: list[list[int]], group_size: int,
                    pad_id: int, device: torch.device | str = "cpu") -> Rollout:
    """Groups of `group_size` responses to one prompt (responses of prompt i at rows
    i*G .. i*G+G-1) as a Rollout on `device`, the layout the trainer's forward reads."""
    from posttrain.rollout.forward import pack
    rollout = pack(_Pad(pad_id), [p for p in prompt_ids for _ in range(group_size)], responses,
                   device)
    return replace(rollout, group_size=group_size)


def log_ratio_scores(policy, reference, rollout: Rollout, beta: float, *,
                     autocast: str = "none") -> Tensor:
    """DPO's implicit reward as a reward model's score.  §9

        r(x, y) = beta * sum_t [ log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t) ]

    for each response of `rollout` (grouped_rollout: groups of responses to one prompt)."""
    from posttrain.rollout.forward import frozen_logprobs
    from posttrain.losses.common import sequence_logprob
    n = rollout.response_ids_B_T.shape[0]
    logp, ref_logp = (sequence_logprob(frozen_logprobs(m, rollout, 1.0, n, autocast),
                                       rollout.response_mask_B_T) for m in (policy, reference))
    return beta * (logp - ref_logp).float()


def tied_lm_head(model) -> Tensor:
    """The LM head's weight of a reward model's body: its input embedding, which a model with
    tie_word_embeddings uses as its output layer (AutoModelForSequenceClassification drops a
    separate LM head, so only tied models can keep predicting tokens)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"lm_coef > 0 needs a model whose LM head is its input embedding "
                         f"(tie_word_embeddings); this {model.config.model_type} model has a separate "
                         "head, which AutoModelForSequenceClassification does not load")
    return model.get_input_embeddings().weight


def pair_scores(model, prompt_ids: list[list[int]], chosen_ids: list[list[int]],
                rejected_ids: list[list[int]], pad_id: int, *, autocast: str = "none",
                chosen_nll: bool = False) -> PairScores:
    """r(x, y_chosen), r(x, y_rejected) for each pair, the prompt run once per pair; with
    `chosen_nll`, also -sum_t log p(y_chosen,t | x, y_chosen,<t) under the body's tied LM head."""
    tails = [t for pair in zip(chosen_ids, rejected_ids) for t in pair]   # c0, r0, c1, r1, ...
    hidden, ids = _response_states(model, prompt_ids, tails, 2, pad_id, autocast)
    scores = _score_last(model, hidden, tails)
    nll = None
    if chosen_nll:
        from posttrain.losses.common import token_logprobs
        lengths = torch.tensor([len(t) for t in chosen_ids], device=hidden.device)
        mask = torch.arange(ids.shape[1], device=hidden.device) < lengths[:, None]
        h = hidden[0::2][mask]                                  # chosen response positions only
        head = tied_lm_head(model)
        with torch.autocast(h.device.type, enabled=False):
            logits = h.to(head.dtype) @ head.T
        logp = token_logprobs(logits, ids[0::2][mask])
        nll = -torch.zeros(len(chosen_ids), device=h.device, dtype=logp.dtype).index_add(
            0, mask.nonzero()[:, 0], logp)
    return PairScores(scores[0::2], scores[1::2], nll)


def _group_size(prompts: list[str]) -> int:
    """G when the prompts come in equal runs of G identical ones (a rollout's groups), else 1."""
    if not prompts:
        return 1
    G = 1
    while G < len(prompts) and prompts[G] == prompts[0]:
        G += 1
    if len(prompts) % G or any(prompts[i] != prompts[i - i % G] for i in range(len(prompts))):
        return 1
    return G


class _Pad:
    """The one tokenizer attribute `pack` reads."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id


class RewardModel:
    """Scores (prompt, completion) texts with a trained reward model; no gradients."""

    def __init__(self, path: str | Path, normalize: bool = True, batch_size: int = 32,
                 autocast: str = "none", system_prompt: str | None = None) -> None:
        path = Path(path)
        self.tokenizer = load_tokenizer(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.batch_size, self.autocast, self.system_prompt = batch_size, autocast, system_prompt
        self.mean, self.std = 0.0, 1.0
        stats = path / STATS_FILE
        if normalize and not stats.is_file():
            raise FileNotFoundError(f"reward.model_normalize is on but {stats} is missing; "
                                    "set reward.model_normalize false or retrain the model")
        saved = json.loads(stats.read_text()) if stats.is_file() else {}
        self.form = saved.get("form", "score_head")
        self.reference = None
        if self.form == "log_ratio":
            from posttrain.model.loading import resolve_model_path
            self.beta, self.max_len = float(saved["beta"]), int(saved.get("max_len", 256))
            self.model = AutoModelForCausalLM.from_pretrained(path).eval()
            try:
                ref_path = resolve_model_path(saved["reference"])
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{stats}: the log-ratio reward model's reference "
                                        f"{saved['reference']!r} cannot be found ({e})") from e
            self.reference = AutoModelForCausalLM.from_pretrained(ref_path).eval()
            self.reference.requires_grad_(False)
        else:
            self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
        self.model.requires_grad_(False)
        if normalize:
            self.mean, self.std = float(saved["mean"]), max(float(saved["std"]), 1e-6)
        # read the response as the model was trained to (older models: without end-of-turn tokens)
        self.end_of_turn = bool(saved.get("end_of_turn", False))

    def to(self, device: torch.device | str) -> "RewardModel":
        """Place the reward model (and a log-ratio model's reference) on `device`: the trainer
        puts it beside the policy. Scores come back on the CPU either way."""
        self.model.to(device)
        if self.reference is not None:
            self.reference.to(device)
        return self

    def check_tokenizer(self, policy_tokenizer) -> None:
        """Say in the log when the reward model reads text differently from the policy."""
        from posttrain.model.loading import check_same_tokenizer
        try:
            check_same_tokenizer(policy_tokenizer, self.tokenizer)
        except ValueError as e:
            log.info("the reward model's tokenizer differs from the policy's (%s): completions are "
                     "decoded and re-tokenised with the reward model's tokenizer",
                     str(e).split(": ", 1)[-1].split(". On-policy")[0])
            return
        log.info("the reward model shares the policy's tokenizer")

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> Tensor:
        G = _group_size(prompts)     # a rollout's groups share their prompt: run it once
        step = max(self.batch_size // G, 1) * G
        out = []
        for i in range(0, len(prompts), step):
            heads, tails = encode_parts(self.tokenizer, prompts[i:i + step:G],
                                        completions[i:i + step], self.system_prompt,
                                        self.end_of_turn)
            if self.reference is not None:
                # the responses as the log-ratio model was trained on them: ending in EOS
                eos = self.tokenizer.eos_token_id
                tails = [t[:self.max_len - 1] + [eos] for t in tails]
                batch = grouped_rollout(heads, tails, G, self.tokenizer.pad_token_id,
                                        next(self.model.parameters()).device)
                out.append(log_ratio_scores(self.model, self.reference, batch, self.beta,
                                            autocast=self.autocast))
                continue
            out.append(group_scores(self.model, heads, tails, G, self.tokenizer.pad_token_id,
                                    self.autocast))
        scores = torch.cat(out) if out else torch.zeros(0)
        return (scores.cpu() - self.mean) / self.std
