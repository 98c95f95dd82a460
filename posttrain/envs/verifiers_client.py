"""The model client posttrain hands verifiers (envs/verifiers_env.py): every model call of an
episode, whichever seat's harness makes it, reaches `PolicyVFClient.get_response` through
verifiers' interception server, is answered by the policy client of the seat's row (posttrain's
batched sampler, rollout/driven.py) and goes back to verifiers with the exact token ids and
log-probs sampled.

Tool calls: a chat template that renders tools gets them (`tools=`); one that does not
(SmolLM2's) gets them in a system message, Hermes-style (`<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`), and a reply's calls are parsed from its text."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

from posttrain.envs.tools import parse_calls

TOOL_PROMPT = ("You can call functions. To call one, write <tool_call>{{\"name\": NAME, "
               "\"arguments\": {{...}}}}</tool_call>; its result comes back in the next message. "
               "When you know the answer, write it without a call.\nFunctions:\n{schemas}")


def tool_schemas(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """verifiers' tools as OpenAI function schemas (what chat templates take)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}}
            for t in tools or []] or None


def with_tool_prompt(messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools described in the system message (the same text every turn, so the episode's
    history stays a prefix of the next request)."""
    text = TOOL_PROMPT.format(schemas="\n".join(json.dumps(s["function"]) for s in schemas))
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": f"{messages[0].get('content') or ''}\n\n{text}"},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def make_client(policy_for, renders_tools: bool):
    """A verifiers `Client` answering one episode's calls: `policy_for(session_id)` is the policy
    client of the calling trace's row (built lazily: verifiers imported)."""
    import verifiers.v1 as vf
    # verifiers.v1.clients.train (not exported by verifiers.v1): `serialize_completion` writes a
    # Response's OpenAI wire form, as verifiers' own TrainClient returns it to the harness
    from verifiers.v1.clients.train import serialize_completion
    # verifiers.v1.dialects.chat (not exported): `message_to_wire`, a typed message as OpenAI JSON
    from verifiers.v1.dialects.chat import message_to_wire

    class PolicyVFClient(vf.Client):
        async def get_response(self, dialect, body, sampling, session_id=None, turn=None,
                               headers=None):
            request = turn if turn is not None else dialect.parse_request(body)
            messages = [message_to_wire(m) for m in (request.prompt if turn is not None
                                                     else request.messages)]
            schemas = tool_schemas(request.tools)
            if schemas and not renders_tools:
                messages, schemas = with_tool_prompt(messages, schemas), None
            policy = policy_for(session_id)
            out = await in_thread(policy.chat, messages, schemas,
                                  body.get("max_tokens") or sampling.max_tokens)
            content, calls = split_calls(out.text, request.tools)
            policy.shown_as(content)
            response = vf.Response(
                id=f"posttrain-{uuid.uuid4().hex[:12]}", created=int(time.time()),
                model=body["model"], message=vf.AssistantMessage(content=content, tool_calls=calls),
                finish_reason="tool_calls" if calls else out.finish_reason,
                usage=vf.Usage(prompt_tokens=len(out.prompt_ids),
                               completion_tokens=len(out.completion_ids)),
                tokens=vf.TurnTokens(prompt_ids=out.prompt_ids, completion_ids=out.completion_ids,
                                     completion_logprobs=out.logprobs))
            response.raw = serialize_completion(response, body["model"])
            return response

        async def relay(self, *args, **kwargs):   # (streaming is for evaluation clients)
            raise NotImplementedError("posttrain's client answers whole turns")

        async def relay_aux(self, *args, **kwargs):
            raise NotImplementedError("posttrain's client answers whole turns")
    return PolicyVFClient()


async def in_thread(fn, *args):
    """fn(*args) in a thread of its own, awaited: the sampler answers once every episode of the
    step has asked, so their blocking calls must not queue behind an executor's cap."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda err=e: done.done() or done.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))
    threading.Thread(target=run, daemon=True, name="vf-turn").start()
    return await done


def split_calls(text: str, tools: list[Any] | None):
    """(content, tool calls) of a reply: Hermes-style calls parsed from its text when the
    request offered tools; a malformed call stays text (the harness ends the rollout on it)."""
    if not tools or "<tool_call>" not in text:
        return text, None
    import verifiers.v1 as vf
    calls, _ = parse_calls(text, {t.name: None for t in tools}, "json")
    if not calls:
        return text, None
    return text.split("<tool_call>", 1)[0].strip() or None, [
        vf.ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=c.name, arguments=json.dumps(c.arguments))
        for c in calls]
