"""Sampling for a Tinker server: a revision's weights copied into a sampling adapter (one per LoRA
shape; the base model with adapters off), then posttrain's in-process engine (rollout/hf.py) draws
the samples and records each token's log-prob at the sampling temperature (at temperature 1: the
policy's own log-probs, those forward_backward computes for the same weights).

Tinker's sampling fields: max_tokens, temperature (0: greedy), top_p, seed, stop (strings, or
token ids that end a sample as EOS does). top_k other than -1 is refused in one line.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from posttrain.rollout.base import SamplingParams, seed_key
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.tinker.models import Models, lora_config
from posttrain.tinker.revisions import Revision
from posttrain.tinker.wire import Sequence, WireError

DEFAULT_MAX_TOKENS = 128
MAX_SAMPLES = 1024   # samples of one request


def sampling_params(fields: dict[str, Any]) -> tuple[SamplingParams, set[int]]:
    """posttrain's SamplingParams for Tinker's fields, and the stop token ids besides EOS."""
    if int(fields.get("top_k", -1)) != -1:
        raise WireError(f"sampling_params top_k={fields['top_k']}: only -1 (no top-k) is served")
    temperature = float(fields.get("temperature", 1.0))
    top_p = float(fields.get("top_p", 1.0))
    if temperature < 0 or not 0 < top_p <= 1:
        raise WireError(f"sampling_params temperature={temperature}, top_p={top_p}: "
                        "temperature >= 0 and 0 < top_p <= 1")
    stop = fields.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(isinstance(s, bool) or not isinstance(s, (str, int)) for s in stop):
        raise WireError(f"sampling_params stop={stop!r}: strings or token ids")
    strings = tuple(s for s in stop if isinstance(s, str))
    ids = {int(s) for s in stop if not isinstance(s, str)}
    n = int(fields.get("max_tokens") or DEFAULT_MAX_TOKENS)
    if n < 1:
        raise WireError(f"sampling_params max_tokens={n}: at least 1")
    return SamplingParams(max_new_tokens=n, temperature=temperature or 1.0, top_p=top_p,
                          greedy=temperature == 0, stop=strings), ids


def slot_for(models: Models, revision: Revision) -> str | None:
    """The sampling adapter holding `revision`'s weights (None: the base model)."""
    from peft import set_peft_model_state_dict
    if revision.lora is None:
        return None
    lora = revision.lora
    slot = "sample_r{}_{}{}{}".format(int(lora["rank"]), *(int(bool(lora.get(k, True))) for k in
                                      ("train_attn", "train_mlp", "train_unembed")))
    if models.peft is None:           # (no training client yet: a saved adapter sampled)
        from peft import get_peft_model
        models.peft = get_peft_model(models.base, lora_config(lora), adapter_name=slot).eval()
    elif slot not in models.peft.peft_config:
        models.peft.add_adapter(slot, lora_config(lora))
    set_peft_model_state_dict(models.peft, revision.state, adapter_name=slot)
    return slot


def sample_seeds(request: dict[str, Any], generator: torch.Generator) -> list[int]:
    """One seed per sample: from the request's `seed` (seed_key(seed, i)), else drawn from the
    server's generator. Each sample is a function of its seed alone (rollout/hf.py), whatever
    else shares its batch."""
    n = num_samples(request)
    seed = (request.get("sampling_params") or {}).get("seed")
    if seed is not None:
        return [seed_key(int(seed), i) for i in range(n)]
    return torch.randint(0, 2**62, (n,), generator=generator).tolist()


def num_samples(request: dict[str, Any]) -> int:
    n = int(request.get("num_samples", 1))
    if not 1 <= n <= MAX_SAMPLES:
        raise WireError(f"num_samples={n}: from 1 to {MAX_SAMPLES}")
    return n


def batch_key(request: dict[str, Any]) -> str:
    """Requests that can share one batch: the same sampling session and sampling settings."""
    fields = {k: v for k, v in (request.get("sampling_params") or {}).items() if k != "seed"}
    return json.dumps([request.get("sampling_session_id"), fields], sort_keys=True)


@torch.no_grad()
def sample(models: Models, revision: Revision, requests: list[dict[str, Any]],
           generator: torch.Generator) -> list[tuple[list[Sequence], list[float] | None]]:
    """Every request's `num_samples` continuations of its prompt, in one batch (the requests
    share a `batch_key`), and its prompt log-probs when asked (NaN at position 0)."""
    params, stop_ids = sampling_params(requests[0].get("sampling_params") or {})
    prompts = [prompt_tokens(r) for r in requests]
    seeds = [sample_seeds(r, generator) for r in requests]
    rows = [p for p, s in zip(prompts, seeds) for _ in s]
    with models.use(slot_for(models, revision)) as model:
        engine = HFRolloutEngine(model, models.tokenizer)
        engine.eos_ids |= stop_ids
        if (requests[0].get("sampling_params") or {}).get("stop") == []:
            engine.eos_ids = set()                # (Tinker: an empty list stops nowhere, not even at EOS)
        out = engine.generate(rows, 1, params, generator,
                              seeds=torch.tensor([k for s in seeds for k in s]))
        prompt_logp = [prompt_logprobs(model, p) if r.get("prompt_logprobs") else None
                       for p, r in zip(prompts, requests)]
    results, row = [], 0
    for s, logp in zip(seeds, prompt_logp):
        sequences = []
        for i in range(row, row + len(s)):
            keep = out.response_mask_B_T[i].bool()
            sequences.append(Sequence(out.response_ids_B_T[i][keep].tolist(),
                                      out.logp_B_T[i][keep].tolist(), not bool(out.truncated_B[i])))
        results.append((sequences, logp))
        row += len(s)
    return results


class HFSampler:
    """posttrain's in-process engine on the training model (the default sampler)."""

    def __init__(self, models: Models) -> None:
        self.models = models

    def __call__(self, revision: Revision, requests: list[dict[str, Any]],
                 generator: torch.Generator) -> list[tuple[list[Sequence], list[float] | None]]:
        return sample(self.models, revision, requests, generator)

    def close(self) -> None:
        pass


UNSERVED = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
            "target_prompt_logprobs", "prompt_logprobs_last_n")


def check_fields(request: dict[str, Any]) -> None:
    """The sample request's options this server does not compute, refused in one line."""
    asked = [k for k in UNSERVED if request.get(k) not in (None, 0, False)]
    if asked:
        raise WireError(f"sample: {', '.join(asked)} not served (tokens, their log-probs and "
                        "the prompt's log-probs are)")


def prompt_tokens(request: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for chunk in (request.get("prompt") or {}).get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise WireError(f"a prompt chunk of type {chunk.get('type')!r}: only encoded_text is served")
        tokens += [int(t) for t in chunk.get("tokens", [])]
    if not tokens:
        raise WireError("the prompt has no tokens")
    return tokens


def prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """log pi(x_t | x_<t) for t >= 1, NaN at t = 0."""
    from posttrain.losses.common import token_logprobs
    ids = torch.tensor([prompt])
    logits = model(input_ids=ids).logits[0, :-1].float()
    return [math.nan] + token_logprobs(logits, ids[0, 1:]).tolist()
