"""verifiers environments (PyPI `verifiers` 0.4, `import verifiers.v1`) as posttrain environments
(docs/environments.md): `data.task verifiers:ID` makes the taskset's tasks the problems, and each
episode is a verifiers rollout of its task, which drives the policy.

    posttrain episode thread -> verifiers Agent.run(task) -> harness (envs/verifiers_harness.py)
    -> verifiers' interception endpoint -> `PolicyClient.get_response` (here) -> posttrain's
    batched sampler (rollout/driven.py) -> exact token ids and log-probs back to verifiers

The task's rubric scores the rollout: its weighted sum is the episode's reward and each reward
function's weighted score is logged as its own source (env/reward_NAME). Tool calls: a chat
template that renders tools gets them (`tools=`); one that does not (SmolLM2's) gets them in a
system message, Hermes-style (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), and a
reply's calls are parsed from its text. Rollouts run on the local subprocess runtime (verifiers'
default is a remote sandbox) with posttrain's in-process chat harness, so nothing needs the
network. The verifiers version is pinned by the extra (`posttrain[verifiers]`): its API moves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import uuid
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.data.verifiers_tasks import load_taskset_tasks
from posttrain.envs.base import Driven, DrivingEnvironment, EpisodeTimeout, no_limit_as_none
from posttrain.envs.tools import parse_calls

# verifiers' loader imports a harness by a top-level module name: the harness module is
# registered under this one in sys.modules before the first rollout
HARNESS = "posttrain_verifiers_harness"
log = logging.getLogger("posttrain")
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


def make_client(policy: Any, renders_tools: bool):
    """A verifiers `Client` over one episode's PolicyClient (built lazily: verifiers imported)."""
    import verifiers.v1 as vf
    from verifiers.v1.clients.train import serialize_completion
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


class VerifiersEnvironment(DrivingEnvironment):
    """Each episode a verifiers rollout of the problem's task (`data.task verifiers:ID`), run
    on an event loop of its own (one thread, one interception server for all episodes)."""

    def __init__(self, max_turns: int = 4, harness: str = HARNESS, name: str = "verifiers",
                 timeout_s: float | None = None) -> None:
        # timeout_s: a rollout's limit; None: the episode's (env.episode_timeout_s, the policy
        # client's `time_left`), so the rollout is cancelled when the batch ends its episode
        self.max_turns, self.harness, self.name, self.timeout_s = max_turns, harness, name, timeout_s
        self.renders_tools = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._lock = threading.Lock()
        self._warned = False

    def start_batch(self) -> None:
        """Said once: a verifiers rubric scores the model's text where verifiers runs it, in the
        trainer's process, not in posttrain's reward sandbox (docs/safety.md)."""
        if not self._warned:
            self._warned = True
            log.warning("verifiers: the task's rubric (and any tool without a sandbox of its own) "
                        "reads the model's text in the trainer's process, outside posttrain's "
                        "reward sandbox (docs/safety.md)")

    def bind(self, tokenizer) -> "VerifiersEnvironment":
        """Tools go to the chat template when it renders them, else to a system message."""
        self.renders_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        return self

    def drive(self, policy: Any, problem: Problem) -> Driven:
        import verifiers.v1 as vf
        task = load_taskset_tasks(problem.meta["verifiers"])[problem.meta["verifiers_index"]]
        loop, server = self.started()
        key = vf.TrainClientConfig(base_url=f"http://episode-{uuid.uuid4().hex}.invalid/v1",
                                   api_key_var="POSTTRAIN_UNUSED")
        server.clients[key.model_dump_json()] = make_client(policy, self.renders_tools)
        try:
            agent = vf.Agent(vf.AgentConfig(
                model="policy", harness={"id": self.harness}, runtime=vf.SubprocessConfig(),
                client=key, sampling=vf.SamplingConfig(), max_turns=self.max_turns),
                interception=server)
            future = asyncio.run_coroutine_threadsafe(agent.run(task), loop)
            try:
                trace = future.result(self.time_limit(policy))
            except TimeoutError:
                future.cancel()
                raise EpisodeTimeout("the verifiers rollout passed its time limit (timeout_s, "
                                     "else env.episode_timeout_s)") from None
        finally:
            server.clients.pop(key.model_dump_json(), None)
        return driven(trace)

    def time_limit(self, policy: Any) -> float | None:
        """Seconds a rollout may still take: timeout_s, else what the episode has left (None:
        no limit; inf is None here, as Future.result cannot wait for inf)."""
        if self.timeout_s is not None:
            return no_limit_as_none(self.timeout_s)
        left = getattr(policy, "time_left", None)
        return no_limit_as_none(left()) if callable(left) else None

    def started(self):
        """The event loop thread and the interception server, started on the first episode."""
        with self._lock:
            if self._loop is None:
                from verifiers.v1.interception import InterceptionServer

                from posttrain.envs import verifiers_harness
                sys.modules.setdefault(HARNESS, verifiers_harness)
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name="verifiers").start()
                server = InterceptionServer()
                asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(60)
                self._loop, self._server = loop, server
            return self._loop, self._server

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                asyncio.run_coroutine_threadsafe(self._server.__aexit__(None, None, None),
                                                 self._loop).result(60)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop, self._server = None, None


def driven(trace) -> Driven:
    """A rollout's trace as the episode's end: the rubric's weighted sum and its parts, and its
    first error (a rubric or tool that failed: env_errors, and a run whose episodes mostly fail
    for reward.max_failing_steps steps stops with it)."""
    parts = {name: r.score * r.weight for name, r in trace.rewards.items() if r is not None}
    error = f"{trace.errors[0].type}: {trace.errors[0].message}" if trace.errors else None
    return Driven(float(trace.reward or 0.0), None, parts, error=error)
