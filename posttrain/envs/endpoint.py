"""The policy behind an OpenAI-compatible endpoint (docs/environments.md), so that an external
agent harness can run episodes against it while posttrain records the exact tokens it trains on.

    GET  /v1/models
    POST /v1/chat/completions      messages -> the policy's reply
    POST /v1/completions           a prompt (text or token ids) -> the policy's continuation
    (the same under /s/<session>/v1/...: one episode's conversation, kept by the server)

Each reply carries vLLM's fields for the tokens where vLLM puts them: each choice has `token_ids`
and `logprobs` (chat: `logprobs.content[i].logprob`; completions: `logprobs.token_logprobs`);
`prompt_token_ids` is beside the choices in a chat reply (vLLM's ChatCompletionResponse) and in
each choice of a completion (CompletionResponseChoice). `return_tokens_as_token_ids: true` writes
each log-prob's token as `token_id:N`, as vLLM does. A chat request that offers `tools` gets the
reply's Hermes-style `<tool_call>{...}</tool_call>` blocks as OpenAI `message.tool_calls`
(finish_reason `tool_calls`, content the text before the first call or null), parsed by
envs/tools.py `parse_calls`; a reply with a malformed call stays text, as vLLM's hermes parser
leaves it. The sampling temperature and top_p are the trainer's (the log-probs it trains with are
computed at them); a request's `max_tokens` can only lower the rollout's.

It listens on loopback, and a web page open in the user's browser must not be able to drive it:
a request whose Host header is not its own address (DNS rebinding) or whose Origin, when sent,
is another site is refused (403), and a POST must be `Content-Type: application/json` (415), which
a page cannot send cross-site without a CORS preflight this server never grants. Every sampling
field and token id is checked before the policy sees it (400 naming the field), and a client
socket idle for `client_timeout_s` is dropped, so a silent client cannot hold a thread forever.
A standard-library server: a handful of JSON routes need no framework.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlparse

from posttrain.envs.tools import parse_calls
from posttrain.util.hosts import host_allowed

MAX_BODY = 16 * 1024 * 1024     # bytes of one request
CLIENT_TIMEOUT_S = 60.0         # a client socket that sends or reads nothing this long is dropped
MAX_TOKENS = 1 << 20            # the largest max_tokens a request may name (the rollout's caps it)
MAX_STOP = 16                   # stop strings in one request, each 1..MAX_STOP_CHARS characters
MAX_STOP_CHARS = 1000
# number fields: (lowest, lowest excluded, highest); penalties are accepted and not applied
NUMBERS = {"temperature": (0.0, False, math.inf), "top_p": (0.0, True, 1.0),
           "presence_penalty": (-2.0, False, 2.0), "frequency_penalty": (-2.0, False, 2.0)}


class Turn(Protocol):
    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class PolicyBackend(Protocol):
    """One session's policy: `chat` and `complete` each sample one turn. `sampling`: the
    request's temperature, top_p and stop (a training session ignores them). `shown_as`: the
    last chat reply's content as the client got it, its tool calls parsed out (a training
    session checks the next request's history against it; a stateless server ignores it)."""

    def chat(self, messages: list[dict[str, Any]], tools: list | None = None,
             max_tokens: int | None = None, **sampling: Any) -> Turn: ...

    def complete(self, prompt: str | list[int], max_tokens: int | None = None,
                 **sampling: Any) -> Turn: ...

    def shown_as(self, content: str | None) -> None: ...


class RequestError(ValueError):
    """A request the endpoint answers with 400 (a malformed body; rollout/driven.py's
    EpisodeOver, an episode whose token budget is spent, is one too)."""


def token_texts(turn: Turn, as_ids: bool = False) -> list[str]:
    """Each sampled token as text, or as vLLM's `token_id:N` (return_tokens_as_token_ids)."""
    if as_ids:
        return [f"token_id:{t}" for t in turn.completion_ids]
    return list(getattr(turn, "tokens", None) or [str(t) for t in turn.completion_ids])


def split_tool_calls(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a chat reply offered the tools `names`: its
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, parsed by envs/tools.py
    `parse_calls` (as the verifiers harness reads them), in OpenAI's format, and the text before
    the first call (None when there is none). No call, or any call malformed or naming a tool
    not offered: the whole text, no calls (vLLM's hermes parser also keeps a reply it cannot
    parse as text)."""
    if not names or "<tool_call>" not in text:
        return text, []
    calls, errors = parse_calls(text, dict.fromkeys(names), "json")
    if errors or not calls:
        return text, []
    return text.split("<tool_call>", 1)[0].strip() or None, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        for c in calls]


def chat_reply(turn: Turn, model: str, content: str | None, calls: list[dict[str, Any]],
               as_ids: bool = False) -> dict[str, Any]:
    """A chat completion as vLLM writes it: `prompt_token_ids` beside the choices; `content`
    and `calls` the reply's text and tool calls (split_tool_calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    lps = [{"token": tok, "logprob": lp, "bytes": None, "top_logprobs": []}
           for tok, lp in zip(token_texts(turn, as_ids), turn.logprobs)]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "prompt_token_ids": turn.prompt_ids,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if calls else turn.finish_reason,
                         "token_ids": turn.completion_ids, "logprobs": {"content": lps}}],
            "usage": usage(turn)}


def completion_reply(turn: Turn, model: str, as_ids: bool = False) -> dict[str, Any]:
    """A completion as vLLM writes it: `prompt_token_ids` in the choice, beside `token_ids`."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": turn.text, "finish_reason": turn.finish_reason,
                         "prompt_token_ids": turn.prompt_ids, "token_ids": turn.completion_ids,
                         "logprobs": {"tokens": token_texts(turn, as_ids),
                                      "token_logprobs": turn.logprobs}}],
            "usage": usage(turn)}


def usage(turn: Turn) -> dict[str, int]:
    n, m = len(turn.prompt_ids), len(turn.completion_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def answer(backend: PolicyBackend, route: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    """One request's reply (RequestError, naming the field: a 400)."""
    max_tokens, sampling = sampling_fields(body)
    as_ids = body.get("return_tokens_as_token_ids")
    if as_ids is not None and not isinstance(as_ids, bool):
        raise RequestError(f"return_tokens_as_token_ids={str(as_ids)[:40]!r}: true or false")
    if route == "chat/completions":
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise RequestError("messages: a non-empty list of chat messages, each with a 'role'")
        tools, parse = body.get("tools"), body.get("tool_choice") != "none"
        names = tool_names(tools)
        turn = backend.chat(messages, tools, max_tokens, **sampling)
        content, calls = split_tool_calls(turn.text, names if parse else [])
        if calls:   # (a training session then expects this content back in the history)
            backend.shown_as(content)
        return chat_reply(turn, model, content, calls, bool(as_ids))
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise RequestError("prompt: a string or a non-empty list of token ids")
        if isinstance(prompt, list):
            check_token_ids(prompt, vocab_size(backend))
        turn = backend.complete(prompt, max_tokens, **sampling)
        return completion_reply(turn, model, bool(as_ids))
    raise KeyError(route)


def tool_names(tools: Any) -> list[str]:
    """The names of a request's tools, each checked to be OpenAI's (and vLLM's)
    `{"type": "function", "function": {"name": ...}}`; none when `tools` is absent."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"tools={str(tools)[:80]!r}: a list of tool definitions")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise RequestError(f"tools[{i}]={str(t)[:80]!r}: a tool definition "
                               '{"type": "function", "function": {"name": ..., "parameters": ...}}')
    return [t["function"]["name"] for t in tools]


def sampling_fields(body: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    """A request's max_tokens and the sampling settings passed to the policy (temperature, top_p,
    stop), every field checked: NaN, a negative temperature or a million stop strings never
    reach the engine. A field that is absent or null is the server's default."""
    for name, (lo, lo_open, hi) in NUMBERS.items():
        v = body.get(name)
        if v is not None and not (_is_number(v) and math.isfinite(v)
                                  and (lo < v if lo_open else lo <= v) and v <= hi):
            where = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi < math.inf else f">= {lo:g}"
            raise RequestError(f"{name}={v!r}: a finite number {where}")
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is not None and not (_is_int(v) and 1 <= v <= MAX_TOKENS):
            raise RequestError(f"{name}={v!r}: an integer from 1 to {MAX_TOKENS}")
    if body.get("n") is not None and not (_is_int(body["n"]) and body["n"] == 1):
        raise RequestError(f"n={body['n']!r}: only 1 is supported (one turn per request)")
    if body.get("stream") not in (None, False):
        raise RequestError(f"stream={body['stream']!r}: streaming is not supported")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -(2 ** 63) <= seed < 2 ** 64):
        raise RequestError(f"seed={seed!r}: a 64-bit integer")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stops, list) and len(stops) <= MAX_STOP and all(
            isinstance(x, str) and 1 <= len(x) <= MAX_STOP_CHARS for x in stops)):
        raise RequestError(f"stop={str(stop)[:80]!r}: a string or a list of at most {MAX_STOP} "
                           f"strings of 1 to {MAX_STOP_CHARS} characters")
    given = body.get("max_completion_tokens") or body.get("max_tokens")
    return given, {k: body[k] for k in ("temperature", "top_p", "stop") if body.get(k) is not None}


def check_token_ids(ids: list[Any], vocab: int | None) -> None:
    """Every prompt id an integer of the policy's vocabulary: an id past the embedding would
    fail inside the engine (on a GPU, a device-side assert that ends the process)."""
    for i, t in enumerate(ids):
        if not (_is_int(t) and t >= 0 and (vocab is None or t < vocab)):
            bound = f"0 <= id < {vocab}" if vocab is not None else "0 <= id"
            raise RequestError(f"prompt[{i}]={str(t)[:40]!r}: token ids are integers {bound} "
                               "(the policy's vocabulary)")


def vocab_size(backend: PolicyBackend) -> int | None:
    """The number of token ids the backend's tokenizer knows: its `vocab_size`, or the length
    of its tokenizer (a training session's, rollout/driven.py's PolicyClient, sits on its
    recorder); None when neither is there (ids are then only checked to be non-negative)."""
    size = getattr(backend, "vocab_size", None)
    if size is None:
        tok = getattr(backend, "tokenizer", None) or getattr(
            getattr(backend, "recorder", None), "tokenizer", None)
        size = len(tok) if tok is not None else None
    return size


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def origin_allowed(origin: str | None, bound: str, port: int) -> bool:
    """A request's Origin header: absent (a client that is not a browser), or this server's own
    address (the same names host_allowed accepts). Any other site, and the opaque origin
    `null` (a sandboxed frame, a file:// page), is refused."""
    if origin is None:
        return True
    url = urlparse(origin.strip())
    try:
        given = url.port or 80
    except ValueError:
        return False
    name = url.hostname or ""
    name = f"[{name}]" if ":" in name else name
    return url.scheme == "http" and host_allowed(f"{name}:{given}", bound, port)


class Endpoint:
    """The server: `add(backend)` opens a session and returns its base URL
    (`http://127.0.0.1:PORT/s/ID/v1`); `default` answers the plain `/v1` routes (posttrain
    serve). Exceptions a backend raises that are not RequestError are answered with 500.
    `client_timeout_s`: how long one read or write of a client's socket may wait."""

    def __init__(self, model: str = "policy", host: str = "127.0.0.1", port: int = 0,
                 default: PolicyBackend | None = None,
                 client_timeout_s: float = CLIENT_TIMEOUT_S) -> None:
        self.model, self.default, self.client_timeout_s = model, default, client_timeout_s
        self.sessions: dict[str, PolicyBackend] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def add(self, backend: PolicyBackend) -> str:
        sid = uuid.uuid4().hex[:16]
        with self.lock:
            self.sessions[sid] = backend
        return self.base_url.replace("/v1", f"/s/{sid}/v1")

    def drop(self, url: str) -> None:
        sid = url.rsplit("/s/", 1)[-1].split("/")[0]
        with self.lock:
            self.sessions.pop(sid, None)

    def backend(self, path: str) -> tuple[PolicyBackend | None, str]:
        """The session a path names and the route after /v1/ (None: no such session)."""
        if path.startswith("/s/"):
            sid, _, rest = path[3:].partition("/")
            with self.lock:
                backend = self.sessions.get(sid)
        else:
            backend, rest = self.default, path.lstrip("/")
        return backend, rest[len("v1/"):] if rest.startswith("v1/") else "?"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(ep: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = ep.client_timeout_s   # (socketserver: each read and write of the client socket)

        def allowed(self, post: bool = False) -> bool:
            bound, port = self.server.server_address[:2]
            why = refusal(self.headers, str(bound), port, post)
            if why is not None:
                self.send_json(why[0], error(why[1]))
            return why is None

        def do_GET(self) -> None:   # noqa: N802 (http.server's name)
            if self.allowed():
                backend, route = ep.backend(self.path)
                if route == "models" and backend is not None:
                    return self.send_json(200, {"object": "list", "data": [
                        {"id": ep.model, "object": "model", "owned_by": "posttrain"}]})
                self.send_json(404, error(f"no route {self.path}"))

        def do_POST(self) -> None:   # noqa: N802
            if not self.allowed(post=True):
                return
            size = self.headers.get("Content-Length") or "0"
            backend, route = ep.backend(self.path)
            if backend is None:
                return self.send_json(404, error(f"no session or route {self.path}"))
            try:
                body = json.loads(self.rfile.read(int(size)) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                self.send_json(200, answer(backend, route, body, ep.model))
            except KeyError:
                self.send_json(404, error(f"no route {self.path}"))
            except ValueError as e:   # (RequestError, JSONDecodeError, an episode that is over)
                self.send_json(400, error(str(e)))
            except Exception as e:  # noqa: BLE001 - the client gets the failure, the server lives
                self.send_json(500, error(f"{type(e).__name__}: {e}", "server_error"))

        def send_json(self, status: int, obj: dict[str, Any]) -> None:
            send_json(self, status, obj)

        def log_message(self, *args) -> None:
            pass
    return Handler


def refusal(headers, bound: str, port: int, post: bool) -> tuple[int, str] | None:
    """Why a request is refused before its body is read, as (status, message); None: it is not.
    A foreign Host (DNS rebinding) or Origin (another site's page) is a 403; a POST that is not
    JSON (all a page can send without a CORS preflight) a 415; a bad or large length a 400/413."""
    if not host_allowed(headers.get("Host", ""), bound, port):
        return 403, "Host is not the address this endpoint serves"
    if not origin_allowed(headers.get("Origin"), bound, port):
        return 403, (f"Origin {headers['Origin'][:80]!r} is another site: only a client on this "
                     "machine may call the policy")
    if not post:
        return None
    if headers.get_content_type() != "application/json":
        return 415, (f"Content-Type {headers.get('Content-Type')!r}: send the body as "
                     "Content-Type: application/json")
    size = headers.get("Content-Length") or "0"
    if not size.isdigit():
        return 400, "Content-Length: a non-negative integer"
    if int(size) > MAX_BODY:
        return 413, f"request body over {MAX_BODY} bytes"
    return None


def send_json(handler: BaseHTTPRequestHandler, status: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}
