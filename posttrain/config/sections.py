"""The sections of a config: one frozen dataclass per section (model, teacher, critic, data,
reward, optim, lora, parallel, checkpoint; the offline stages' data; rollout: config/rollout.py;
env: config/env.py),
each checking its
own ranges in `validate`, with an error naming the field. The field comments are `--help`'s
descriptions (config/options.py). The commands' configs that compose them, and the rules across
sections, are config/commands.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.util.checks import check_choice, check_range
from posttrain.util.errors import ConfigError
from posttrain.logs.trackers import TRACKERS, missing_package


@dataclass(frozen=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # local HF folder, or the embedded 'smollm2-135m-instruct'
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"   # weights as loaded
    # bf16 autocast for the training forward/backward and the reference (LM head stays float32);
    # sampling runs in `dtype` unless rollout.autocast says otherwise. Faster on CPUs with
    # AVX512-BF16 and on GPUs; 'auto': bfloat16 where the device multiplies bf16 natively (a GPU
    # with bf16, a CPU with AVX-512), else none (an AVX2-only CPU's bf16 matmul is ~80x slower)
    autocast: Literal["none", "bfloat16", "auto"] = "none"
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
            check_range("teacher.temperature", self.temperature, 0.0, lo_open=True)
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
    """The value model of PPO (used by the 'gae' advantage; see posttrain/rl/critic.py)."""

    shared_backbone: bool = False       # True: a scalar head on the policy's body (no second model)
    path: str | None = None             # separate critic from this folder; None: the policy's start
    lr: float = 1e-5                    # the value model's own learning rate
    vf_coef: float = 0.5                # weight of the value loss (matters when the body is shared)
    clip: float | None = 0.2            # value clipping around V_old (None: plain regression)
    max_grad_norm: float = 1.0          # gradient clipping of the value model
    warmup_steps: int = 0               # first steps train only the critic (policy frozen)

    def validate(self) -> None:
        check_range("critic.lr", self.lr, 0.0)
        check_range("critic.vf_coef", self.vf_coef, 0.0)
        check_range("critic.warmup_steps", self.warmup_steps, 0)
        if self.clip is not None:
            check_range("critic.clip", self.clip, 0.0, lo_open=True)
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

    def validate(self) -> None:
        check_range("data.eval_size", self.eval_size, 0)
        check_range("data.retry_unsolved", self.retry_unsolved, 0)
        check_choice("data.retry_if", self.retry_if, ("unsolved", "mixed"))
        if self.task == "file" and not self.train_path:
            raise ConfigError("data.task='file' needs data.train_path")


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
    # where those workers run (docs/safety.md): 'auto' / 'bwrap' / 'fallback' as env.sandbox
    # (no network, no files but their own code, an empty environment, bounded memory and
    # processes); 'off': with your files, network and environment, for reward functions that
    # need them (the answers' scorers then run uncontained: say so by choosing it)
    sandbox: Literal["auto", "bwrap", "fallback", "off"] = "auto"
    memory_mb: int = 4096               # the reward workers' memory in all, and each one's address space
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
    # LLM as judge (docs/environments.md, 'An LLM judge as a reward'): the OpenAI-compatible
    # endpoint whose model scores each response, added with weight judge_weight
    # ('http://host:port/v1'; `posttrain serve` makes one of a local model). A response the
    # judge cannot score after its retries is left out of its group's baseline and out of the
    # loss, and counted (reward/judge_unscorable), never 0.
    judge: str | None = None
    judge_model: str = "default"        # the model name sent to the judge's endpoint
    # the judge's prompt: 'correctness' (against the reference answer), 'rubric' (no reference),
    # 'yes_no' (a verdict, for small judges), or a text file with {prompt}, {completion}, {answer}
    # (group mode: {prompt}, {answer}, {responses}, {n}); the reply is read only where it asks:
    # a last line 'Score: N' (N of 10; group: 'Scores: [...]'), or the Yes/No that opens it
    judge_template: str = "correctness"
    judge_weight: float = 1.0           # weight of the judge's score (in [0, 1]) in the reward
    judge_group: bool = False           # RULER-style: one request scores a prompt's whole group
    judge_concurrency: int = 4          # requests in flight at once
    judge_rate: float = 0.0             # request starts per second at most (0: no limit)
    judge_retries: int = 3              # retries, with exponential backoff, of a failed request
    judge_timeout_s: float = 60.0       # one request's time limit
    judge_max_tokens: int = 256         # the judge's reply length
    # replies on disk, keyed by model and request: None, judge_cache.sqlite in the run folder
    # (a resumed run reuses it); a path to share one between runs; 'none' for no cache
    judge_cache: str | None = None
    # the environment variable sent to reward.judge as its API key (the run logs which, and to
    # where): OPENAI_API_KEY, a name holding JUDGE, or any other named on the command line (a
    # recipe, config file or resumed run cannot name one, e.g. HF_TOKEN: config/options.py)
    judge_api_key_env: str = "OPENAI_API_KEY"

    def validate(self) -> None:
        check_range("reward.workers", self.workers, 0)
        check_range("reward.memory_mb", self.memory_mb, 256)
        check_range("reward.max_failing_steps", self.max_failing_steps, 0)
        check_range("reward.timeout_s", self.timeout_s, 0.0, lo_open=True)
        if self.judge is not None:
            check_judge(self)
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
    # at most this many positions through the decoder a micro-batch: each group's prompt once,
    # every response (activations grow with them: SmolLM2-135M keeps ~1.6 MB a position for
    # backward, so 32 rows of a two-seat game, 8 prompts of 224 and 32 replies of 83 tokens,
    # took 7 GB); whole groups, so a group past it runs alone; 0 (the default): only
    # micro_batch_size decides (a budget right for a CPU would slow a GPU's long replies)
    micro_batch_tokens: int = 0

    def micro_rows(self, prompt_width: int, response_width: int, group_size: int) -> int:
        """Rows per micro-batch for groups of `group_size` responses `response_width` long to a
        prompt `prompt_width` long (group_chunks rounds it to whole groups, at least one)."""
        if self.micro_batch_tokens <= 0:
            return self.micro_batch_size
        per_group = prompt_width + group_size * response_width
        groups = max(1, self.micro_batch_tokens // max(per_group, 1))
        return min(self.micro_batch_size, groups * group_size)

    @property
    def single_update(self) -> bool:
        """One epoch of one minibatch: the policy cannot move between sampling and its update, so
        pi_old = pi_theta exactly (§3)."""
        return self.epochs == 1 and self.minibatches == 1

    def validate(self) -> None:
        """The ranges every command checks the same way (train adds how minibatches split a step)."""
        check_range("optim.lr", self.lr, 0.0, lo_open=True)
        check_range("optim.weight_decay", self.weight_decay, 0.0)
        for name in ("beta1", "beta2"):
            check_range(f"optim.{name}", getattr(self, name), 0.0, 1.0)
        check_range("optim.warmup_steps", self.warmup_steps, 0)
        check_range("optim.max_grad_norm", self.max_grad_norm, 0.0, lo_open=True)
        check_range("optim.max_nonfinite_steps", self.max_nonfinite_steps, 0)
        check_range("optim.epochs", self.epochs, 1)
        check_range("optim.minibatches", self.minibatches, 1)
        check_range("optim.micro_batch_size", self.micro_batch_size, 1)
        check_range("optim.micro_batch_tokens", self.micro_batch_tokens, 0)


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
        check_range("lora.rank", self.rank, 0)
        check_range("lora.dropout", self.dropout, 0.0, 1.0)
        if self.rank and not self.target_modules:
            raise ConfigError("lora.target_modules is empty: name the modules to adapt")


@dataclass(frozen=True)
class ParallelConfig:
    """Multi-process training under torchrun (see posttrain/model/distributed.py); ignored otherwise."""

    strategy: Literal["ddp", "fsdp"] = "ddp"   # replicate weights / shard them (FSDP2)


@dataclass(frozen=True)
class CheckpointConfig:
    """When a run saves a checkpoint for --resume (weights, optimizer, schedule, RNG, data
    position). Besides these, one is always written when SIGINT / SIGTERM stops a run (after the
    step in flight) and when max_minutes ends it."""

    every_steps: int = 0                # every N optimizer steps (0: not by steps)
    every_minutes: float | None = 5.0   # every M minutes of wall time (null: not by time)
    keep: int = 2                       # the newest K checkpoints are kept, older ones deleted
    # after SIGINT / SIGTERM the step in flight gets this long to finish (inf: no limit); past it
    # (or at a second signal) the step is abandoned and the run exits with its last checkpoint,
    # summary.json saying so (a run whose cleanup then hangs too ends the process stop_grace_s
    # later). Under torchrun the agent SIGKILLs the workers 30 s after it forwards SIGTERM: give
    # torchrun --shutdown-timeout more than this plus a checkpoint's write, or lower this
    stop_grace_s: float = 180.0

    def validate(self) -> None:
        check_range("checkpoint.every_steps", self.every_steps, 0)
        if self.stop_grace_s != self.stop_grace_s:   # (nan would pass a range check)
            raise ConfigError("checkpoint.stop_grace_s=nan: give a number of seconds > 0 "
                              "(inf: no limit)")
        check_range("checkpoint.stop_grace_s", self.stop_grace_s, 0.0, lo_open=True)
        if self.every_minutes is not None:
            check_range("checkpoint.every_minutes", self.every_minutes, 0.0, lo_open=True)
        check_range("checkpoint.keep", self.keep, 1)


def check_trackers(report_to: tuple[str, ...]) -> None:
    """Every tracker named exists and its package is installed (before any model loads)."""
    for name in report_to:
        check_choice("report_to", name, TRACKERS.names())
        package = missing_package(name)
        if package is not None:
            raise ConfigError(f"report_to {name} needs the {package!r} package, which is not "
                              f"installed: pip install \"posttrain[{name}]\" (or drop it from report_to)")


@dataclass(frozen=True)
class StageDataConfig:
    """Rows for sft / dpo / reward-model: a file, or rows made from a built-in task's ground truth."""

    train_path: str = ""                # JSONL / CSV / Parquet file or datasets folder
    # held-out rows: dpo, reward-model: pairs (default: eval_size pairs split off); sft: rows
    # whose NLL a response token is measured before, every eval_every steps and after
    eval_path: str = ""
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

    def validate(self) -> None:
        check_range("data.n_pairs", self.n_pairs, 1)
        check_range("data.eval_size", self.eval_size, 0)
        check_range("data.terse_wrong_share", self.terse_wrong_share, 0.0, 1.0)
        if self.synthetic and self.synthetic not in ("addition", "subtraction", "arithmetic"):
            raise ConfigError(f"data.synthetic={self.synthetic!r} is not valid; accepted: "
                              "['addition', 'arithmetic', 'subtraction']")


def check_judge(cfg: RewardConfig) -> None:
    """The judge's settings (its template is read when the scorer starts, before any model)."""
    if not str(cfg.judge).startswith(("http://", "https://")):
        raise ConfigError(f"reward.judge={cfg.judge!r} is not an endpoint URL: give the "
                          "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    check_range("reward.judge_concurrency", cfg.judge_concurrency, 1)
    check_range("reward.judge_rate", cfg.judge_rate, 0.0)
    check_range("reward.judge_retries", cfg.judge_retries, 0)
    check_range("reward.judge_timeout_s", cfg.judge_timeout_s, 0.0, lo_open=True)
    check_range("reward.judge_max_tokens", cfg.judge_max_tokens, 1)
