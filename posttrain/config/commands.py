"""Typed, validated configuration: the commands' configs, built of the sections (config/sections.py: one
frozen dataclass per section, each checking its own ranges): `TrainConfig` for `train`, `eval` and
`generate`, `StageConfig` for `sft`, `dpo` and `reward-model`, whose `validate` adds the rules
across sections. Every check runs before any model is loaded, with an error naming the field. The
algorithm is a preset (config/presets.py); building a config from YAML and the command line is
config/options.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from posttrain.losses.advantages import NEEDS_TEACHER
from posttrain.util.checks import check_choice, check_range, coerce, did_you_mean, type_hint
from posttrain.util.errors import ConfigError  # noqa: F401 (re-exported: posttrain.config.commands.ConfigError)
from posttrain.losses.policy import objective_reads
from posttrain.config.presets import PRESETS, AlgorithmConfig
from posttrain.config.env import EnvConfig
from posttrain.config.sections import (CheckpointConfig, CriticConfig, DataConfig, LoraConfig,
                                ModelConfig, OptimConfig, ParallelConfig, RewardConfig,
                                StageDataConfig, TeacherConfig, check_trackers)
from posttrain.config.rollout import RolloutConfig


@dataclass(frozen=True)
class RunOptions:
    """The options every command that runs a model takes, checked once here (train, sft, dpo,
    reward-model, eval, generate, experiment; `--resume` and `--no-progress` are flags of the
    command line beside them)."""

    seed: int = 0                       # training prompts, sampling noise, batch order, held-out split
    # where config.json, metrics and summary.json go (None: runs/<name>-<time>; eval and
    # generate: 'none' writes no folder)
    run_dir: str | None = None
    threads: int | None = None          # torch intra-op threads; None: torch's default
    # stop training (eval, generate: sampling) after this wall time, evaluation excluded; a trained
    # run then finishes as at the end, with a checkpoint a longer --max_minutes continues from
    max_minutes: float | None = None
    checkpoint: CheckpointConfig = CheckpointConfig()   # when to save (for --resume RUN_DIR)
    # trackers beside metrics.jsonl, comma-separated: wandb, trackio, mlflow, tensorboard (each an
    # optional extra, e.g. pip install "posttrain[wandb]"; offline unless configured: logs/trackers.py)
    report_to: tuple[str, ...] = ()

    def check_run_options(self) -> None:
        """The common options' ranges (each command's `validate` calls this first)."""
        self.checkpoint.validate()
        if self.max_minutes is not None:
            check_range("max_minutes", self.max_minutes, 0.0, lo_open=True)
        if self.threads is not None:
            check_range("threads", self.threads, 1)
        if not self.writes_folder and self.report_to:   # (before asking whether they are installed)
            raise ConfigError(f"--report_to {','.join(self.report_to)} with --run_dir none: the "
                              "trackers write beside a run folder; drop one of the two")
        check_trackers(self.report_to)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def writes_folder(self) -> bool:
        """False for `--run_dir none` (eval and generate: print, write no run folder); None, the
        default, is a folder of its own, runs/<name>-<time>."""
        return not (isinstance(self.run_dir, str) and self.run_dir.lower() == "none")


@dataclass(frozen=True)
class TrainConfig(RunOptions):
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
    eval_every: int = 0                 # held-out greedy accuracy every N steps (0: before/after)
    eval_batch_size: int = 100          # held-out problems per generation batch
    log_samples: int = 2                # completions printed per step with --verbose
    # responses a step whose per-token numbers are recorded (tokens/*.parquet, `posttrain view`;
    # whole groups; 0: none)
    log_tokens: int = 8
    tensorboard: bool = True            # also write TensorBoard events when it is installed

    @property
    def algo(self) -> AlgorithmConfig:
        return replace(PRESETS[self.preset], **self.algorithm)

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size

    def validate(self) -> TrainConfig:
        """Each section checks its own ranges; then the rules that tie sections together."""
        self.check_run_options()
        algo = self._checked_algorithm()
        for section in (self.rollout, self.optim, self.data, self.teacher,
                        self.critic, self.lora, self.reward, self.env):
            section.validate()
        check_range("steps", self.steps, 0)
        for name, lo in (("eval_every", 0), ("eval_batch_size", 1), ("log_samples", 0),
                         ("log_tokens", 0)):
            check_range(name, getattr(self, name), lo)
        self._check_sampling(algo)
        self._check_updates(algo)
        self._check_models(algo)
        return self

    def _checked_algorithm(self) -> AlgorithmConfig:
        """The preset with `algorithm` overrides applied, every field type-checked and validated."""
        check_choice("preset", self.preset, PRESETS)
        known = {f.name for f in fields(AlgorithmConfig)}
        for k in self.algorithm:
            if k not in known:
                raise ConfigError(f"algorithm.{k} is not a field; known: {sorted(known)}"
                                  f"{did_you_mean(k, known)}")
        algo = self.algo
        for f in fields(AlgorithmConfig):
            coerce(f"algorithm.{f.name}", getattr(algo, f.name), type_hint(AlgorithmConfig, f.name))
        algo.validate(self.rollout.group_size)
        return algo

    def _check_sampling(self, algo: AlgorithmConfig) -> None:
        """The sampler against the trainer: a bf16 copy, vLLM with LoRA, episode turns."""
        r = self.rollout
        if r.weights != "shared" and (r.backend != "hf" or r.autocast != "none"
                                      or self.parallel.strategy == "fsdp"):
            raise ConfigError(f"rollout.weights={r.weights!r} is a bf16 copy for the in-process "
                              "sampler: it needs rollout.backend=hf, rollout.autocast=none and "
                              f"parallel.strategy=ddp (got {r.backend!r}, {r.autocast!r}, "
                              f"{self.parallel.strategy!r}); or set rollout.weights=shared")
        if r.backend == "vllm" and self.lora.rank:
            raise ConfigError("rollout.backend='vllm' with LoRA (lora.rank > 0) is not supported "
                              "yet; use rollout.backend=hf")
        if algo.overlong == "shape" and algo.overlong_buffer >= r.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer={algo.overlong_buffer} must be below "
                              f"rollout.max_new_tokens={r.max_new_tokens}")
        if self.env.max_tokens < r.max_new_tokens and (self.env.tools or self.env.name != "auto"):
            raise ConfigError(f"env.max_tokens={self.env.max_tokens} must be at least "
                              f"rollout.max_new_tokens={r.max_new_tokens} (one whole turn)")

    def _check_updates(self, algo: AlgorithmConfig) -> None:
        """How a step's batch splits into updates, and whether the objective may reuse it."""
        r, o = self.rollout, self.optim
        if self.batch_size % o.minibatches or (self.batch_size // o.minibatches) % r.group_size:
            raise ConfigError(
                f"optim.minibatches={o.minibatches} must split the {self.batch_size} responses of a "
                f"step (prompts_per_step x group_size) into whole groups of {r.group_size}")
        trust_region = objective_reads(algo.policy_loss) & {"old_logp", "behaviour_logp"}
        if not trust_region and (o.epochs > 1 or o.minibatches > 1):
            raise ConfigError(f"algorithm.policy_loss={algo.policy_loss!r} reads no pi_old, so it is "
                              f"on-policy only: with optim.epochs={o.epochs}, optim.minibatches="
                              f"{o.minibatches} the later updates use stale samples; use 'clipped' "
                              "or a single update")

    def start_warnings(self) -> list[str]:
        """What a run with this config must say on start: choices that are allowed (ablations
        measure them) but train something else than the lecture's objective without a word."""
        r, algo, out = self.rollout, self.algo, []
        if r.max_staleness and r.tis_cap is None and "behaviour_logp" not in objective_reads(algo.policy_loss):
            single = self.optim.epochs * self.optim.minibatches == 1
            out.append(
                f"UNCORRECTED STALE SAMPLES: rollout.max_staleness={r.max_staleness} with "
                "rollout.tis_cap null trains batches sampled by weights up to "
                f"{r.max_staleness} update(s) old as if the trainer had sampled them (no importance "
                "weight against the sampler" + (", and with one update per batch no trust region "
                "either" if single else "") + "): set rollout.tis_cap (2), or "
                "algorithm.policy_loss dppo_tv, unless this is the ablation you mean")
        return out

    def _check_models(self, algo: AlgorithmConfig) -> None:
        """The models the algorithm needs: a teacher to distil from; a critic LoRA can carry."""
        if self.lora.rank and algo.advantage == "gae" and self.critic.shared_backbone:
            raise ConfigError("lora.rank > 0 with a value head on the shared body is not "
                              "supported; use a separate critic")
        if algo.advantage in NEEDS_TEACHER and not (self.teacher.path or self.teacher.domains):
            raise ConfigError(f"algorithm.advantage={algo.advantage!r} distils from a teacher: "
                              "set teacher.path to a model folder (or teacher.domains)")


# what `posttrain train` uses of ModelConfig / OptimConfig and the stages do not (refused if set)
_TRAIN_ONLY = {"model": ("dtype", "device", "gradient_checkpointing"),
               "optim": ("minibatches", "micro_batch_size", "micro_batch_tokens")}


@dataclass(frozen=True)
class StageConfig(RunOptions):
    """`posttrain sft | dpo | reward-model`: offline training on rows of a file (or synthetic ones).
    The sections and names are `posttrain train`'s (model.path, optim.lr, parallel.strategy, data.*)."""

    model: ModelConfig = ModelConfig()   # the starting model (path, autocast, attention)
    data: StageDataConfig = StageDataConfig()
    # AdamW with torch's own defaults (beta2 0.999, weight decay 0.01), as the stages always had
    optim: OptimConfig = OptimConfig(beta2=0.999, weight_decay=0.01)
    parallel: ParallelConfig = ParallelConfig()
    # sft, dpo: LoRA adapters (peft) instead of a full fine-tune; the final model has them merged
    lora: LoraConfig = LoraConfig()
    batch_size: int = 8                 # examples (or pairs) per optimizer step
    # sft with data.eval_path: the held-out rows' NLL a response token (eval/nll) every N
    # optimizer steps (0: before and after training only)
    eval_every: int = 0
    beta: float = 0.1                   # DPO / log-ratio reward model: the KL strength beta
    max_len: int = 256                  # response tokens kept per example
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
        self.check_run_options()
        self.optim.validate()
        self.data.validate()
        self.lora.validate()
        if self.lora.rank and self.freeze_layers:
            raise ConfigError(f"freeze_layers={self.freeze_layers} with lora.rank={self.lora.rank}: "
                              "LoRA already freezes the base weights; drop freeze_layers")
        check_range("batch_size", self.batch_size, 1)
        check_range("eval_every", self.eval_every, 0)
        check_range("max_len", self.max_len, 2)
        check_range("beta", self.beta, 0.0, lo_open=True)
        for name in ("freeze_layers", "lm_coef"):
            check_range(name, getattr(self, name), 0)
        if self.head_lr is not None:   # (0: the head stays put)
            check_range("head_lr", self.head_lr, 0.0)
        return self
