"""The `env` section of a config: the environment of each episode (posttrain/envs,
docs/environments.md), its tools, sandbox, ecosystem adapters (OpenEnv, agent harnesses,
verifiers) and time limits. Checked in `validate`, each error naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.util.checks import check_range
from posttrain.util.errors import ConfigError


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
    tool_seconds_per_step: float = 120.0     # tool time all of a step's episodes may use in all
    tool_max_output: int = 2000         # characters of a python tool call's output kept
    # where the python tool runs the model's code (docs/safety.md): 'bwrap' (bubblewrap: own
    # namespaces, no network, no view of the trainer or the run folder), 'fallback' (own
    # session, limits, empty environment; as root that is the machine: asked for by name only),
    # 'auto' (bwrap where it can start; else an error: 'fallback' must be chosen by name)
    sandbox: Literal["auto", "bwrap", "fallback"] = "auto"
    python_memory_mb: int = 512         # address-space limit of the python tool's processes
    python_max_procs: int = 32          # processes the python tool may run at once
    # an OpenEnv environment (env.name openenv; docs/environments.md): 'module:Class' (its
    # Environment, run in process) or the URL of a served one ('http://127.0.0.1:8001')
    openenv: str | None = None
    openenv_action: str = "message"     # the OpenEnv action's field that receives the policy's turn
    # the observation field the policy reads (a list of messages: their contents, one a line);
    # None: the first non-empty of messages, prompt, message, text, question, content, feedback,
    # else the other fields as JSON. What reset returns opens the episode: after the problem's
    # prompt, or as the prompt when the row has none
    openenv_observation: str | None = None
    # the most OpenEnv sessions (episodes) at once: episodes past it wait for one to end. None:
    # in process no limit; served, as many as the server accepts (its first refusal sets it)
    openenv_sessions: int | None = None
    # an OpenEnv episode is solved (eval/accuracy, data.retry_if) when it ends with a reward of at
    # least this (a partial credit below it, reasoning-gym's 0.25 for a wrong number, is not)
    openenv_success: float = 1.0
    # an external agent harness (env.name agent): 'module:function' called as
    # function(base_url, problem) per episode, against the policy's OpenAI-compatible endpoint
    agent: str | None = None
    # an episode an environment runs (an agent harness, a verifiers rollout, an OpenEnv session)
    # past a time limit is ended, counted (env/timeouts, an environment error) and left out of its
    # group's baseline and the loss; the step goes on without it. turn_timeout_s: the
    # environment's time from the episode's start or the policy's last reply to its next request
    # or its end (an OpenEnv reset or step). Either may be inf: no limit
    turn_timeout_s: float = 300.0
    episode_timeout_s: float = 1800.0   # an episode's wall time, sampling included (past it: as above)

    def validate(self) -> None:
        for name in ("max_turns", "max_tokens", "max_reply_tokens", "python_memory_mb",
                     "max_tool_calls_per_turn", "max_tool_calls_per_episode", "tool_max_output",
                     "python_max_procs"):
            check_range(f"env.{name}", getattr(self, name), 1)
        check_range("env.tool_timeout_s", self.tool_timeout_s, 0.0, lo_open=True)
        check_range("env.tool_seconds_per_episode", self.tool_seconds_per_episode, 0.0, lo_open=True)
        check_range("env.tool_seconds_per_step", self.tool_seconds_per_step, 0.0, lo_open=True)
        for name in ("turn_timeout_s", "episode_timeout_s"):   # (nan would pass a range check)
            if getattr(self, name) != getattr(self, name):
                raise ConfigError(f"env.{name}=nan: give a number of seconds > 0 (inf: no limit)")
            check_range(f"env.{name}", getattr(self, name), 0.0, lo_open=True)
        if self.openenv_success != self.openenv_success:   # (nan would pass as never solved)
            raise ConfigError("env.openenv_success=nan: give the reward that counts as solved")
        if self.openenv_sessions is not None:
            check_range("env.openenv_sessions", self.openenv_sessions, 1)
        if self.name == "agent" and not self.agent:
            raise ConfigError("env.name agent needs env.agent: the 'module:function' that runs "
                              "one episode against the policy's endpoint")
        if self.name == "openenv" and not self.openenv:
            raise ConfigError("env.name openenv needs env.openenv: 'module:Class' (in process) "
                              "or the URL of a served OpenEnv environment")
