"""The `posttrain` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from posttrain import __version__
from posttrain.util.errors import EngineError, FailingSourceError, NonFiniteError
from posttrain.config.commands import ConfigError, StageConfig, TrainConfig
from posttrain.config.options import (DEFAULT_RECIPE, STAGE_EPILOG, TRAIN_EPILOG, CommandParser,
                                      check_option_names, command_epilog, load_config,
                                      load_stage_config, recipe_path)

log = logging.getLogger("posttrain")

def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("posttrain").setLevel(logging.INFO)
    for noisy in ("transformers", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")       # nothing is ever downloaded at run time
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config_and_resume(args: argparse.Namespace, config_file, overrides: list[str], load, to_dict):
    """The run's config and the folder it resumes (None: a new run). `--resume RUN_DIR`: that
    run's config.json under the YAML and overrides; `--resume auto`: the newest run folder of
    this very config holding a checkpoint, or a new run when there is none."""
    if args.resume == "auto":
        cfg = load(config_file, overrides)
        from posttrain.run.lifecycle import find_run_to_resume   # (torch: only once the config is valid)

        found = find_run_to_resume(to_dict(cfg), cfg.run_dir)
        if found is None:
            log.info("--resume auto: no run of this config has a checkpoint yet; starting a new run")
        else:
            log.info("--resume auto: continuing %s", found)
        return cfg, found
    if args.resume is not None:
        run = Path(args.resume)
        if not (run / "config.json").is_file():
            raise ConfigError(f"--resume {args.resume}: {run / 'config.json'} not found")
        from posttrain.run.checkpoint import CheckpointError, checkpoint_config

        try:   # the checkpoint's own, hash-checked copy of the config: never the folder's
            ckpt, saved = checkpoint_config(run)
        except CheckpointError as e:
            raise ConfigError(f"--resume {args.resume}: {e}") from None
        _say_if_edited(run, ckpt, saved)
        return load(config_file, overrides, base=saved), run
    return load(config_file, overrides), None


def _say_if_edited(run: Path, ckpt: Path, saved: dict) -> None:
    """Warn when the run folder's config.json is not the config its checkpoint recorded (an
    edit, or overrides of a resume that had not checkpointed yet): the checkpoint's is used."""
    try:
        folder = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        folder = {}
    changed = sorted(k for k in set(folder) | set(saved)
                     if not k.startswith("_") and folder.get(k) != saved.get(k))
    if changed:
        log.warning("%s differs from the config checkpoint %s recorded (in %s): resuming with the "
                    "checkpoint's (pass overrides again to change it)", run / "config.json",
                    ckpt.name, ", ".join(changed))


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.util.perf import tune_malloc

    tune_malloc()
    config_file = args.config
    if config_file is None and args.resume in (None, "auto"):
        config_file = recipe_path(DEFAULT_RECIPE)
    cfg, resume = _config_and_resume(args, config_file, overrides, load_config,
                                     lambda c: c.to_dict())
    from posttrain.rl.loop import train   # after the config is valid: a refused run stays fast

    summary = train(cfg, resume=resume, show_progress=not args.no_progress)
    if _main_process():
        print_summary(summary)
    return 0


def _main_process() -> bool:
    """Rank 0 under torchrun (the one that prints), or a plain single process."""
    return int(os.environ.get("RANK", "0")) == 0


def print_summary(summary: dict) -> None:
    if summary.get("stopped_by"):
        print(f"\nstopped by {summary['stopped_by']} after step {summary['steps']}; checkpoint in "
              f"{summary['run_dir']}/checkpoints\ncontinue with: {summary['resume']}")
        return
    before = summary.get("eval_before", {}).get("eval/accuracy")
    after = summary.get("eval_after", {}).get("eval/accuracy")
    print(f"\nrun folder: {summary['run_dir']}")
    if before is not None or after is not None:
        fmt = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        print(f"held-out accuracy: {fmt(before)} -> {fmt(after)} "
              f"after {summary['steps']} steps, {summary['train_minutes']:.1f} min of training")
    for key, value in sorted(summary.get("eval_after", {}).items()):
        if key.startswith("eval/accuracy_"):
            print(f"  {key[5:]}: {100 * value:.1f}%")
    print(f"final model: {summary['final_model']}")
    if "plot" in summary:
        print(f"curves: {summary['plot']}")
    samples = Path(summary["run_dir"]) / "eval_samples.jsonl"
    if samples.is_file():
        last = json.loads(samples.read_text().strip().splitlines()[-1])
        print("sample completions (held-out, greedy):")
        for s in last["samples"][:3]:
            print(f"  {s['prompt']!r} -> {s['completion']!r} ({'correct' if s['correct'] else 'wrong'})")


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.model_path:
        overrides = [*overrides, "--model.path", args.model_path]
    if args.task:
        overrides += ["--data.task", args.task]
    cfg = load_sampling_config(args.config, overrides)
    from posttrain.stages.evaluate import evaluate_model   # (torch: once the config is valid)

    summary = evaluate_model(cfg, args.k, args.samples, show_progress=not args.no_progress)
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()
             if k != "samples"}
    print(json.dumps(shown, indent=2))
    for s in summary["samples"]:
        print(f"  {s['prompt']!r} -> {s['completion']!r} ({'correct' if s['correct'] else 'wrong'})")
    return 0


def load_sampling_config(config_file: Path | None, overrides: list[str]) -> TrainConfig:
    """`eval` and `generate`: the default job's generation settings unless a config says
    otherwise. A config's run folder and time budget are a training run's: these commands get
    their own folder (a run's config.json must never open that run's folder as a new run) and no
    budget, unless the command line gives them."""
    return load_config(config_file or recipe_path(DEFAULT_RECIPE),
                       ["--max_minutes", "null", "--run_dir", "null", *overrides])


def cmd_stage(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.util.perf import tune_malloc

    tune_malloc()
    check_option_names(overrides, StageConfig, ("--config", "--resume"))
    cfg, resume = _config_and_resume(args, args.config, overrides, load_stage_config, asdict)
    if not cfg.data.train_path and not cfg.data.synthetic:
        raise ConfigError("--data.train_path FILE (JSONL, CSV, Parquet or a datasets folder) or "
                          "--data.synthetic TASK is required")
    # after the config is valid: a refused run stays fast
    from posttrain.stages.preference import dpo
    from posttrain.stages.reward_model import reward_model
    from posttrain.stages.sft import sft

    stage = {"sft": sft, "dpo": dpo, "reward-model": reward_model}[args.command]
    out = stage(cfg, show_progress=not args.no_progress, resume=resume)
    if _main_process():
        print(json.dumps(out, indent=2))
    return 0


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.stages.generate import generate

    if args.model_path:
        overrides = [*overrides, "--model.path", args.model_path]
    cfg = load_sampling_config(args.config, overrides)
    out = generate(cfg, args.n, args.out, samples=args.samples, only_correct=not args.keep_wrong,
                   demonstrate=args.demonstrate, show_progress=not args.no_progress)
    print(json.dumps(out, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.model_path:
        overrides = [*overrides, "--model.path", args.model_path]
    from posttrain.stages.serve import serve_until_stopped
    serve_until_stopped(load_sampling_config(args.config, overrides), args.host, args.port, args.name)
    return 0


def cmd_experiment(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.experiments.common import run_experiment

    res = run_experiment(args.name, overrides, args.out, args.repeats, not args.no_progress,
                         args.command_line)
    print(json.dumps({k: res[k] for k in ("record", "figure", "seconds")}, indent=2))
    return 0


def cmd_prepare_model(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.model.loading import prepare_embedded
    print(prepare_embedded(args.cache_dir))
    return 0


def cmd_plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.logs.metrics import plot_run
    print(plot_run(Path(args.run_dir)))
    return 0


def cmd_view(args: argparse.Namespace, overrides: list[str]) -> int:
    from posttrain.view.server import view_until_stopped
    view_until_stopped(args.runs, args.host, args.port, args.open)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="posttrain", description="Post-train language models with RL (REINFORCE, RLOO, PPO, "
        "GRPO, DAPO, Dr. GRPO), on-policy distillation, SFT and DPO.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every step")
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)   # (CommandParsers too)
    from posttrain.tinker.command import add_command as _add_tinker
    for add in (_add_train, _add_eval, _add_stages, _add_generate, _add_serve, _add_tinker,
                _add_experiment, _add_tools):
        add(sub)
    return parser


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="policy-gradient training (default: GRPO on addition)",
                       epilog=command_epilog(TrainConfig, TRAIN_EPILOG),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML config file (default: packaged recipe)")
    p.add_argument("--resume", help="run folder to resume from its latest checkpoint, or 'auto': "
                   "the newest run of this same config (a new run if none)")
    _add_no_progress(p)
    p.set_defaults(fn=cmd_train)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="held-out greedy accuracy and pass@k of a model",
                       epilog="Any config field can follow as an override of the default recipe "
                       "(--seed, --threads, --max_minutes, --run_dir DIR or none, ...).")
    p.add_argument("--model.path", dest="model_path",
                   help="model folder, or 'smollm2-135m-instruct' (default: the recipe's, the "
                   "embedded model)")
    p.add_argument("--data.task", dest="task", help="built-in task (addition, arithmetic, countdown) or 'file'")
    p.add_argument("--config", type=Path, help="YAML config for data/reward/rollout settings "
                   "(default: the packaged default recipe, or pass a run's config.json; its "
                   "run_dir and max_minutes are ignored)")
    p.add_argument("--k", type=int, default=1, help="also report pass@k (sampled)")
    p.add_argument("--samples", type=int, default=0, help="samples per problem for pass@k (>= k; "
                   "at --rollout.temperature, default 1)")
    _add_no_progress(p)
    p.set_defaults(fn=cmd_eval)


def _add_stages(sub) -> None:
    for name, what, example in (
            ("sft", "supervised fine-tuning on prompt/response pairs",
             "posttrain sft --data.synthetic subtraction --data.n_pairs 1000 --optim.lr 3e-5"),
            ("dpo", "DPO on prompt/chosen/rejected preference pairs",
             "posttrain dpo --data.synthetic addition --beta 0.1"),
            ("reward-model", "train a Bradley-Terry reward model on preference pairs",
             "posttrain reward-model --data.synthetic addition --reward_form log_ratio")):
        p = sub.add_parser(name, help=what, epilog=command_epilog(StageConfig, f"\nExample: {example}\n"
                                                                  + STAGE_EPILOG),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", type=Path, help="YAML file of the options below")
        p.add_argument("--resume", help="run folder to resume from its latest checkpoint, or "
                       "'auto': the run_dir (without one: the newest folder under runs/) if it "
                       "holds a checkpoint of this same config")
        _add_no_progress(p)
        p.set_defaults(fn=cmd_stage)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="write a model's answers to training problems as SFT data",
                       epilog="Any config field can follow as an override, e.g. --data.task "
                       "subtraction --rollout.max_new_tokens 32.")
    p.add_argument("--model.path", dest="model_path",
                   help="the teacher: model folder or embedded name (default: the recipe's, the "
                   "embedded model)")
    p.add_argument("--out", help="output JSONL (prompt, response, answer, correct; default: "
                   "sft.jsonl in the run folder)")
    p.add_argument("--n", type=int, default=1000, help="training problems to answer")
    p.add_argument("--samples", type=int, default=1, help="answers per problem (1: greedy)")
    p.add_argument("--keep-wrong", action="store_true", help="also keep answers the verifier rejects")
    p.add_argument("--demonstrate", action="store_true",
                   help="ground-truth episodes of the environment (e.g. calculator calls) instead "
                   "of the model's: SFT data that teaches a tool format before RL")
    p.add_argument("--config", type=Path, help="task/rollout settings (default: the default "
                   "recipe; a config's run_dir and max_minutes are ignored)")
    _add_no_progress(p)
    p.set_defaults(fn=cmd_generate)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="a model behind an OpenAI-compatible endpoint on loopback "
                       "(an LLM judge, an agent harness; docs/environments.md)",
                       epilog="Any config field can follow as an override, e.g. "
                       "--rollout.max_new_tokens 256 (the longest reply).")
    p.add_argument("--model.path", dest="model_path",
                   help="model folder or embedded name (default: the embedded model)")
    _add_address(p, 8000)
    p.add_argument("--served-model-name", dest="name",
                   help="the model's name in requests and /v1/models (vLLM's flag; default: its path)")
    p.add_argument("--config", type=Path, help="sampling settings (default: the default recipe)")
    p.set_defaults(fn=cmd_serve)


def _add_address(p: argparse.ArgumentParser, port: int) -> None:
    """--port and --host of a command that listens (view, serve)."""
    p.add_argument("--port", type=int, default=port, help=f"port (default {port}; 0: any free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")


def _add_experiment(sub) -> None:
    from posttrain.experiments import EXPERIMENTS

    p = sub.add_parser("experiment", help="one of the lecture's claims, measured "
                       "(docs/lecture-reproduced.md)",
                       epilog="Any config field can follow as an override of the default recipe, "
                       "e.g. --model.path DIR --rollout.prompts_per_step 8. --max_minutes M: each "
                       "training arm trains at most M minutes, and a measurement loop stops once "
                       "M minutes have passed (the record lists what was cut).")
    p.add_argument("name", choices=sorted(EXPERIMENTS))
    p.add_argument("--out", type=Path, help="folder for NAME.json and NAME.png (default: "
                   "--run_dir, else runs/experiments/NAME)")
    p.add_argument("--repeats", type=int, help="batches (or points) to measure over "
                   "(default: the experiment's own)")
    _add_no_progress(p)
    p.set_defaults(fn=cmd_experiment)


def _add_tools(sub) -> None:
    p = sub.add_parser("prepare-model", help="convert the embedded SmolLM2 GGUF once into the cache")
    p.add_argument("--model.cache_dir", dest="cache_dir",
                   help="cache folder (default: $POSTTRAIN_CACHE or ~/.cache/posttrain)")
    p.set_defaults(fn=cmd_prepare_model)
    p = sub.add_parser("plot", help="(re)draw training_curves.png of a run folder")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_plot)
    p = sub.add_parser("view", help="a local web page over run folders: curves, rollouts token by "
                       "token, held-out answers (docs/viewer.md)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (several: curves overlaid)")
    _add_address(p, 8765)
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.set_defaults(fn=cmd_view)


def _add_no_progress(p: argparse.ArgumentParser) -> None:
    """Every command that runs a model takes it the same way."""
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar; log lines instead")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.command_line = " ".join(["posttrain", *(sys.argv[1:] if argv is None else argv)])
    _setup_logging(args.verbose or getattr(args, "no_progress", False))
    try:
        if args.fn in (cmd_train, cmd_eval, cmd_generate, cmd_experiment, cmd_serve):   # the rest are config overrides
            check_option_names(rest, TrainConfig, args.own_flags)
        elif args.fn in (cmd_prepare_model, cmd_plot, cmd_view) and rest:
            raise ConfigError(f"unexpected arguments {' '.join(rest)} (every option: "
                              f"posttrain {args.command} --help)")
        return args.fn(args, rest)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"posttrain: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (NonFiniteError, EngineError) as e:   # a run that went wrong: said in one line
        print(f"posttrain: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except FailingSourceError as e:   # the message, then the first failure's traceback
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) if not isinstance(e, KeyError) else str(e)


if __name__ == "__main__":
    sys.exit(main())
