"""The harness posttrain plays a verifiers seat with where the seat would play verifiers' plain
chat loop (`null`) or names no harness (envs/verifiers_env.py): the same loop, in process. The
policy is asked through the rollout's interception endpoint (so verifiers records the turn), a
reply with tool calls gets the tools' results (the task's and the taskset's MCP toolsets) and
asks again, a reply without one ends the segment. A task without a prompt gets no user message:
its environment opens the exchange (an interaction's first turn, relaunched here on the
conversation). verifiers' own `null` harness runs the same loop as a program it first installs
with `uv` from the network; this one needs nothing.

Its plugin id is `posttrain_verifiers_harness`, the name this module is registered under in
sys.modules before the environment loads (verifiers finds the one Harness a module exports in
`__all__`). Imports verifiers: loaded by verifiers only.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import verifiers.v1 as vf
from openai import AsyncOpenAI, BadRequestError
# verifiers.v1.dialects.chat (not exported by verifiers.v1): `message_to_wire`, a typed message as
# OpenAI JSON; verifiers.v1.harnesses.utils.mcp (not exported): the MCP client verifiers' own
# harnesses connect to a rollout's tool servers with
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

__all__ = ["ChatHarness"]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                tools, dispatch, servers = [], {}, {}
                if mcp_urls:
                    config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                             for name, url in mcp_urls.items()}}
                    tools, dispatch, servers = await connect_mcp(config, stack, set())
                await self.converse(client, ctx.model, messages, tools, dispatch, servers)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def converse(self, client, model, messages, tools, dispatch, servers) -> None:
        """Ask, run the reply's tool calls, ask again, until a reply calls no tool (or the
        rollout is stopped: the endpoint answers 400)."""
        while True:
            try:
                reply = await client.chat.completions.create(
                    model=model, messages=messages, **({"tools": tools} if tools else {}))
            except BadRequestError:
                return
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "name": call.function.name,
                                 "content": await self.run_tool(call, dispatch, servers)})

    async def run_tool(self, call, dispatch, servers) -> str:
        try:
            args = json.loads(call.function.arguments or "{}")
            if call.function.name not in dispatch:
                return f"error: unknown tool {call.function.name!r}"
            return str(await call_mcp(servers, dispatch, call.function.name, args))
        except Exception as e:  # noqa: BLE001 - a tool's error goes back to the model
            return f"error: {e}"
