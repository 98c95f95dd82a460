"""In-process sampling with a transformers model and its KV cache.

Written as a short loop instead of `model.generate` for three reasons, each measurable on a CPU:
1. each prompt is prefilled once and its KV cache copied for its G responses (`generate` with
   `num_return_sequences` prefills every copy), and the prefix all prompts share runs once;
2. rows that emitted EOS leave the batch (their cache rows are dropped), so late steps only pay
   for responses still being written;
3. the log-prob of every sampled token is recorded from the same temperature-scaled distribution
   the trainer uses, so `pi_old` needs no second forward pass (docs/algorithms.md §3).
"""

from __future__ import annotations

import inspect
from copy import deepcopy

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.model.loading import decoder_and_head
from posttrain.model.prompts import after_shared_prefix, common_prefix_length, left_pad
from posttrain.rollout.base import Rollout, SamplingParams, seed_key
from posttrain.rollout.decoding import Decoding, Respond, Turns


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                               0x94D049BB133111EB))


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hash_uniform(seeds_B: Tensor, t: int) -> Tensor:
    """One Uniform(0, 1) number per row for step t, from a counter-based hash (splitmix64).

    Why not torch.Generator: one generator's draws depend on how rows are batched, so the samples
    would change with the batch composition, the micro-batching or the number of ranks. A number
    that is a pure function of (row seed, t) makes a response depend only on its own seed: a run
    on 2 ranks samples exactly the responses of the same run on 1 rank, and a resumed run needs
    no RNG state. Integer tensor ops, so it runs wherever the logits are (CPU or GPU).
    """
    x = seeds_B * _GOLDEN + torch.full_like(seeds_B, t + 1) * _MIX2   # wraps mod 2^64
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).double() + 0.5) / float(1 << 53)     # 53 bits, never 0 or 1


def row_seeds(seed: int, prompt_indices: list[int], group_size: int) -> Tensor:
    """One seed per response: a function of the run seed, the prompt's global index and g."""
    base = torch.tensor([seed_key(seed, i) * group_size for i in prompt_indices], dtype=torch.int64)
    return (base[:, None] + torch.arange(group_size)).reshape(-1)


def sample_next(logits_B_V: Tensor, params: SamplingParams, generator: torch.Generator | None,
                seeds_B: Tensor | None = None, t: int = 0) -> tuple[Tensor, Tensor]:
    """Draw one token per row; return (token_B, logp_B) with logp under the distribution it was
    drawn from: softmax(z / temperature), renormalised over the nucleus when top_p < 1 (as vLLM
    records it; the trainer then corrects for the difference, RolloutConfig.off_trainer).
    With `seeds_B`, the draw inverts the CDF at a hashed uniform (batch-invariant, hash_uniform)."""
    if params.greedy:
        tok = logits_B_V.argmax(-1)
        logp = torch.log_softmax(logits_B_V.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, logp
    logp_B_V = torch.log_softmax(logits_B_V.float() / params.temperature, dim=-1)
    probs = logp_B_V.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        logp_B_V = torch.log(probs / probs.sum(-1, keepdim=True))
    if seeds_B is not None:   # inverse CDF: the first token whose cumulative mass exceeds u
        cdf = probs.double().cumsum(-1)
        u = hash_uniform(seeds_B, t)[:, None] * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    else:
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp_B_V.gather(-1, tok[:, None]).squeeze(-1)


def stop_window(stop: tuple[str, ...]) -> int:
    """Tokens to decode to find a stop string the newest token completed: a byte-level token
    holds at least one byte, so a string of n UTF-8 bytes spans at most n tokens (+1 for one that
    decodes to nothing alone)."""
    return max(len(s.encode()) for s in stop) + 1


def cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version takes."""
    if hasattr(model, "get_base_model"):    # a peft (LoRA) wrapper forwards **kwargs to the model
        model = model.get_base_model()
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def bfloat16_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of `model` with bf16 parameters, for sampling only. Buffers keep their
    precision (the rotary frequencies: rounding them to bf16 would shift every position's angle).
    (The copy is made in full precision first: twice the model's size for a moment.)"""
    copy = deepcopy(model).requires_grad_(False).eval()
    buffers = dict(model.named_buffers())
    copy.to(torch.bfloat16)
    for name, _ in list(copy.named_buffers()):
        owner, _, attr = name.rpartition(".")
        copy.get_submodule(owner)._buffers[attr] = buffers[name].clone()
    return copy


class HFRolloutEngine:
    """Samples in-process with transformers.

    `weights='shared'`: from the very model object the trainer updates, so weights are always in
    sync and the recorded log-probs are pi_old. `autocast='bfloat16'`: the transformer body runs
    under bf16 autocast and the LM head in float32 on its output, as in the trainer's forward
    (rollout/forward.py), so the sampled distribution and the recorded log-probs are those of the policy
    the trainer computes.

    `weights='bfloat16'`: the body runs from a bf16 copy (`bfloat16_copy`, refreshed by
    `sync_weights` after every update) and the LM head is the policy's own, in float32. No weight
    is cast per decoding step, and the body's activations stay in bf16: on a 2-core AVX-512 CPU
    64 responses decode about 1.7x faster than in float32 (1.2x under autocast, measured in the
    training process). The log-probs are then the copy's, not pi_old: the trainer corrects for the
    difference as for vLLM (losses.correction.truncated_is_weights)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 autocast: str = "none", weights: str = "shared") -> None:
        if weights not in ("shared", "bfloat16"):
            raise ValueError(f"rollout.weights={weights!r} is not valid; accepted: ['shared', 'bfloat16']")
        self.policy = model
        self.model = model if weights == "shared" else bfloat16_copy(model)
        self.tokenizer = tokenizer
        self.autocast = autocast
        self.cache_kw = cache_kwarg(model)
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = {tokenizer.eos_token_id}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])

    runs_episodes = True   # (`generate` takes `respond=`: every turn through one KV cache)

    def close(self) -> None:
        """Nothing to stop: `generate` runs in the trainer's process."""

    def for_evaluation(self) -> "HFRolloutEngine":
        """Over the policy in its own precision, as a user's model.generate reads it (not the
        sampler's bf16 copy or autocast)."""
        return HFRolloutEngine(self.policy, self.tokenizer)

    @torch.no_grad()
    def sync_weights(self) -> None:
        """The bf16 copy takes the policy's updated weights (nothing to do when they are shared)."""
        if self.model is not self.policy:
            for copy, param in zip(self.model.parameters(), self.policy.parameters(), strict=True):
                copy.copy_(param)

    def _last_logits(self, **inputs) -> Tensor:
        """Logits at each row's last position, (B, V) float32."""
        if self.model is not self.policy:   # the bf16 copy's body, the policy's float32 head
            hidden = decoder_and_head(self.model)[0](**inputs).last_hidden_state[:, -1]
            return self.policy.get_output_embeddings()(hidden.float()).float()
        if self.autocast == "none":
            return self.model(**inputs, logits_to_keep=1).logits[:, -1]
        decoder, head = decoder_and_head(self.model)
        device_type = inputs["input_ids"].device.type
        with torch.autocast(device_type, dtype=torch.bfloat16):
            hidden = decoder(**inputs).last_hidden_state[:, -1]
        with torch.autocast(device_type, enabled=False):
            return head(hidden.float()).float()

    def _stop_hits(self, recent_b_k: Tensor, stop: tuple[str, ...]) -> Tensor:
        """Rows whose last few tokens decode to text containing a stop string."""
        texts = self.tokenizer.batch_decode(recent_b_k, skip_special_tokens=True)
        return torch.tensor([any(s in text for s in stop) for text in texts], dtype=torch.bool,
                            device=recent_b_k.device)

    @torch.no_grad()  # not inference_mode: the trainer reuses these tensors under autograd
    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams,
                 generator: torch.Generator | None = None, seeds: Tensor | None = None,
                 respond: Respond | None = None) -> Rollout:
        """`seeds` (one per response, see row_seeds) make every response a function of its own
        seed only; without them sampling draws from `generator`.

        `respond` makes each response an episode of several turns (rollout/episodes.py): when a
        row's turn ends (EOS, a stop string, or `max_new_tokens` tokens in the turn),
        `respond(row, turn_ids, reason)` returns the tokens the environment writes next (they are
        fed through the same KV cache, one per step beside the other rows' sampled tokens, and
        get policy mask 0), or None to end the episode. The whole episode holds at most
        `params.max_episode_tokens` tokens."""
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        G = group_size
        ids_P_L, mask_P_L = (x.to(device) for x in left_pad(prompts, self.pad_id))
        cache, logits, attn, next_pos = self._prefill(ids_P_L, mask_P_L, G)
        B = logits.shape[0]
        T = params.max_new_tokens if respond is None else max(params.max_episode_tokens or 0,
                                                               params.max_new_tokens)
        row_seed = seeds.to(device) if seeds is not None else None
        turns = Turns(B, T, device) if respond is not None else None
        state = Decoding.start(T, self.pad_id, self.eos_ids, cache, attn, next_pos, turns=turns)
        self._decode(logits, state, params, generator=generator, row_seed=row_seed, respond=respond)
        model.train(was_training)
        return self._rollout(ids_P_L, mask_P_L, G, state)

    def _decode(self, logits: Tensor, state: Decoding, params: SamplingParams, *,
                generator: torch.Generator | None = None, row_seed: Tensor | None = None,
                respond: Respond | None = None) -> None:
        """Token by token from the prefilled cache (`logits`: the first step's), into `state`:
        sample, end the rows that finish (dropping them from the cache), feed the rest."""
        T = state.tokens.shape[1]
        for t in range(T):
            active = state.active
            tok, logp = sample_next(logits, params, generator,
                                    row_seed[active] if row_seed is not None else None, t)
            if state.turns is not None:
                tok, logp = state.turns.force(active, tok, logp, t)
            state.tokens[active, t] = tok
            state.logps[active, t] = logp
            done = self._ends_now(state, tok, t, params, respond)
            if done.any():
                state.lengths[active[done]] = t + 1
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                tok = tok[keep]
                state.keep(keep)
            if t == T - 1:
                if state.turns is not None:
                    state.turns.cut_by_budget(state.active, t, state.tokens, respond)
                break
            state.attn = torch.cat([state.attn, state.attn.new_ones(state.attn.shape[0], 1)], dim=1)
            logits = self._last_logits(input_ids=tok[:, None], attention_mask=state.attn,
                                       position_ids=state.next_pos[:, None], use_cache=True,
                                       **{self.cache_kw: state.cache})
            state.next_pos = state.next_pos + 1

    def _ends_now(self, state: Decoding, tok: Tensor, t: int, params: SamplingParams,
                  respond: Respond | None = None) -> Tensor:
        """Which active rows end with token `tok` at step `t`: EOS, a stop string (recorded in
        `state.stopped`), or, in an episode, a turn after which the environment ends it."""
        active, turns = state.active, state.turns
        done = torch.isin(tok, state.eos)
        if params.stop:
            window = state.tokens[active, max(0, t + 1 - stop_window(params.stop)):t + 1]
            if turns is not None:    # only this turn's own tokens can complete a stop string
                window = turns.this_turn(window, active, t, self.pad_id)
            hit = self._stop_hits(window, params.stop)
            state.stopped[active[hit]] = True
            done |= hit
        if turns is not None:
            done = turns.end_turns(active, done, t, state.tokens, params.max_new_tokens, respond)
        return done

    def _rollout(self, ids_P_L: Tensor, mask_P_L: Tensor, G: int, state: Decoding) -> Rollout:
        """The sampled rows cut to the longest, masked past each row's length."""
        tokens, lengths, turns = state.tokens, state.lengths, state.turns
        device = tokens.device
        width = int(lengths.max())
        mask_B_T = (torch.arange(width, device=device)[None, :] < lengths[:, None]).float()
        if turns is None:
            rows = torch.arange(tokens.shape[0], device=device)
            truncated = ~(torch.isin(tokens[rows, lengths - 1], state.eos) | state.stopped)
        return Rollout(
            prompt_ids_B_L=ids_P_L.repeat_interleave(G, 0),
            prompt_mask_B_L=mask_P_L.repeat_interleave(G, 0),
            response_ids_B_T=tokens[:, :width].masked_fill(mask_B_T == 0, self.pad_id),
            response_mask_B_T=mask_B_T,
            logp_B_T=state.logps[:, :width] * mask_B_T,
            truncated_B=truncated if turns is None else turns.truncated,
            group_size=G,
            policy_mask_B_T=None if turns is None else turns.policy_B_T[:, :width] * mask_B_T,
        )

    def _prefill(self, ids_P_L: Tensor, mask_P_L: Tensor, G: int):
        """The prompts' KV cache, computed once and shared by each group of G responses, and the
        (B, V) logits, (B, L') attention mask and (B,) next positions of the first sampling step.

        The leading tokens every prompt shares (a chat template's system turn: 27 of the default
        task's 40 prompt tokens) run once as a single row and their cache is copied to every
        prompt, as vLLM's prefix caching does: 16 prompts prefill 27 + 16 x 13 tokens instead of
        16 x 40."""
        P, L = ids_P_L.shape
        k = common_prefix_length(ids_P_L, mask_P_L)
        cache = DynamicCache()
        if k:
            prefix, cut, mask = after_shared_prefix(ids_P_L, mask_P_L, k)
            self._last_logits(input_ids=prefix, use_cache=True,
                              position_ids=torch.arange(k, device=ids_P_L.device)[None],
                              **{self.cache_kw: cache})
            cache.batch_repeat_interleave(P)
        else:
            cut, mask = 0, mask_P_L
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._last_logits(input_ids=ids_P_L[:, cut:], attention_mask=mask,
                                   position_ids=pos[:, mask.shape[1] - (L - cut):], use_cache=True,
                                   **{self.cache_kw: cache})
        cache.batch_repeat_interleave(G)
        return (cache, logits.repeat_interleave(G, 0), mask.repeat_interleave(G, 0),
                pos[:, -1].repeat_interleave(G, 0) + 1)
