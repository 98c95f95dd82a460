"""A memory estimate printed before training, so a user knows whether a run fits before it starts.

Counted per rank, in bytes, from the model config and the run config (no allocation happens):
- policy weights, their gradients and AdamW's two moments (FSDP2 divides the decoder layers'
  share of all four by the number of ranks; the embeddings stay replicated);
- the frozen reference (when the KL is on), a teacher of the policy's size (distillation) and
  the sampler's bf16 copy (`rollout.weights bfloat16`);
- PPO's value model: a second set of weights, gradients and moments (none when it shares the body);
- generation's KV cache for P x G responses of prompt + max_new_tokens tokens;
- training activations of one micro-batch: 17 numbers per position, layer and hidden unit kept
  for backward in a Llama-style block (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models": 34 bytes in 16-bit; measured on SmolLM2-135M in float32, 16), for
  each group's prompt once and every response at its longest (env.max_tokens for episodes: an
  upper bound), plus four float32 copies of the head's logits (logits, log-softmax, their
  gradient, the entropy's softmax).
It is an estimate: allocator overhead, the Python process, tokenizer and libraries come on top
(the default run: 4.6 GiB estimated, 4.8 GB peak RSS; verifiers' kuhn_poker at the default recipe:
18.5 GiB estimated, every episode taken at env.max_tokens, and 10.2 GB peak RSS).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.commands import TrainConfig

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROMPT = 64   # tokens of a chat prompt (the estimate's guess; a prompt is run once per group)


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, float]          # name -> bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def table(self) -> str:
        rows = [f"  {name:<28} {value / 2**30:7.2f} GiB" for name, value in self.parts.items()]
        return "\n".join(["memory estimate per rank:", *rows,
                          f"  {'total':<28} {self.total / 2**30:7.2f} GiB"])


def estimate(cfg: TrainConfig, model_config, n_params: int, world_size: int = 1,
             lora_params: int | None = None, *, episodes: bool = False) -> MemoryEstimate:
    """`episodes`: the environment speaks between turns, so a response is a whole episode of
    up to env.max_tokens tokens."""
    algo = cfg.algo
    w = _BYTES[cfg.model.dtype]
    hidden = model_config.hidden_size
    layers = model_config.num_hidden_layers
    vocab = model_config.vocab_size
    embed = vocab * hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    body = max(n_params - embed, 0)
    shard = (world_size if cfg.parallel.strategy == "fsdp" else 1)
    per_rank = embed + body / shard                      # parameters this rank holds
    trainable = lora_params / shard if lora_params is not None else per_rank   # FSDP shards adapters too
    parts = {"policy weights": per_rank * w,
             "gradients": trainable * 4 if lora_params is not None else trainable * w,
             "AdamW moments (2)": trainable * 8}
    if algo.kl_in != "none" and algo.kl_coef > 0 and lora_params is None:
        parts["reference policy"] = n_params * w
    if algo.advantage == "reverse_kl" and cfg.teacher.path not in (None, "self"):
        parts["teacher (policy-sized)"] = n_params * _BYTES[cfg.teacher.dtype]
    if cfg.rollout.weights == "bfloat16":
        parts["bf16 sampler copy"] = n_params * 2
    if algo.advantage == "gae" and not cfg.critic.shared_backbone:
        parts["value model + grads + Adam"] = per_rank * (w + w + 8)   # sharded like the policy
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", heads) or heads
    head_dim = hidden // heads
    r = cfg.rollout
    batch = r.prompts_per_step * r.group_size // world_size
    width = max(r.max_new_tokens, cfg.env.max_tokens) if episodes else r.max_new_tokens
    tokens = PROMPT + width
    kv = 2 if r.weights == "bfloat16" else w             # the bf16 copy's cache is bf16 too
    parts["KV cache (generation)"] = batch * tokens * layers * 2 * kv_heads * head_dim * kv
    G = r.group_size                                     # (micro-batches of whole groups)
    groups = max(1, min(cfg.optim.micro_rows(PROMPT, width, G), batch) // G)
    micro, positions = groups * G, groups * (PROMPT + G * width)
    act = 2 if cfg.model.autocast == "bfloat16" else w
    parts["activations (1 micro-batch)"] = (positions * layers * hidden * 17 * act
                                            + micro * width * vocab * 4 * 4)
    return MemoryEstimate(parts)

