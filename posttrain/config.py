"""Typed, validated configuration. Algorithms are presets: values of one `AlgorithmConfig`.

A config is built from (lowest to highest precedence) the dataclass defaults, the preset named by
`preset`, a YAML file, and `--section.field value` overrides. Every value is type-checked and
converted by pydantic (`_coerce`), every range and cross-field rule is checked here, before any
model is loaded, with an error naming the field.

Why pydantic under a small walk of our own rather than tyro: the same validation must serve the
YAML file, a resumed run's config.json and the command line, merged in that order onto
section defaults that differ by command (the stages' AdamW keeps torch's beta2 0.999); tyro parses
a command line onto one default and reports errors in a multi-line panel, where every error here
is one line naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import tokenize
import types
import typing
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import TypeAdapter, ValidationError

from posttrain.advantages import ADVANTAGES, NEEDS_GROUP, NEEDS_TEACHER, NEEDS_VALUES
from posttrain.errors import ConfigError  # noqa: F401 (re-exported: posttrain.config.ConfigError)
from posttrain.losses import (AGGREGATIONS, DISTILL_LOSSES, KL_ESTIMATORS, OFF_POLICY_CORRECTIONS,
                              POLICY_LOSSES, ObjectiveParams, objective_reads)


def did_you_mean(name: str, known) -> str:
    """'; did you mean X?' for the closest known name, or '' when none is close. A name without
    its section (--lr, --strategy) is matched on the last part: '--optim.lr', '--parallel.strategy'."""
    known = list(known)
    leaf = name.lstrip("-")
    if "." not in leaf:
        order = ("optim", "model", "data", "parallel", "rollout")
        exact = sorted((k for k in known if "." in k and k.rsplit(".", 1)[-1] == leaf),
                       key=lambda k: order.index(k.lstrip("-").split(".")[0])
                       if k.lstrip("-").split(".")[0] in order else len(order))
        if exact:
            return f"; did you mean {' or '.join(exact[:3])}?"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close and "." not in leaf:
        leaves = {k.rsplit(".", 1)[-1].lstrip("-"): k for k in reversed(known)}
        close = [leaves[c] for c in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)]
    return f"; did you mean {close[0]}?" if close else ""


def option_names(cls: type, prefix: str = "") -> list[str]:
    """Every `--section.field` a config dataclass accepts, as 'section.field' (algorithm: the
    AlgorithmConfig fields; mappings such as teacher.domains take any key below them)."""
    names = []
    for f in fields(cls):
        hint = _hint(cls, f.name)
        if dataclasses.is_dataclass(hint):
            names += option_names(hint, f"{prefix}{f.name}.")
        elif cls is TrainConfig and f.name == "algorithm":
            names += [f"algorithm.{g.name}" for g in fields(AlgorithmConfig)]
        else:
            names.append(f"{prefix}{f.name}")
    return names


def check_option_names(args: list[str], cls: type, flags: tuple[str, ...] = ()) -> None:
    """Refuse an option that is neither a config field of `cls` nor one of the command's own
    `flags`, naming the closest known one: a mistyped option never starts a job."""
    known = option_names(cls)
    mappings = {n for n in known if typing.get_origin(_hint_path(cls, n)) is dict
                or _hint_path(cls, n) is dict}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            key = arg[2:].split("=", 1)[0].replace("-", "_")
            ok = key in known or any(key.startswith(m + ".") for m in mappings)
            if not ok:
                everything = [f"--{n}" for n in known] + list(flags)
                raise ConfigError(f"unknown option --{arg[2:].split('=', 1)[0]}"
                                  f"{did_you_mean('--' + key, everything)} "
                                  "(every option: --help)")
            i += 1 if "=" in arg else 2
        else:
            i += 1


def _hint_path(cls: type, dotted: str) -> Any:
    hint: Any = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        if hint is TrainConfig and part == "algorithm":
            hint = AlgorithmConfig
            continue
        hint = _hint(hint, part)
    return hint


def _check_choice(where: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not valid; accepted: {sorted(choices)}")


def _check_range(where: str, value: float, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ConfigError(f"{where}={value!r} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}={value!r} must be <= {hi}")


def _check_checkpoint(c: "CheckpointConfig") -> None:
    _check_range("checkpoint.every_steps", c.every_steps, 0)
    if c.every_minutes is not None:
        _check_range("checkpoint.every_minutes", c.every_minutes, 0.0, lo_open=True)
    _check_range("checkpoint.keep", c.keep, 1)


@dataclass(frozen=True)
class AlgorithmConfig:
    """How a scored batch becomes a gradient: the parts of docs/algorithms.md §2-§8 to combine."""

    advantage: str = "group"            # key of advantages.ADVANTAGES
    scale_by_std: bool = True           # GRPO divides by the group std; Dr. GRPO does not (§7)
    eps: float = 1e-6                   # added to the std in the GRPO advantage
    # key of losses.POLICY_LOSSES: clipped (PPO/GRPO/DAPO), vanilla (REINFORCE), and the
    # others of docs/algorithms.md §3 and §11 (an unknown name is refused with the list)
    policy_loss: str = "clipped"
    clip_low: float = 0.2               # ratio may fall to 1 - clip_low (gmpo: log-ratio to -clip_low)
    clip_high: float = 0.2              # ratio may rise to 1 + clip_high (> clip_low: Clip-Higher)
    dual_clip: float | None = None      # bound on the loss of negative-advantage tokens (c > 1)
    sapo_tau_pos: float = 1.0           # sapo: gate temperature for positive advantages
    sapo_tau_neg: float = 1.05          # sapo: gate temperature for negative advantages
    cov_frac: float = 2e-4              # clip_cov / kl_cov: share of tokens picked by covariance
    cov_low: float = 1.0                # clip_cov: covariance band the detached tokens come from
    cov_high: float = 5.0               # clip_cov: upper end of that band
    kl_cov_coef: float = 1.0            # kl_cov: weight of |log pi - log pi_old| on the picked tokens
    entropy_coef: float = 0.0           # entropy bonus: minus coef x the entropy at each token
    aggregation: str = "seq_mean_token_mean"  # key of losses.AGGREGATIONS
    kl_in: Literal["loss", "reward", "none"] = "loss"  # where the KL to pi_ref goes (§5 vs §6)
    kl_estimator: str = "k3"            # key of losses.KL_ESTIMATORS
    kl_coef: float = 0.04               # beta; 0 builds no reference model at all
    dynamic_sampling: bool = False      # DAPO: refill the batch instead of training on all-equal groups
    max_refill_rounds: int = 4          # extra generation rounds dynamic sampling may use per step
    overlong: Literal["none", "filter", "shape"] = "none"  # DAPO truncated-response handling
    overlong_buffer: int = 8            # 'shape': tokens before the limit where the penalty ramps up
    overlong_penalty: float = 1.0       # 'shape': penalty reached at the limit
    gamma: float = 1.0                  # GAE discount (§5)
    lam: float = 0.95                   # GAE lambda (§5)
    whiten_advantages: bool = False     # PPO: (A - mean) / std over the batch's tokens (§5)
    reward_weight: float = 0.0          # distillation: mix in the verifiable reward's group advantage
    # distillation: 'sampled' = -(logp_S - logp_T) of the sampled tokens as a dense advantage
    # (cheap, any teacher); 'exact' = full-vocabulary reverse KL at every position as the loss
    # (lower variance, needs the teacher's logits in the update: one more forward per micro-batch);
    # 'forward' = full-vocabulary forward KL(teacher || student) at the student's positions, whose
    # gradient does not vanish where the student is confidently wrong; keeps more entropy (MOPD in
    # docs/distillation.md: no faster than 'exact' there)
    distill_loss: str = "sampled"       # key of losses.DISTILL_LOSSES

    def objective_params(self) -> ObjectiveParams:
        """The hyper-parameters the policy objectives read (losses.ObjectiveParams)."""
        return ObjectiveParams(
            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
            sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg, cov_frac=self.cov_frac,
            cov_low=self.cov_low, cov_high=self.cov_high, kl_cov_coef=self.kl_cov_coef)

    def validate(self, group_size: int) -> None:
        _check_choice("algorithm.advantage", self.advantage, ADVANTAGES.names())
        _check_choice("algorithm.policy_loss", self.policy_loss, POLICY_LOSSES.names())
        _check_choice("algorithm.aggregation", self.aggregation, AGGREGATIONS.names())
        _check_choice("algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS.names())
        _check_choice("algorithm.kl_in", self.kl_in, ("loss", "reward", "none"))
        _check_choice("algorithm.overlong", self.overlong, ("none", "filter", "shape"))
        _check_choice("algorithm.distill_loss", self.distill_loss, DISTILL_LOSSES.names())
        _check_range("algorithm.clip_low", self.clip_low, 0.0, 1.0)
        _check_range("algorithm.clip_high", self.clip_high, 0.0)
        _check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        _check_range("algorithm.entropy_coef", self.entropy_coef, 0.0)
        _check_range("algorithm.cov_frac", self.cov_frac, 0.0, 1.0, lo_open=True)
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            _check_range(f"algorithm.{name}", getattr(self, name), 0.0, lo_open=True)
        if self.kl_in == "loss" and self.kl_estimator == "k1" and self.kl_coef > 0:
            raise ConfigError("algorithm.kl_estimator='k1' with kl_in='loss': k1's gradient in the "
                              "loss is grad log pi, zero in expectation on-policy, so the penalty "
                              "would pull nowhere; use k2 or k3_st (gradient of KL(pi || pi_ref)), "
                              "k3 (GRPO's), or kl_in='reward'")
        _check_range("algorithm.eps", self.eps, 0.0)
        _check_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        _check_range("algorithm.lam", self.lam, 0.0, 1.0)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or null)")
        if self.kl_in == "reward" and self.advantage not in NEEDS_VALUES:
            raise ConfigError("algorithm.kl_in='reward' folds the KL into per-token rewards, which "
                              f"only a token-level estimator uses; advantage={self.advantage!r} "
                              "sees one score per response. Use kl_in='loss' or 'none'")
        needs_group = self.advantage in NEEDS_GROUP and (
            self.advantage != "group" or self.scale_by_std)
        if needs_group and group_size < 2:
            raise ConfigError(f"algorithm.advantage={self.advantage!r} compares the answers to one "
                              f"prompt: rollout.group_size={group_size} must be >= 2")
        if self.dynamic_sampling and self.advantage not in NEEDS_GROUP | {"group_mean"}:
            raise ConfigError("algorithm.dynamic_sampling drops groups whose rewards are all equal; "
                              f"it needs a group advantage, not {self.advantage!r}")


# docs/algorithms.md §2, §6, §7. Each preset is a `replace` of a few fields of GRPO.
GRPO = AlgorithmConfig()
PRESETS: dict[str, AlgorithmConfig] = {
    # REINFORCE with a batch-mean baseline: one on-policy update per batch, sum over the tokens.
    "reinforce": replace(GRPO, advantage="batch_mean", policy_loss="vanilla",
                         aggregation="seq_mean_token_sum", kl_in="none", kl_coef=0.0),
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline, PPO-style ratio clipping for reuse.
    "rloo": replace(GRPO, advantage="rloo", kl_in="none", kl_coef=0.0),
    # GRPO (Shao et al. 2024): group-normalised advantage, 1/|o_i| aggregation, k3 KL in the loss.
    "grpo": GRPO,
    # DAPO (Yu et al. 2025): token-mean, Clip-Higher, dynamic sampling, overlong shaping, no KL.
    "dapo": replace(GRPO, clip_high=0.28, aggregation="token_mean", kl_in="none", kl_coef=0.0,
                    dynamic_sampling=True, overlong="shape"),
    # Dr. GRPO (Liu et al. 2025): no std, constant length normaliser, no KL.
    "dr_grpo": replace(GRPO, scale_by_std=False, aggregation="seq_mean_token_sum_norm",
                       kl_in="none", kl_coef=0.0),
    # On-policy distillation (§8): the student samples, the teacher scores the same tokens, the
    # negated sampled reverse KL is a dense per-token advantage through the clipped PG loss.
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): a value model, GAE, per-token KL to pi_ref
    # folded into the reward (k1 = log pi_old - log pi_ref, the score on the last token),
    # whitened advantages, clipped surrogate over several epochs of minibatches (set in optim).
    "ppo": replace(GRPO, advantage="gae", kl_in="reward", kl_estimator="k1", kl_coef=0.05,
                   aggregation="token_mean", gamma=1.0, lam=0.95, whiten_advantages=True),
    "opd": replace(GRPO, advantage="reverse_kl", aggregation="token_mean", kl_in="none",
                   kl_coef=0.0),
    # The field's current objectives (docs/algorithms.md §11), on GRPO's group advantage, no KL.
    # GSPO (Zheng et al. 2025): sequence-level length-normalised ratio, clipped per sequence.
    "gspo": replace(GRPO, policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, kl_in="none", kl_coef=0.0),
    # CISPO (MiniMax-M1 2025): the clipped IS weight as a constant on every token's log-prob.
    "cispo": replace(GRPO, policy_loss="cispo", clip_low=1.0, clip_high=4.0, aggregation="token_mean",
                     kl_in="none", kl_coef=0.0),
    # SAPO (Gao et al. 2025): a soft sigmoid gate instead of the hard clip.
    "sapo": replace(GRPO, policy_loss="sapo", aggregation="token_mean", kl_in="none", kl_coef=0.0),
    # GMPO (Zhao et al. 2025): geometric mean of token ratios, log-ratio clip +-0.4.
    "gmpo": replace(GRPO, policy_loss="gmpo", clip_low=0.4, clip_high=0.4, kl_in="none", kl_coef=0.0),
    # TOPR (Le Roux et al. 2025): REINFORCE on good answers, truncated sequence IS on bad ones.
    "topr": replace(GRPO, policy_loss="topr", aggregation="seq_mean_token_sum", kl_in="none", kl_coef=0.0),
}


@dataclass(frozen=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # local HF folder, or the embedded 'smollm2-135m-instruct'
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"   # weights as loaded
    # bf16 autocast for the training forward/backward and the reference (LM head stays float32);
    # sampling runs in `dtype` unless rollout.autocast says otherwise. Faster on CPUs with
    # AVX512-BF16 and on GPUs.
    autocast: Literal["none", "bfloat16"] = "none"
    # attention kernel: 'auto' (transformers' choice, SDPA), 'sdpa' or 'eager' (plain matmuls;
    # on a 2-core CPU neither is faster for a whole step, docs/learning-per-step.md)
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    cache_dir: str | None = None        # where the embedded GGUF is converted once; None: user cache
    device: str = "auto"                # 'auto': the rank's GPU when there is one, else the CPU
    # recompute layer activations in backward instead of keeping them (less memory, ~30% more
    # compute; the training forward then runs prompt + response per row, without the shared cache)
    gradient_checkpointing: bool = False


@dataclass(frozen=True)
class TeacherConfig:
    # frozen teacher for distillation: a local folder, the embedded name, or 'self' = the student's
    # own current weights (no second copy in memory) seeing privileged context: OPSD (§8)
    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"   # the teacher's weights
    # the teacher's user message, e.g. "{prompt}\nThe reference answer is {answer}."; the student
    # sees only {prompt}. None: the teacher sees exactly the student's prompt.
    context_template: str | None = None
    # MOPD: one teacher per prompt domain (the data's `domain` field; task mixtures such as
    # 'addition+countdown' use the task names), e.g. {addition: runs/a/final_model, countdown: ...}
    domains: dict[str, str] = field(default_factory=dict)
    # the teacher's distribution is softmax(z_T / temperature); None: the sampling temperature.
    # Below it, the student is distilled toward a sharpened teacher (its modes, not its spread):
    # OPSD needs this when privileged context leaves the teacher unsure about style tokens.
    temperature: float | None = None

    def validate(self) -> None:
        if self.temperature is not None:
            _check_range("teacher.temperature", self.temperature, 0.0, lo_open=True)
        if self.domains and self.path:
            raise ConfigError("set either teacher.path (one teacher) or teacher.domains (one per "
                              "domain, MOPD), not both")
        if self.path == "self" and not self.context_template:
            raise ConfigError("teacher.path='self' (OPSD) needs teacher.context_template with the "
                              "privileged information: the same weights in the same context are no "
                              "teacher at all (the KL is 0)")
        if self.context_template is not None:
            try:
                shown = self.context_template.format(prompt="P", answer="A")
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(f"teacher.context_template={self.context_template!r} cannot be "
                                  f"filled: {e!r}; use the fields {{prompt}} and {{answer}}") from None
            if "P" not in shown:
                raise ConfigError(f"teacher.context_template={self.context_template!r} must contain "
                                  "{prompt}")


@dataclass(frozen=True)
class CriticConfig:
    """The value model of PPO (used by the 'gae' advantage; see posttrain/critic.py)."""

    shared_backbone: bool = False       # True: a scalar head on the policy's body (no second model)
    path: str | None = None             # separate critic from this folder; None: the policy's start
    lr: float = 1e-5                    # the value model's own learning rate
    vf_coef: float = 0.5                # weight of the value loss (matters when the body is shared)
    clip: float | None = 0.2            # value clipping around V_old (None: plain regression)
    max_grad_norm: float = 1.0          # gradient clipping of the value model
    warmup_steps: int = 0               # first steps train only the critic (policy frozen)

    def validate(self) -> None:
        _check_range("critic.lr", self.lr, 0.0)
        _check_range("critic.vf_coef", self.vf_coef, 0.0)
        _check_range("critic.warmup_steps", self.warmup_steps, 0)
        if self.clip is not None:
            _check_range("critic.clip", self.clip, 0.0, lo_open=True)
        if self.path is not None and self.shared_backbone:
            raise ConfigError("critic.path loads a separate value model; it cannot be combined "
                              "with critic.shared_backbone=true")
        if self.path is not None and not Path(self.path).is_dir():
            raise ConfigError(f"critic.path={self.path!r} is not a folder")


@dataclass(frozen=True)
class DataConfig:
    # built-in task ('addition', 'multiplication', 'countdown', 'guess_number', ...), 'file', or
    # 'reasoning_gym:NAME' (pip install 'posttrain[gym]'; its settings in task_options)
    task: str = "addition"
    difficulty: int = 2                 # task knob: digits per operand; numbers for countdown
    task_options: dict[str, Any] = field(default_factory=dict)   # reasoning_gym: the dataset's config
    train_size: int = 5000              # reasoning_gym: training problems generated
    eval_size: int = 200                # held-out problems (fixed seed, disjoint from training)
    eval_seed: int = 1234               # seed of the held-out set
    # a prompt not every answer of whose group was correct is asked again at the next step, up
    # to this many times (at most half of a step's prompts; Kimi k1.5's prioritised sampling)
    retry_unsolved: int = 0
    # which prompts: 'unsolved' (not every answer correct), 'mixed' (some but not all correct)
    retry_if: Literal["unsolved", "mixed"] = "unsolved"
    train_path: str | None = None       # task 'file': JSONL / CSV / Parquet file or datasets folder
    eval_path: str | None = None        # task 'file': held-out file; None splits eval_size off train
    prompt_field: str = "prompt"        # task 'file': the column holding the question
    answer_field: str = "answer"        # task 'file': the column holding the ground truth
    system_prompt: str | None = None    # None: the chat template's own system prompt
    chat_template: bool = True          # apply the tokenizer's chat template to prompts
    # extra arguments of the chat template, e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvConfig:
    """The environment of each episode (posttrain/envs, docs/environments.md): what answers the
    policy between its turns. Single-turn tasks have none beyond the verifier."""

    # 'auto': the task's own ('single_turn' for most; 'tools' when env.tools is set);
    # 'single_turn', 'tools', 'guess_number', or 'module:function' returning an Environment
    name: str = "auto"
    tools: tuple[str, ...] = ()         # tools offered: 'calculator', 'python' (a sandbox), 'module:function'
    tool_format: Literal["auto", "tag", "json"] = "auto"   # auto: json if the chat template takes tools
    max_turns: int = 4                  # policy turns per episode
    max_tokens: int = 256               # the whole episode's tokens (policy + environment)
    max_reply_tokens: int = 64          # an environment message is cut to this many tokens
    tool_timeout_s: float = 5.0         # a tool call running longer is answered with an error
    max_tool_calls_per_turn: int = 4    # tool calls one reply may make; calls past a cap get an error, not run
    max_tool_calls_per_episode: int = 16   # tool calls one episode may make in all
    tool_seconds_per_episode: float = 30.0   # tool time one episode may use in all
    tool_max_output: int = 2000         # characters of a python tool call's output kept
    # where the python tool runs the model's code (docs/safety.md): 'bwrap' (bubblewrap: own
    # namespaces, no network, no view of the trainer or the run folder), 'fallback' (own
    # session, limits, empty environment), 'auto' (bwrap where it can start)
    sandbox: Literal["auto", "bwrap", "fallback"] = "auto"
    python_memory_mb: int = 512         # address-space limit of the python tool's processes
    python_max_procs: int = 32          # processes the python tool may run at once

    def validate(self) -> None:
        for name in ("max_turns", "max_tokens", "max_reply_tokens", "python_memory_mb",
                     "max_tool_calls_per_turn", "max_tool_calls_per_episode", "tool_max_output",
                     "python_max_procs"):
            _check_range(f"env.{name}", getattr(self, name), 1)
        _check_range("env.tool_timeout_s", self.tool_timeout_s, 0.0, lo_open=True)
        _check_range("env.tool_seconds_per_episode", self.tool_seconds_per_episode, 0.0, lo_open=True)


@dataclass(frozen=True)
class RolloutConfig:
    # 'hf': in-process transformers sampling (exact pi_old, any device); 'vllm': a vLLM engine on
    # the same GPU or a `vllm serve` process (pip install posttrain[vllm]; rollout/vllm.py),
    # weights synced after every update
    backend: Literal["hf", "vllm"] = "hf"
    prompts_per_step: int = 8           # P prompts per generated batch
    group_size: int = 4                 # G responses per prompt
    max_new_tokens: int = 24            # response length limit (a longer answer is truncated)
    temperature: float = 1.0            # sampling temperature; log-probs are taken at it too
    top_p: float = 1.0                  # nucleus sampling (1: the full distribution)
    # in-process sampling under bf16 autocast (body bf16, LM head float32): its log-probs are not
    # the trainer's, and are corrected like vLLM's (tis_cap below); `weights` below is faster
    autocast: Literal["none", "bfloat16"] = "none"
    # 'shared': in-process sampling from the very weights the trainer updates; 'bfloat16': from a
    # bf16 copy of the transformer body (the LM head stays the policy's own, in float32), synced
    # after every update: decoding about 1.7x faster on CPUs with AVX-512 bf16. Its log-probs
    # then differ slightly from the trainer's and are corrected like vLLM's (tis_cap below).
    weights: Literal["shared", "bfloat16"] = "shared"
    stop: tuple[str, ...] = ()          # stop strings, also used by evaluation (e.g. "\n\n")
    # Another engine's log-probs differ from the trainer's for the same weights: each token's
    # policy-gradient term is weighted by `correction` below, capped at tis_cap (None: no
    # correction of any kind; the mismatch is logged either way). Used when the sampler is not
    # the trainer's float32 policy (off_trainer: vLLM, weights/autocast bfloat16, top_p < 1).
    tis_cap: float | None = 2.0
    # how another engine's samples are corrected (losses.OFF_POLICY_CORRECTIONS, docs §3):
    # token_tis (min(rho_t, tis_cap)), seq_tis (min(prod_t rho_t, tis_cap) per response),
    # token_mis / seq_mis (rho where it lies in is_band, else 0), icepop (1 inside is_band, 0 out)
    correction: str = "token_tis"
    is_band: tuple[float, float] = (0.5, 2.0)   # token_mis, seq_mis, icepop: ratios kept
    vllm_gpu_memory_utilization: float = 0.3   # share of the GPU vLLM may take (colocated)
    vllm_sleep: bool = True             # free vLLM's weights and KV cache while the trainer updates
    vllm_server: str | None = None      # 'http://host:port' of a `vllm serve`; None: colocated

    def validate(self) -> None:
        r = self
        for name in ("prompts_per_step", "group_size", "max_new_tokens"):
            _check_range(f"rollout.{name}", getattr(r, name), 1)
        _check_range("rollout.temperature", r.temperature, 0.0, lo_open=True)
        _check_range("rollout.top_p", r.top_p, 0.0, 1.0, lo_open=True)
        _check_range("rollout.vllm_gpu_memory_utilization", r.vllm_gpu_memory_utilization, 0.0,
                     1.0, lo_open=True)
        if r.tis_cap is not None:
            _check_range("rollout.tis_cap", r.tis_cap, 1.0)
        _check_choice("rollout.correction", r.correction, OFF_POLICY_CORRECTIONS.names())
        if not 0.0 <= r.is_band[0] <= 1.0 <= r.is_band[1]:
            raise ConfigError(f"rollout.is_band={list(r.is_band)} must be [lo, hi] with "
                              "0 <= lo <= 1 <= hi (ratios inside are kept)")
        if r.vllm_server is not None and not r.vllm_server.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.vllm_server={r.vllm_server!r} must be a URL such as "
                              "http://host:8000")

    @property
    def off_trainer(self) -> bool:
        """The sampler is not the trained weights in float32 themselves (another engine, a bf16
        copy, bf16 autocast while sampling, or a nucleus cut by top_p): its log-probs are not
        pi_old."""
        return (self.backend != "hf" or self.weights != "shared" or self.autocast != "none"
                or self.top_p < 1.0)


@dataclass(frozen=True)
class RewardConfig:
    verifier: Literal["math", "exact", "none"] = "math"  # how an answer is compared to the truth
    correct_reward: float = 1.0         # reward of a verified answer (0 for a wrong one)
    format_weight: float = 0.0          # extra reward for an answer in the expected format
    functions: tuple[str, ...] = ()     # user rewards as 'module:function' (added, weight 1 each)
    timeout_s: float = 5.0              # a reward call running longer gets the fallback
    # worker processes that run the verifier and the `functions` on the policy's answers (a hang
    # is killed at timeout_s, a crash or exit() is survived, calls run in parallel); 0: in the
    # trainer's process, where the timeout is a SIGALRM that the callee can cancel and a crash
    # ends the run (unsafe with answers a model wrote: for debugging only)
    workers: int = 2
    fallback: float = 0.0               # reward given when a function raises, hangs or returns NaN
    # a verifier, reward function, tool or environment that fails on most of its calls for this
    # many steps in a row stops the run with its first failure's traceback (0: never stop)
    max_failing_steps: int = 3
    # RLHF (§1): a Bradley-Terry reward model folder (`posttrain reward-model` writes one; any
    # AutoModelForSequenceClassification with one label works), added with weight model_weight.
    # Set correct_reward 0 to train on the model's score alone: accuracy is still measured.
    model: str | None = None
    model_weight: float = 1.0           # weight of the reward model's score in the reward
    model_normalize: bool = True        # (score - mean) / std with the stats saved at RM training
    model_batch_size: int = 32          # responses per reward-model forward

    def validate(self) -> None:
        _check_range("reward.workers", self.workers, 0)
        _check_range("reward.max_failing_steps", self.max_failing_steps, 0)
        _check_range("reward.timeout_s", self.timeout_s, 0.0, lo_open=True)
        if self.model is not None and not Path(self.model).is_dir():
            raise ConfigError(f"reward.model={self.model!r} is not a folder (train one with "
                              "`posttrain reward-model`)")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5                    # AdamW learning rate (the peak, with a schedule)
    weight_decay: float = 0.0           # AdamW decoupled weight decay
    beta1: float = 0.9                  # AdamW first-moment decay
    beta2: float = 0.99                 # AdamW second-moment decay
    warmup_steps: int = 0               # optimizer steps of linear warm-up
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # lr after warm-up (decays to 0 at the last step)
    max_grad_norm: float = 1.0          # gradient clipping (global norm)
    # a step whose loss or gradient norm is not finite is skipped (weights and Adam state
    # untouched); this many in a row stop the run (0: never stop)
    max_nonfinite_steps: int = 3
    epochs: int = 1                     # passes over each generated batch (>1 reuses samples, §3)
    minibatches: int = 1                # optimizer steps per pass
    micro_batch_size: int = 32          # responses per forward/backward (gradient accumulation)

    @property
    def single_update(self) -> bool:
        """One epoch of one minibatch: the policy cannot move between sampling and its update, so
        pi_old = pi_theta exactly (§3)."""
        return self.epochs == 1 and self.minibatches == 1

    def validate(self) -> None:
        """The ranges every command checks the same way (train adds how minibatches split a step)."""
        _check_range("optim.lr", self.lr, 0.0, lo_open=True)
        _check_range("optim.weight_decay", self.weight_decay, 0.0)
        for name in ("beta1", "beta2"):
            _check_range(f"optim.{name}", getattr(self, name), 0.0, 1.0)
        _check_range("optim.warmup_steps", self.warmup_steps, 0)
        _check_range("optim.max_grad_norm", self.max_grad_norm, 0.0, lo_open=True)
        _check_range("optim.max_nonfinite_steps", self.max_nonfinite_steps, 0)
        _check_range("optim.epochs", self.epochs, 1)
        _check_range("optim.minibatches", self.minibatches, 1)
        _check_range("optim.micro_batch_size", self.micro_batch_size, 1)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters through peft (rank 0: full fine-tuning). The reference policy is then the
    base model with the adapters switched off: no second copy of the weights."""

    rank: int = 0                       # adapter rank; 0: full fine-tuning
    alpha: float = 32.0                 # adapter scale alpha (the update is alpha / rank * B A)
    dropout: float = 0.0                # dropout on the adapters' input
    # the linear layers that get adapters
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                       "gate_proj", "up_proj", "down_proj")

    def validate(self) -> None:
        _check_range("lora.rank", self.rank, 0)
        _check_range("lora.dropout", self.dropout, 0.0, 1.0)
        if self.rank and not self.target_modules:
            raise ConfigError("lora.target_modules is empty: name the modules to adapt")


@dataclass(frozen=True)
class ParallelConfig:
    """Multi-process training under torchrun (see posttrain/distributed.py); ignored otherwise."""

    strategy: Literal["ddp", "fsdp"] = "ddp"   # replicate weights / shard them (FSDP2)


@dataclass(frozen=True)
class CheckpointConfig:
    """When a run saves a checkpoint for --resume (weights, optimizer, schedule, RNG, data
    position). Besides these, one is always written when SIGINT / SIGTERM stops a run (after the
    step in flight) and when max_minutes ends it."""

    every_steps: int = 0                # every N optimizer steps (0: not by steps)
    every_minutes: float | None = 5.0   # every M minutes of wall time (null: not by time)
    keep: int = 2                       # the newest K checkpoints are kept, older ones deleted


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "grpo"                # the algorithm: a key of PRESETS (reinforce, rloo, grpo, ...)
    algorithm: dict[str, Any] = field(default_factory=dict)  # field overrides on top of the preset
    model: ModelConfig = ModelConfig()
    teacher: TeacherConfig = TeacherConfig()
    critic: CriticConfig = CriticConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    env: EnvConfig = EnvConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoraConfig = LoraConfig()
    steps: int = 50                     # generated batches
    max_minutes: float | None = None    # stop training after this wall time (evaluation excluded)
    seed: int = 0                       # training prompts, sampling noise, minibatch order
    threads: int | None = None          # torch intra-op threads; None: torch's default
    run_dir: str | None = None          # None: runs/<preset>-<time>
    eval_every: int = 0                 # held-out greedy accuracy every N steps (0: before/after)
    eval_batch_size: int = 100          # held-out problems per generation batch
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_samples: int = 2                # completions printed per step with --verbose
    tensorboard: bool = True            # also write TensorBoard events when it is installed

    @property
    def algo(self) -> AlgorithmConfig:
        return replace(PRESETS[self.preset], **self.algorithm)

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size

    def validate(self) -> TrainConfig:
        _check_choice("preset", self.preset, PRESETS)
        known = {f.name for f in fields(AlgorithmConfig)}
        for k in self.algorithm:
            if k not in known:
                raise ConfigError(f"algorithm.{k} is not a field; known: {sorted(known)}"
                                  f"{did_you_mean(k, known)}")
        algo = self.algo
        for f in fields(AlgorithmConfig):
            _coerce(f"algorithm.{f.name}", getattr(algo, f.name), _hint(AlgorithmConfig, f.name))
        algo.validate(self.rollout.group_size)
        r, o = self.rollout, self.optim
        r.validate()
        if r.weights != "shared" and (r.backend != "hf" or r.autocast != "none"
                                      or self.parallel.strategy == "fsdp"):
            raise ConfigError(f"rollout.weights={r.weights!r} is a bf16 copy for the in-process "
                              "sampler: it needs rollout.backend=hf, rollout.autocast=none and "
                              f"parallel.strategy=ddp (got {r.backend!r}, {r.autocast!r}, "
                              f"{self.parallel.strategy!r}); or set rollout.weights=shared")
        if r.backend == "vllm" and self.lora.rank:
            raise ConfigError("rollout.backend='vllm' with LoRA (lora.rank > 0) is not supported "
                              "yet; use rollout.backend=hf")
        o.validate()
        if self.batch_size % o.minibatches or (self.batch_size // o.minibatches) % r.group_size:
            raise ConfigError(
                f"optim.minibatches={o.minibatches} must split the {self.batch_size} responses of a "
                f"step (prompts_per_step x group_size) into whole groups of {r.group_size}")
        if "old_logp" not in objective_reads(algo.policy_loss) and (o.epochs > 1 or o.minibatches > 1):
            raise ConfigError(f"algorithm.policy_loss={algo.policy_loss!r} reads no pi_old, so it is "
                              f"on-policy only: with optim.epochs={o.epochs}, optim.minibatches="
                              f"{o.minibatches} the later updates use stale samples; use 'clipped' "
                              "or a single update")
        if algo.overlong == "shape" and algo.overlong_buffer >= r.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer={algo.overlong_buffer} must be below "
                              f"rollout.max_new_tokens={r.max_new_tokens}")
        _check_range("steps", self.steps, 0)
        _check_range("data.eval_size", self.data.eval_size, 0)
        _check_range("data.retry_unsolved", self.data.retry_unsolved, 0)
        _check_choice("data.retry_if", self.data.retry_if, ("unsolved", "mixed"))
        for name, lo in (("eval_every", 0), ("eval_batch_size", 1), ("log_samples", 0)):
            _check_range(name, getattr(self, name), lo)
        if self.max_minutes is not None:
            _check_range("max_minutes", self.max_minutes, 0.0, lo_open=True)
        if self.threads is not None:
            _check_range("threads", self.threads, 1)
        _check_checkpoint(self.checkpoint)
        self.teacher.validate()
        self.critic.validate()
        self.lora.validate()
        if self.lora.rank and algo.advantage == "gae" and self.critic.shared_backbone:
            raise ConfigError("lora.rank > 0 with a value head on the shared body is not "
                              "supported; use a separate critic")
        self.reward.validate()
        self.env.validate()
        if self.env.max_tokens < r.max_new_tokens and (self.env.tools or self.env.name != "auto"):
            raise ConfigError(f"env.max_tokens={self.env.max_tokens} must be at least "
                              f"rollout.max_new_tokens={r.max_new_tokens} (one whole turn)")
        if algo.advantage in NEEDS_TEACHER and not (self.teacher.path or self.teacher.domains):
            raise ConfigError(f"algorithm.advantage={algo.advantage!r} distils from a teacher: "
                              "set teacher.path to a model folder (or teacher.domains)")
        if self.data.task == "file" and not self.data.train_path:
            raise ConfigError("data.task='file' needs data.train_path")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StageDataConfig:
    """Rows for sft / dpo / reward-model: a file, or rows made from a built-in task's ground truth."""

    train_path: str = ""                # JSONL / CSV / Parquet file or datasets folder
    eval_path: str = ""                 # held-out pairs file; default: eval_size pairs split off
    prompt_field: str = "prompt"        # the column holding the user message
    response_field: str = "response"    # sft: the column holding the answer
    chosen_field: str = "chosen"        # dpo, reward-model: the preferred answer
    rejected_field: str = "rejected"    # dpo, reward-model: the other answer
    system_prompt: str | None = None    # None: the chat template's own system prompt
    # pairs (dpo, reward-model) or answers (sft) from a built-in task instead of a file
    # ('addition', 'subtraction', 'arithmetic'), made from the ground truth
    synthetic: str = ""
    n_pairs: int = 2000                 # synthetic training pairs (sft: examples)
    # share of synthetic correct > wrong training pairs whose wrong answer is terse ("{c}", "The
    # answer is {c}.") whatever the correct one's wording: the answers a reward-hacking policy
    # drifts to (docs/ppo-rlhf.md: 0.5 kept RLHF from collapsing to bare numbers)
    terse_wrong_share: float = 0.0
    eval_size: int = 200                # held-out pairs (or problems) for the before/after figures


# what `posttrain train` uses of ModelConfig / OptimConfig and the stages do not (refused if set)
_TRAIN_ONLY = {"model": ("dtype", "device", "gradient_checkpointing"),
               "optim": ("minibatches", "micro_batch_size")}


@dataclass(frozen=True)
class StageConfig:
    """`posttrain sft | dpo | reward-model`: offline training on rows of a file (or synthetic ones).
    The sections and names are `posttrain train`'s (model.path, optim.lr, parallel.strategy, data.*)."""

    model: ModelConfig = ModelConfig()   # the starting model (path, autocast, attention)
    data: StageDataConfig = StageDataConfig()
    # AdamW with torch's own defaults (beta2 0.999, weight decay 0.01), as the stages always had
    optim: OptimConfig = OptimConfig(beta2=0.999, weight_decay=0.01)
    parallel: ParallelConfig = ParallelConfig()
    batch_size: int = 8                 # examples (or pairs) per optimizer step
    beta: float = 0.1                   # DPO / log-ratio reward model: the KL strength beta
    max_len: int = 256                  # response tokens kept per example
    seed: int = 0                       # batch order, synthetic rows, held-out split
    run_dir: str = "runs/stage"         # where config.json, metrics, summary.json and final_model/ go
    checkpoint: CheckpointConfig = CheckpointConfig()   # for --resume RUN_DIR
    # freeze the token embeddings and the first N decoder layers: backward stops at layer N, so
    # a step is cheaper and more pairs fit in the same time (reward-model: docs/ppo-rlhf.md)
    freeze_layers: int = 0
    head_lr: float | None = None        # reward-model: the score head's own lr (default: optim.lr)
    end_of_turn: bool = False           # reward-model: score after the template's end-of-turn tokens
    # reward-model: weight of a next-token loss on the chosen responses (through the tied LM
    # head), which keeps the body predicting the answer it should be checking
    lm_coef: float = 0.0
    # reward-model: what r(x, y) is. 'score_head': a scalar head on the last token, saved as an
    # AutoModelForSequenceClassification. 'log_ratio': beta * log pi(y|x) / pi_ref(y|x) summed
    # over the response, pi a causal LM trained with the same Bradley-Terry loss (DPO's implicit
    # reward, §9) and pi_ref the starting model: it reads the LM's own next-token predictions at
    # every answer digit, where a last-token head has to learn the sum afresh (docs/ppo-rlhf.md)
    reward_form: Literal["score_head", "log_ratio"] = "score_head"

    def validate(self) -> StageConfig:
        """Every range, before any model or data loads."""
        for section, names in _TRAIN_ONLY.items():
            default = getattr(StageConfig(), section)
            for name in names:
                if getattr(getattr(self, section), name) != getattr(default, name):
                    raise ConfigError(f"{section}.{name} applies to `posttrain train` only")
        o, d = self.optim, self.data
        o.validate()
        _check_range("data.n_pairs", d.n_pairs, 1)
        _check_range("data.eval_size", d.eval_size, 0)
        _check_range("data.terse_wrong_share", d.terse_wrong_share, 0.0, 1.0)
        if d.synthetic and d.synthetic not in ("addition", "subtraction", "arithmetic"):
            raise ConfigError(f"data.synthetic={d.synthetic!r} is not valid; accepted: "
                              "['addition', 'arithmetic', 'subtraction']")
        _check_range("batch_size", self.batch_size, 1)
        _check_range("max_len", self.max_len, 2)
        _check_range("beta", self.beta, 0.0, lo_open=True)
        _check_checkpoint(self.checkpoint)
        for name in ("freeze_layers", "lm_coef"):
            _check_range(name, getattr(self, name), 0)
        if self.head_lr is not None:   # (0: the head stays put)
            _check_range("head_lr", self.head_lr, 0.0)
        return self


# ---------------------------------------------------------------------------------------------
# Building a config from YAML and command-line overrides, with type checks
# ---------------------------------------------------------------------------------------------

def _hint(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


@functools.cache
def _adapter(hint: Any) -> TypeAdapter:
    return TypeAdapter(hint)


# pydantic's error kinds (the part of its error type before the first '_') in this project's words
_MESSAGES = {"float": "must be a number", "int": "must be an integer", "bool": "must be true or false",
             "string": "must be a string", "tuple": "must be a list", "list": "must be a list",
             "dict": "must be a mapping"}


def _coerce(where: str, value: Any, hint: Any) -> Any:
    """`value` checked against a type hint and converted, by pydantic's (lax) validation:
    strings from the command line parse ('1e-5', '3', 'true'), 3.5 is no integer. Before it: a
    bool is never taken for a number, 'none' / 'null' is None where None is allowed, and 'a,b'
    is a list. The error names the field and what it must be."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    optional = union and type(None) in typing.get_args(hint)
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):
        return None
    if isinstance(value, str) and any(typing.get_origin(m) is tuple for m in members):
        value = [v for v in value.split(",") if v]
    if isinstance(value, str) and any(typing.get_origin(m) is dict for m in members):
        try:   # a mapping from the command line: --data.chat_template_kwargs '{enable_thinking: false}'
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass   # (pydantic's error says it must be a mapping)
    literal = next((m for m in members if typing.get_origin(m) is Literal), None)
    if isinstance(value, bool) and bool not in members and literal is None:
        kinds = [k for m in members for k, t in (("float", float), ("int", int)) if m is t]
        if kinds:
            raise ConfigError(f"{where}={value!r} {_MESSAGES[kinds[0]]}")
    try:
        return _adapter(hint).validate_python(value)
    except ValidationError as e:
        if literal is not None:
            _check_choice(where, value, typing.get_args(literal))
        kinds = [err["type"].split("_")[0] for err in e.errors() if err["type"] != "none_required"]
        what = _MESSAGES.get(kinds[0] if kinds else "", e.errors()[0]["msg"].lower())
        raise ConfigError(f"{where}={value!r} {what}") from None


def build_config(cls: type, data: dict[str, Any], where: str, base: Any = None) -> Any:
    """`data` on top of `base` (default: cls()), every value type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {data!r}")
    base = cls() if base is None else base
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in known:
            raise ConfigError(f"{name} is not a config field; known: {sorted(known)}"
                              f"{did_you_mean(key, known)}")
        hint = _hint(cls, key)
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_config(hint, value, name, getattr(base, key))
        else:
            kwargs[key] = _coerce(name, value, hint)
    return replace(base, **kwargs)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """['--optim.lr', '1e-5', '--preset=dapo'] -> {'optim': {'lr': '1e-5'}, 'preset': 'dapo'}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(pairs):
        arg = pairs[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(pairs):
                raise ConfigError(f"--{key} needs a value")
            i += 1
            value = pairs[i]
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        # YAML scalars: numbers, booleans and null parse as such; everything else stays a string.
        try:
            parsed = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:   # e.g. "{prompt} ..." is not YAML, just a string
            parsed = value
        node[parts[-1]] = parsed if isinstance(parsed, (int, float, bool, type(None))) else value
        i += 1
    return out


@functools.cache   # (inspect.getsource parses the module each time: half a second per parser)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's description, read from the comments beside and above it in the dataclass's
    source (the one place they are written), for `--help`."""
    docs: dict[str, str] = {}
    pending: list[str] = []
    names = {f.name for f in fields(cls)}
    lines = inspect.getsource(cls).splitlines()
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
            continue
        name = stripped.split(":", 1)[0].strip()
        if name in names and ":" in stripped:
            comment = ""
            try:   # the comment token, so a '#' inside a default string is not taken for one
                for tok in tokenize.generate_tokens(io.StringIO(stripped + "\n").readline):
                    if tok.type == tokenize.COMMENT:
                        comment = tok.string.lstrip("# ")
            except tokenize.TokenError:   # a default that continues on the next line
                pass
            docs[name] = " ".join([*pending, comment]).strip()
        pending = []
    return docs


def options_help(cls: type, prefix: str = "", instance: Any = None) -> list[str]:
    """One line per option of a config dataclass: '--section.field (type, default): description'."""
    out = []
    docs = field_docs(cls)
    instance = cls() if instance is None else instance
    for f in fields(cls):
        hint = _hint(cls, f.name)
        if dataclasses.is_dataclass(hint):
            out += options_help(hint, f"{prefix}{f.name}.", getattr(instance, f.name))
            continue
        if cls is TrainConfig and f.name == "algorithm":
            out += options_help(AlgorithmConfig, "algorithm.")
            continue
        if typing.get_origin(hint) is Literal:
            kind = "|".join(map(str, typing.get_args(hint)))
        else:
            kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        out.append(f"  --{prefix}{f.name} ({kind}, default {getattr(instance, f.name)!r}): "
                   f"{docs.get(f.name, '')}".rstrip(": "))
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a mapping; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections")
    return loaded


def load_stage_config(path: str | Path | None = None, overrides: list[str] | None = None,
                      base: dict[str, Any] | None = None) -> StageConfig:
    """The SFT / DPO / reward-model config: defaults < `base` (a resumed run's config.json) <
    YAML file < overrides, type-checked."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = _merge(data, read_yaml(path))
    data = _merge(data, parse_overrides(overrides or []))
    return build_config(StageConfig, data, "").validate()


DEFAULT_RECIPE = "addition_grpo.yaml"   # what `posttrain train` runs without --config


def recipe_path(name: str = DEFAULT_RECIPE) -> Path:
    """A recipe packaged in posttrain/recipes (default: the default job's): load_config's `path`
    for running a recipe from Python as the command line does."""
    path = Path(str(resources.files("posttrain.recipes").joinpath(name)))
    if not path.is_file():
        known = sorted(p.name for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no packaged recipe {name!r}; known: {', '.join(known)}")
    return path


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults < `base` < YAML file < overrides; validated before anything expensive happens.
    `path=None` gives TrainConfig's own defaults, not the default job: pass `recipe_path()` for
    that recipe, as `posttrain train` does without --config."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = _merge(data, read_yaml(path))
    data = _merge(data, parse_overrides(overrides or []))
    return build_config(TrainConfig, data, "").validate()
