"""Tools the policy can call: a Python function with a JSON schema, called from the model's text.

Two call formats:
- 'json': `<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>`,
  the format of the Hermes / Qwen chat templates (used when the tokenizer's template takes tools);
- 'tag': `<calculator>37*48</calculator>`: the tool's name as a tag around its one argument (or
  around a JSON object of its arguments), short enough for a small model to learn in a few steps.

Every call runs under a time limit and any exception, hang or non-text result becomes an error
message to the model (counted), never a crash. Built in: `calculator` (an arithmetic evaluator on
Python's `ast`, no `eval`) and `python` (the model's program in a sandbox, posttrain/sandbox:
bubblewrap where it runs, no network, no view of the trainer or the run folder; off unless named
in `env.tools`). Calls per turn and per episode, and tool seconds per episode and per batch of
episodes, are capped (ToolEnv).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.sandbox.launch import Limits, decide
from posttrain.sandbox.run import run_python_code
from posttrain.util.registry import Registry
from posttrain.util.usercode import RewardTimeout, call_with_timeout, load_function


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]          # JSON schema of the arguments (an object)
    fn: Callable[..., Any] = field(repr=False)
    # True: fn takes a `timeout_s=` keyword and enforces it itself, out of the trainer's process
    # (the python tool): a call running into it is the model's doing (its loop), not a broken
    # tool, and the trainer's own timer waits a few seconds longer only as a backstop
    bounded: bool = False
    sandbox: str | None = None          # where it runs the model's code ('bwrap', 'fallback'), if it does

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face function schema (what `apply_chat_template(tools=...)` takes)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def single_argument(self) -> str | None:
        """The name of the tool's only parameter, when it has exactly one (tag format: the tag's
        text is that argument)."""
        props = self.parameters.get("properties", {})
        return next(iter(props)) if len(props) == 1 else None


TOOLS: Registry[Callable[[Any], Tool]] = Registry("tool")


# ---------------------------------------------------------------------------------------------
# calculator
# ---------------------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses.
    Hand-written on `ast` (not `eval`, which would run any code the model writes); exponents are
    bounded so that `9**9**9` cannot hang the trainer."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    text = expression.strip().replace("×", "*").replace("^", "**").rstrip("=").strip()

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]!r}")
    try:
        value = walk(ast.parse(text, mode="eval"))
    except SyntaxError:
        raise ValueError(f"cannot parse {expression[:60]!r}") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


@TOOLS.register("calculator")
def calculator_tool(cfg: Any = None) -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                {"type": "object", "properties": {"expression": {"type": "string"}},
                 "required": ["expression"]}, calculate)


# ---------------------------------------------------------------------------------------------
# python sandbox
# ---------------------------------------------------------------------------------------------

def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 2000,
               mode: str = "bwrap", max_procs: int = 32, tmp_mb: int = 64) -> str:
    """Run `code` with `python -I -S` in the sandbox (posttrain/sandbox: bubblewrap, or the fallback
    where the user chose it) and return what it printed (stdout, then stderr when it failed), cut
    to `max_output` characters; a hang, a flood of output, too much memory or a crash comes back
    as an error for the model. A sandbox that cannot start raises (the tool is broken)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, not {type(code).__name__}")
    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                    tmp_mb=tmp_mb, max_output=max_output)
    res = run_python_code(code, limits, mode)
    if res.status == "timeout":
        return f"error: timed out after {timeout_s:g} s"
    if res.status == "memory_limit":
        return f"error: killed: its processes used more than {memory_mb} MB in all"
    if res.status == "output_limit":
        return (res.stdout + res.stderr)[:max_output] + f"\nerror: output cut at {max_output} bytes"
    text = res.stdout + (res.stderr[-max_output:] if res.returncode else "")
    if res.returncode and not res.stderr.strip():
        text += f"error: exit status {res.returncode}"
    return text[:max_output] if text else "(no output)"


@TOOLS.register("python")
def python_tool(cfg: Any = None) -> Tool:
    memory = getattr(cfg, "python_memory_mb", 512)
    output = getattr(cfg, "tool_max_output", 2000)
    procs = getattr(cfg, "python_max_procs", 32)
    mode = decide(getattr(cfg, "sandbox", "auto"), "the python tool", "env.sandbox",
                  runs="the programs the model writes")   # decided once, before training
    return Tool("python", "Run a Python program and return what it prints.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                lambda code, timeout_s: run_python(code, timeout_s=timeout_s, memory_mb=memory,
                                                    max_output=output, mode=mode, max_procs=procs),
                bounded=True, sandbox=mode)


def make_tools(names: tuple[str, ...], cfg: Any = None) -> list[Tool]:
    """Built-in tools by name, or 'module:function' returning a `Tool` (or a plain function,
    whose docstring and parameters make its schema)."""
    tools = []
    for name in names:
        if ":" not in name:
            tools.append(TOOLS[name](cfg))
            continue
        obj = load_function(name)
        made = obj() if not isinstance(obj, Tool) and _takes_nothing(obj) else obj
        tools.append(made if isinstance(made, Tool) else tool_from_function(obj))
    return tools


def _takes_nothing(fn: Callable) -> bool:
    try:
        return not inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def tool_from_function(fn: Callable[..., Any]) -> Tool:
    """A tool from a plain function: its name, first docstring line, and string parameters."""
    params = list(inspect.signature(fn).parameters)
    return Tool(fn.__name__, (inspect.getdoc(fn) or fn.__name__).splitlines()[0],
                {"type": "object", "properties": {p: {"type": "string"} for p in params},
                 "required": params}, fn)


# ---------------------------------------------------------------------------------------------
# parsing calls and running them
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


_JSON_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_MAX_INT = 2 ** 63          # an argument past this is no argument to a tool ("huge numbers")
_MAX_DEPTH = 20             # nesting of an argument's lists and objects


class Malformed(ValueError):
    """A tool call the model wrote wrong: answered with the message, counted as its error."""


def parse_calls(text: str, tools: dict[str, Tool], fmt: str) -> tuple[list[Call], list[str]]:
    """The tool calls in a turn's text, and an error message for each malformed one. Nothing the
    model writes makes this raise: wrong JSON types, unknown tools, deep nesting and huge numbers
    are the model's errors (answered and counted), never a broken environment."""
    calls, errors = [], []
    found = _json_calls(text) if fmt == "json" else _tag_calls(text, tools)
    for name, body, closed in found:
        try:
            calls.append(_call(name, body, closed, tools))
        except Malformed as e:
            errors.append(str(e))
    return calls, errors


def _json_calls(text: str) -> list[tuple[str | None, str, bool]]:
    return [(None, body, bool(close)) for body, close in _JSON_CALL.findall(text)]


def _tag_calls(text: str, tools: dict[str, Tool]) -> list[tuple[str | None, str, bool]]:
    found = []
    for name in tools:
        pattern = rf"<{re.escape(name)}>(.*?)(</{re.escape(name)}>|$)"
        found += [(name, m.group(1), bool(m.group(2))) for m in re.finditer(pattern, text, re.DOTALL)]
    return found


def _call(name: str | None, body: str, closed: bool, tools: dict[str, Tool]) -> Call:
    """One call from its text: 'json' format (name None: the body names the tool) or 'tag'."""
    if name is None:
        obj = _loads(body.strip(), 'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise Malformed('malformed tool call: write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        name, args = obj["name"], obj.get("arguments", {})
        if isinstance(args, str):
            args = _loads(args, "arguments must be a JSON object")
        if not closed:
            raise Malformed("tool call without </tool_call>")
    else:
        if not closed:
            raise Malformed(f"<{name}> without </{name}>")
        body = body.strip()
        arg = tools[name].single_argument
        if arg is not None and not body.startswith("{"):
            return Call(name, {arg: body})
        args = _loads(body, f"<{name}> needs a JSON object of its arguments")
    if name not in tools:
        raise Malformed(f"unknown tool {name[:60]!r}; tools: {sorted(tools)}")
    if not isinstance(args, dict):
        raise Malformed(f"the arguments of {name} must be a JSON object")
    _check_value(args, 0)
    return Call(name, args)


def _loads(text: str, fix: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:   # (too deep, or an int past Python's digit limit)
        raise Malformed(f"malformed tool call ({type(e).__name__}): {fix}") from None


def _check_value(value: Any, depth: int) -> None:
    """Arguments are JSON of modest depth with finite numbers of modest size."""
    if depth > _MAX_DEPTH:
        raise Malformed("tool arguments nested too deeply")
    if isinstance(value, dict):
        for v in value.values():
            _check_value(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_value(v, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise Malformed("tool arguments must be finite numbers")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _MAX_INT:
        raise Malformed("a number in the tool arguments is too large")


# what a tool raises on arguments the model got wrong ("2+", a missing field, 1/0): the model's
# feedback, not a broken tool (FailureWatch counts only the broken ones, posttrain/util/health.py)
ARGUMENT_ERRORS = (ValueError, TypeError, KeyError, ArithmeticError, SyntaxError)


BACKSTOP_S = 5.0   # a bounded tool's grace past its own timeout (sandbox start and teardown)


def run_call(call: Call, tools: dict[str, Tool], timeout_s: float) -> tuple[str, str]:
    """(the result as text, status): 'ok'; 'bad_arguments' (the tool refused the model's
    arguments); 'failed' (it raised anything else, hung, or returned something that is not text
    or a number). Every failure comes back to the model as 'error: ...'."""
    tool = tools[call.name]
    args = {**call.arguments, "timeout_s": timeout_s} if tool.bounded else call.arguments
    try:
        value = call_with_timeout(tool.fn, args, timeout_s + BACKSTOP_S * tool.bounded)
    except RewardTimeout:
        return f"error: {call.name} timed out after {timeout_s:g} s", "failed"
    except ARGUMENT_ERRORS as e:
        return f"error: {type(e).__name__}: {str(e)[:200]}", "bad_arguments"
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's feedback
        return f"error: {type(e).__name__}: {str(e)[:200]}", "failed"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return f"error: {call.name} returned {type(value).__name__}, not text", "failed"
    if isinstance(value, float) and not math.isfinite(value):
        return f"error: {call.name} returned {value}", "failed"
    return str(value), "ok"
