"""Layer 4: environments: what answers the policy between its turns (envs/base.py), tools, built-ins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.util.errors import ConfigError
from posttrain.config.env import EnvConfig
from posttrain.data.tasks import Task
from posttrain.envs.base import (BindsTokenizer, Demonstrates, DescribesTools, DrivesPolicy, Driven,
                                 Environment, Reply, SingleTurn)
from posttrain.envs.builtin import GuessNumber, ToolEnv
from posttrain.envs.tools import TOOLS, Tool, make_tools
from posttrain.util.registry import Registry
from posttrain.util.usercode import load_function

__all__ = ["ENVIRONMENTS", "BindsTokenizer", "Demonstrates", "DescribesTools", "DrivesPolicy",
           "Driven", "Environment",
           "GuessNumber", "Reply", "SingleTurn", "Tool",
           "ToolEnv", "close_env", "for_tokenizer", "make_env"]

ENVIRONMENTS: Registry[Callable[[EnvConfig], Any]] = Registry("environment")
ENVIRONMENTS.register("single_turn")(lambda cfg: SingleTurn())
ENVIRONMENTS.register("tools")(
    lambda cfg: ToolEnv(tuple(make_tools(cfg.tools or ("calculator",), cfg)), cfg.max_turns,
                        cfg.tool_format, cfg.tool_timeout_s,
                        calls_per_turn=cfg.max_tool_calls_per_turn,
                        calls_per_episode=cfg.max_tool_calls_per_episode,
                        seconds_per_episode=cfg.tool_seconds_per_episode,
                        seconds_per_batch=cfg.tool_seconds_per_step))
ENVIRONMENTS.register("guess_number")(lambda cfg: GuessNumber(cfg.max_turns))


@ENVIRONMENTS.register("agent")
def _agent(cfg: EnvConfig):
    from posttrain.envs.agent import AgentEnvironment
    return AgentEnvironment(load_function(cfg.agent), cfg.max_turns)


@ENVIRONMENTS.register("verifiers")
def _verifiers(cfg: EnvConfig):
    from posttrain.envs.verifiers_env import VerifiersEnvironment
    return VerifiersEnvironment(cfg.max_turns)


@ENVIRONMENTS.register("openenv")
def _openenv(cfg: EnvConfig):
    from posttrain.envs.openenv import from_config
    return from_config(cfg)


def make_env(cfg: EnvConfig, task: Task) -> Environment:
    """The environment `env.name` names: 'auto' is the task's own (single turn for most tasks;
    'tools' when `env.tools` is set), a built-in, or 'module:function' called with the EnvConfig.
    Bad names fail here, before any model loads."""
    name = cfg.name
    if name == "auto":
        name = "tools" if cfg.tools else task.environment
    try:
        if ":" in name:
            return load_function(name)(cfg)
        for tool in cfg.tools:
            if ":" not in tool and tool not in TOOLS:
                raise ConfigError(f"env.tools: {tool!r} is not a tool; accepted: {sorted(TOOLS)} "
                                  "or 'module:function'")
        return ENVIRONMENTS[name](cfg)
    except KeyError as e:
        raise ConfigError(f"env.name={cfg.name!r}: {e.args[0]}") from None
    except ValueError as e:
        raise ConfigError(f"env: {e}") from None


def close_env(env: Environment) -> None:
    """Stop what an environment started (an endpoint, an event loop, sessions), if anything."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def for_tokenizer(env: Environment, tokenizer) -> Environment:
    """The environment adapted to the policy's tokenizer, when it has a `bind` (a tool
    environment picks the chat template's own tool-call format)."""
    return env.bind(tokenizer) if isinstance(env, BindsTokenizer) else env
