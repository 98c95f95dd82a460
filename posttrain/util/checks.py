"""The checks every config value passes, in one-line errors that name the field: a choice among
names (with the closest one suggested), a range, and a type (pydantic's lax validation of a
YAML or command-line value against the field's type hint)."""

from __future__ import annotations

import difflib
import functools
import types
import typing
from typing import Any, Literal

import yaml
from pydantic import TypeAdapter, ValidationError

from posttrain.util.errors import ConfigError


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
    close = []
    if "." not in leaf:   # (a name without its section is closest to a leaf: --lrr to --optim.lr)
        leaves = {k.rsplit(".", 1)[-1].lstrip("-"): k for k in reversed(known)}
        close = [leaves[c] for c in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)]
    close = close or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def check_choice(where: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not valid; accepted: {sorted(choices)}")


def check_range(where: str, value: float, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ConfigError(f"{where}={value!r} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}={value!r} must be <= {hi}")


def type_hint(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


@functools.cache
def _adapter(hint: Any) -> TypeAdapter:
    return TypeAdapter(hint)


# pydantic's error kinds (the part of its error type before the first '_') in this project's words
_MESSAGES = {"float": "must be a number", "int": "must be an integer", "bool": "must be true or false",
             "string": "must be a string", "tuple": "must be a list", "list": "must be a list",
             "dict": "must be a mapping"}


def coerce(where: str, value: Any, hint: Any) -> Any:
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
            check_choice(where, value, typing.get_args(literal))
        kinds = [err["type"].split("_")[0] for err in e.errors() if err["type"] != "none_required"]
        what = _MESSAGES.get(kinds[0] if kinds else "", e.errors()[0]["msg"].lower())
        raise ConfigError(f"{where}={value!r} {what}") from None
