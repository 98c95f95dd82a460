"""The command-line layer of the configs: a config built from (lowest to highest precedence) the
dataclass defaults, a resumed run's config.json, a YAML file and `--section.field value`
overrides, every value type-checked (checks.coerce); the option names a command accepts, with the
closest one suggested for a mistyped option; and `--help`'s option list, from the comments
written beside each field.

Why pydantic under a small walk of our own rather than tyro: the same validation must serve the
YAML file, a resumed run's config.json and the command line, merged in that order onto
section defaults that differ by command (the stages' AdamW keeps torch's beta2 0.999); tyro parses
a command line onto one default and reports errors in a multi-line panel, where every error here
is one line naming the field and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import logging
import tokenize
import typing
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from posttrain.util.checks import coerce, did_you_mean, type_hint
from posttrain.config.commands import StageConfig, TrainConfig
from posttrain.util.errors import ConfigError
from posttrain.config.presets import PRESETS, AlgorithmConfig

log = logging.getLogger("posttrain")


class CommandParser(argparse.ArgumentParser):
    """argparse with no prefix abbreviations (a mistyped option is refused, never read as
    another one), which records the options it declares (`flags`) and, once it has parsed a
    command, names them in the result (`own_flags`, the did-you-mean of an unknown option);
    its subcommands are CommandParsers too."""

    def __init__(self, *args, **kwargs) -> None:
        self.flags: list[str] = []   # (before argparse's own --help is added)
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def add_argument(self, *names, **kwargs):
        self.flags += [n for n in names if n.startswith("-")]
        return super().add_argument(*names, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if not hasattr(parsed, "own_flags"):   # (a subcommand's parser sets it first)
            parsed.own_flags = tuple(self.flags)
        return parsed, rest


def option_names(cls: type, prefix: str = "") -> list[str]:
    """Every `--section.field` a config dataclass accepts, as 'section.field' (algorithm: the
    AlgorithmConfig fields; mappings such as teacher.domains take any key below them)."""
    names = []
    for f in fields(cls):
        hint = type_hint(cls, f.name)
        if dataclasses.is_dataclass(hint):
            names += option_names(hint, f"{prefix}{f.name}.")
        elif cls is TrainConfig and f.name == "algorithm":
            names += [f"algorithm.{g.name}" for g in fields(AlgorithmConfig)]
        else:
            names.append(f"{prefix}{f.name}")
    return names


def option_pairs(args: list[str]) -> list[tuple[str, str | None]]:
    """The one walker of the `--section.field VALUE` grammar (also `--section.field=VALUE`):
    [(the option as written, its value or None when the line ends)], in order; an argument
    that is not an option is refused with the form an option takes."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else None
            i += 1
        pairs.append((key, value))
        i += 1
    return pairs


def check_option_names(args: list[str], cls: type, flags: tuple[str, ...] = ()) -> None:
    """Refuse an option that is neither a config field of `cls` nor one of the command's own
    `flags`, naming the closest known one: a mistyped option never starts a job."""
    known = option_names(cls)
    mappings = {n for n in known if typing.get_origin(hint_path(cls, n)) is dict
                or hint_path(cls, n) is dict}
    for written, _ in option_pairs(args):
        key = written.replace("-", "_")
        if key not in known and not any(key.startswith(m + ".") for m in mappings):
            everything = [f"--{n}" for n in known] + list(flags)
            raise ConfigError(f"unknown option --{written}{did_you_mean('--' + key, everything)} "
                              "(every option: --help)")


def hint_path(cls: type, dotted: str) -> Any:
    hint: Any = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        if hint is TrainConfig and part == "algorithm":
            hint = AlgorithmConfig
            continue
        hint = type_hint(hint, part)
    return hint


def build_config(cls: type, data: dict[str, Any], where: str, base: Any = None) -> Any:
    """`data` on top of `base` (default: cls()), every value type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {data!r}")
    base = cls() if base is None else base
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if not where and key.startswith("_"):   # a record beside the fields (config.json's _isolation)
            continue
        if key not in known:
            raise ConfigError(f"{name} is not a config field; known: {sorted(known)}"
                              f"{did_you_mean(key, known)}")
        hint = type_hint(cls, key)
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_config(hint, value, name, getattr(base, key))
        elif name == "run_dir" and isinstance(value, str) and value.lower() == "none":
            kwargs[key] = "none"   # (`--run_dir none`: no folder, not the default folder)
        else:
            kwargs[key] = coerce(name, value, hint)
    return replace(base, **kwargs)


def merge_dicts(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--optim.lr', '1e-5', '--preset=dapo'] -> {'optim': {'lr': 1e-5}, 'preset': 'dapo'}:
    YAML scalars (numbers, booleans, null) parse as such, everything else stays a string."""
    out: dict[str, Any] = {}
    for key, value in option_pairs(args):
        if value is None:
            raise ConfigError(f"--{key} needs a value")
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            parsed = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:   # e.g. "{prompt} ..." is not YAML, just a string
            parsed = value
        node[parts[-1]] = parsed if isinstance(parsed, (int, float, bool, type(None))) else value
    return out


@functools.cache   # (inspect.getsource parses the module each time: half a second per parser)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's description, read from the comments beside and above it in the dataclass's
    source (the one place they are written), for `--help`."""
    docs: dict[str, str] = {}
    for base in cls.__mro__[1:]:   # fields declared on a base (RunOptions' common options)
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
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
        hint = type_hint(cls, f.name)
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


def load_options(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                 base: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The one config loader: defaults < `base` (a resumed run's config.json) < YAML file <
    command-line overrides, type-checked into `cls` and validated. Returns (the config, the
    command line's own values)."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = merge_dicts(data, read_yaml(path))
    given = parse_overrides(overrides or [])
    return with_autocast(build_config(cls, merge_dicts(data, given), "").validate()), given


def with_autocast(cfg: Any) -> Any:
    """`model.autocast: auto` made bfloat16 or none for this machine's device (util/perf.py
    native_bf16), said in one line; the run's config.json records what was chosen."""
    model = getattr(cfg, "model", None)
    if model is None or model.autocast != "auto":
        return cfg
    from posttrain.util.perf import native_bf16
    chosen = "bfloat16" if native_bf16(model.device) else "none"
    log.info("model.autocast auto: %s (%s)", chosen, "this device multiplies bf16 natively"
             if chosen == "bfloat16" else "no native bf16 matmul here: float32 is faster")
    return replace(cfg, model=replace(model, autocast=chosen))


def load_stage_config(path: str | Path | None = None, overrides: list[str] | None = None,
                      base: dict[str, Any] | None = None) -> StageConfig:
    """The SFT / DPO / reward-model config (load_options)."""
    return load_options(StageConfig, path, overrides, base)[0]


DEFAULT_RECIPE = "addition_grpo.yaml"   # what `posttrain train` runs without --config

# the head of `posttrain train --help`'s option list
TRAIN_EPILOG = f"""
Configuration: every field can be set in a YAML file (--config) and overridden on the command line
as --section.field VALUE, e.g. --optim.lr 2e-5 --rollout.group_size 8 --algorithm.clip_high 0.28.
Without --config, `train` uses the packaged recipe {DEFAULT_RECIPE} (GRPO on 2-digit addition with
the embedded SmolLM2-135M-Instruct, 10 minutes on a 2-core CPU).

Presets (--preset): {', '.join(PRESETS)}. The algorithm.* fields override the preset's.
Options (type, dataclass default; the recipe overrides some):
"""

# ... and of the offline stages'
STAGE_EPILOG = """
Configuration: every option below can also be set in a YAML file (--config FILE; the command line
wins). Under torchrun: torchrun --nproc-per-node N -m posttrain.cli sft ... --parallel.strategy fsdp.

Options (type, default):
"""


def command_epilog(cls: type, head: str) -> str:
    """`head`, then one line per option with its type, default and description."""
    import textwrap
    lines = [textwrap.fill(line, 100, subsequent_indent="      ") for line in options_help(cls)]
    return head + "\n".join(lines)


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
    cfg, given = load_options(TrainConfig, path, overrides, base)
    check_judge_key_source(cfg, given)
    return cfg


def check_judge_key_source(cfg: TrainConfig, given: dict[str, Any]) -> None:
    """reward.judge_api_key_env: a recipe, a config file or a resumed run's config.json names a
    URL and could name any variable (an HF token, a paid key) to send there. A variable that is
    set is sent only when the command line (`given`) names it, or its name starts with JUDGE_
    (the judge's own), or it is the default OPENAI_API_KEY and the URL is on loopback or comes
    from the command line."""
    import os
    from urllib.parse import urlsplit
    name, url, line = cfg.reward.judge_api_key_env, cfg.reward.judge, given.get("reward") or {}
    if url is None or name not in os.environ or line.get("judge_api_key_env") == name:
        return
    if name.upper().startswith("JUDGE_"):
        return
    loopback = (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")
    if name == "OPENAI_API_KEY" and (loopback or line.get("judge") == url):
        return
    raise ConfigError(f"reward.judge_api_key_env={name!r} and reward.judge={url!r} come from a "
                      f"config file: it would send ${name} there; name it on the command line "
                      f"(--reward.judge_api_key_env {name}, or --reward.judge URL for "
                      "OPENAI_API_KEY), or keep the key in a variable named JUDGE_...")
