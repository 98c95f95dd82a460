"""What a web page, a buggy harness or an idle client can do to the local HTTP servers: the
policy's OpenAI-compatible endpoint (envs/endpoint.py, `posttrain serve`) and the viewer
(view/server.py). A page's cross-site POST is refused, every sampling field and token id is
checked (400 naming the field), and a client that sends nothing is dropped."""

import http.client
import json
import math
import socket
import time
from types import SimpleNamespace

import pytest

from posttrain.envs.endpoint import Endpoint
from posttrain.rollout.driven import PolicyTurn
from posttrain.view.server import serve

VOCAB = 100


class Echo:
    """A backend with a 100-token vocabulary that answers every request with the same turn."""

    vocab_size = VOCAB

    def __init__(self):
        self.calls = []

    def chat(self, messages, tools=None, max_tokens=None, **sampling):
        self.calls.append(sampling)
        return PolicyTurn("ok", [1], [7, 8], [-0.5, -0.25], "stop", ["o", "k"])

    def complete(self, prompt, max_tokens=None, **sampling):
        self.calls.append(sampling)
        return PolicyTurn("ok", list(prompt) if isinstance(prompt, list) else [9], [7, 8],
                          [-0.5, -0.25], "stop", ["o", "k"])


@pytest.fixture(scope="module")
def shared_endpoint():
    ep = Endpoint(default=Echo())
    yield ep
    ep.close()


@pytest.fixture
def endpoint(shared_endpoint):
    shared_endpoint.default.calls.clear()
    return shared_endpoint


def raw_post(ep, path, body: bytes, headers) -> tuple[int, dict]:
    host, port = ep.server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", path, body, {"Content-Length": str(len(body)), **headers})
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"{}")
    conn.close()
    return out


def post_json(ep, path, body, origin=None):
    headers = {"Content-Type": "application/json"} | ({"Origin": origin} if origin else {})
    return raw_post(ep, path, json.dumps(body).encode(), headers)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_a_web_pages_post_is_refused_and_a_local_clients_answered(endpoint):
    """A page can send a `text/plain` POST to 127.0.0.1 without a CORS preflight; the browser
    adds its Origin. Neither gets through; same-origin and Origin-less JSON clients do."""
    port = endpoint.server.server_address[1]
    body = json.dumps(CHAT).encode()
    status, _ = raw_post(endpoint, "/v1/chat/completions", body,
                         {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert 400 <= status < 500
    status, reply = raw_post(endpoint, "/v1/chat/completions", body, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in reply["error"]["message"]
    for origin in ("http://evil.example", "null", f"http://evil.example:{port}",
                   f"https://127.0.0.1:{port}", "http://127.0.0.1:1"):
        status, reply = post_json(endpoint, "/v1/chat/completions", CHAT, origin)
        assert status == 403 and "Origin" in reply["error"]["message"], origin
    for origin in (None, f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        assert post_json(endpoint, "/v1/chat/completions", CHAT, origin)[0] == 200, origin
    status, _ = raw_post(endpoint, "/v1/chat/completions", body,
                         {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200


BAD = [("temperature", math.nan), ("temperature", -0.5), ("temperature", math.inf),
       ("temperature", "hot"), ("temperature", True), ("top_p", 0), ("top_p", 1.5),
       ("top_p", math.nan), ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True),
       ("max_tokens", 10 ** 9), ("max_completion_tokens", -3), ("n", 2), ("n", "1"),
       ("stream", True), ("stop", 5), ("stop", [""]), ("stop", ["x"] * 17), ("stop", ["a", 3]),
       ("stop", "y" * 1001), ("seed", "x"), ("seed", 1.5), ("seed", 2 ** 70),
       ("presence_penalty", math.nan), ("frequency_penalty", 3)]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={str(v)[:12]}" for n, v in BAD])
def test_a_bad_sampling_field_is_a_400_naming_it(endpoint, name, value):
    status, reply = post_json(endpoint, "/v1/chat/completions", {**CHAT, name: value})
    assert status == 400 and reply["error"]["message"].startswith(f"{name}="), reply
    assert endpoint.default.calls == []          # the policy never saw it


@pytest.mark.parametrize("prompt", [[-1], [VOCAB], [3, VOCAB + 5], [1, True], [1.0], [[2, -7]]])
def test_a_token_id_outside_the_vocabulary_is_a_400(endpoint, prompt):
    status, reply = post_json(endpoint, "/v1/completions", {"prompt": prompt})
    assert status == 400 and reply["error"]["message"].startswith("prompt["), reply
    assert endpoint.default.calls == []


def test_good_fields_reach_the_policy(endpoint):
    body = {"prompt": [0, VOCAB - 1], "temperature": 0, "top_p": 1, "max_tokens": 5, "n": 1,
            "stop": "x", "seed": 3, "stream": False, "presence_penalty": 0.5, "top_k": None}
    status, reply = post_json(endpoint, "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["prompt_token_ids"] == [0, VOCAB - 1]
    assert endpoint.default.calls == [{"temperature": 0, "top_p": 1, "stop": "x"}]


def test_the_vocabulary_is_read_from_a_served_model_or_a_training_session(tokenizer):
    from posttrain.envs.endpoint import vocab_size
    from posttrain.sampling.service import Sampling
    from posttrain.stages.serve import ServedModel
    assert vocab_size(ServedModel(Sampling(cfg=None, engine=None, tokenizer=tokenizer))) == len(tokenizer)
    session = SimpleNamespace(recorder=SimpleNamespace(tokenizer=tokenizer))  # (driven.PolicyClient)
    assert vocab_size(session) == len(tokenizer)


def dropped_within(address, seconds: float) -> float:
    """Connect, send nothing, and time how long the server keeps the socket open."""
    start = time.monotonic()
    with socket.create_connection(address, timeout=seconds) as sock:
        try:
            assert sock.recv(1) == b""          # the server closed it
        except (socket.timeout, TimeoutError):
            pytest.fail(f"an idle client was still connected after {seconds} s")
        except ConnectionResetError:
            pass
    return time.monotonic() - start


def test_an_idle_client_is_dropped_by_the_endpoint_and_the_viewer(tmp_path):
    ep = Endpoint(default=Echo(), client_timeout_s=0.3)
    try:
        assert dropped_within(ep.server.server_address[:2], 5.0) < 4.0
        assert post_json(ep, "/v1/chat/completions", CHAT)[0] == 200   # it still serves
    finally:
        ep.close()
    viewer = serve([tmp_path], port=0, background=True, client_timeout_s=0.3)
    try:
        assert dropped_within(viewer.server_address[:2], 5.0) < 4.0
    finally:
        viewer.shutdown()
        viewer.server_close()


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    """1e-300 passes the field's range (>= 0) but dividing the logits by it makes them infinite
    and sampling fails (on a GPU, a device-side assert): below vLLM's epsilon it is greedy."""
    from posttrain.stages.serve import GREEDY_BELOW, request_params
    for t in (1e-300, 0.0, GREEDY_BELOW / 2):
        params = request_params({"temperature": t}, 8, 1.0, 1.0)
        assert params.greedy and params.temperature == 1.0
    warm = request_params({"temperature": 0.7}, 8, 1.0, 1.0)
    assert not warm.greedy and warm.temperature == 0.7
