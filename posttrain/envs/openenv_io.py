"""What crosses between posttrain and an OpenEnv environment (envs/openenv.py): an observation as
the text the policy reads, an MCP environment's tools and calls, and a served environment's
sessions (OpenEnv's WebSocket client, one session per episode).

The text of an observation (docs/environments.md, "Bring your OpenEnv environment"):

    env.openenv_observation names a field   -> that field
    else the first of TEXT_FIELDS that is not empty
    else the other fields (reward, done and metadata left out) as JSON; none: no text

A list of messages (TextArena's `messages`) reads as their contents, one a line.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from posttrain.envs.base import EnvironmentFull
from posttrain.envs.tools import Call, Tool

TEXT_FIELDS = ("messages", "prompt", "message", "text", "question", "content", "feedback")
NOT_TEXT = ("reward", "done", "metadata")   # an observation's fields that are never its text


def fields_of(obs: Any) -> dict[str, Any]:
    """An observation's fields: a pydantic model in process (dumped: nested models as dicts),
    a dict over the wire."""
    return obs if isinstance(obs, dict) else obs.model_dump()


def as_text(value: Any) -> str:
    """A field's value as text: a string as it is, a list of messages their contents one a
    line, None nothing, anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "\n".join(as_text(m.get("content", m) if isinstance(m, dict) else m) for m in value)
    return json.dumps(value, default=str)


def observation_text(fields: dict[str, Any], field: str | None = None) -> str:
    """What the policy reads of an observation's `fields` (the module's rule); `field`: the one
    field to read (env.openenv_observation), refused when the observation has no such field."""
    if field is not None:
        if field not in fields:
            raise ValueError(f"env.openenv_observation={field!r}: the environment's observation "
                             f"has no such field (its fields: {sorted(fields)}); name one of "
                             "them, or leave it unset for the default rule")
        return as_text(fields[field])
    for name in TEXT_FIELDS:
        text = as_text(fields.get(name))
        if text.strip():
            return text
    rest = {k: v for k, v in fields.items() if k not in NOT_TEXT and v not in (None, "", [], {})}
    return json.dumps(rest, default=str) if rest else ""


# ---- MCP tools (an OpenEnv MCPEnvironment: ListToolsAction / CallToolAction) ----

def mcp_tools(listed: dict[str, Any]) -> tuple[Tool, ...]:
    """The tools a ListToolsObservation lists, as posttrain tools (their schemas go to the chat
    template or the system prompt; a call goes back to the environment, never runs here)."""
    return tuple(Tool(t["name"], t.get("description") or "", t.get("input_schema") or
                      {"type": "object", "properties": {}}, _runs_in_the_environment)
                 for t in listed.get("tools") or ())


def _runs_in_the_environment(**_: Any) -> str:
    raise RuntimeError("an OpenEnv tool runs in its environment (a CallToolAction), not here")


def call_action(call: Call, served: bool) -> Any:
    """A parsed tool call as OpenEnv's CallToolAction (over the wire: its JSON)."""
    if served:
        return {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
    from openenv.core.env_server.mcp_types import CallToolAction
    return CallToolAction(tool_name=call.name, arguments=call.arguments)


def list_action(served: bool) -> Any:
    if served:
        return {"type": "list_tools"}
    from openenv.core.env_server.mcp_types import ListToolsAction
    return ListToolsAction()


def tool_result_text(fields: dict[str, Any]) -> str:
    """A CallToolObservation's result as the environment's reply: the text of its content (MCP's
    CallToolResult), else its data as JSON; an error as 'error: ...'."""
    error = fields.get("error")
    if error:
        return f"error: {error.get('message', error) if isinstance(error, dict) else error}"
    result = fields.get("result")
    if not isinstance(result, dict):
        return as_text(result)
    texts = [c.get("text") for c in result.get("content") or () if isinstance(c, dict)]
    text = "\n".join(t for t in texts if t is not None) if texts else as_text(result.get("data"))
    return f"error: {text}" if result.get("is_error") else text


# ---- a served environment's sessions ----

@dataclass
class Session:
    """One WebSocket session of a served environment (one episode): OpenEnv's client and what
    its reset returned (a StepResult)."""

    client: Any
    first: Any = None

    def step(self, action: Any) -> Any:
        return self.client.step(action)

    def close(self) -> None:
        self.client.close()


CAPACITY = re.compile(r"CAPACITY_REACHED|at capacity", re.IGNORECASE)


def open_session(url: str, reset_kwargs: dict[str, Any], already_open: int,
                 timeout_s: float | None = 300.0, retry_s: float = 1.0) -> Session:
    """A new session with the served environment, reset (the server passes on the keys its reset
    takes). A server at its session limit: EnvironmentFull while `already_open` of this run's
    sessions are open (an episode waits for one of them; a session just closed may take the
    server a moment to free, so the refusal is retried for `retry_s`), else a one-line error
    naming the fix. The client gives up on a message after `timeout_s` (None: no limit)."""
    from openenv.core import GenericEnvClient
    deadline = time.monotonic() + retry_s
    while True:
        client = GenericEnvClient(base_url=url, connect_timeout_s=min(timeout_s or 60.0, 60.0),
                                  message_timeout_s=timeout_s).sync()
        try:
            return Session(client, client.reset(**reset_kwargs))
        except Exception as e:   # noqa: BLE001 - a RuntimeError or ConnectionClosed, by timing
            close(client)
            if not (CAPACITY.search(str(e)) or "ConnectionClosed" in type(e).__name__):
                raise
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            if already_open:
                raise EnvironmentFull(f"the OpenEnv server at {url} holds {already_open} of this "
                                      f"run's sessions and refused another ({e})") from None
            raise RuntimeError(
                f"the OpenEnv server at {url} refused a session while none of this run's was open "
                f"({e}): another client holds its sessions, or it accepts none; serve the "
                "environment with create_app(..., max_concurrent_envs=N) and "
                "SUPPORTS_CONCURRENT_SESSIONS = True on the Environment") from None


def close(session: Any) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - a session the server already dropped
        pass


def close_soon(session: Any) -> None:
    """Close a session that stopped answering, in a daemon thread (closing may block too)."""
    threading.Thread(target=close, args=(session,), daemon=True, name="openenv-close").start()
