"""The policy behind an OpenAI-compatible endpoint (docs/environments.md), so that an external
agent harness can run episodes against it while posttrain records the exact tokens it trains on.

    GET  /v1/models
    POST /v1/chat/completions      messages -> the policy's reply
    POST /v1/completions           a prompt (text or token ids) -> the policy's continuation
    (the same under /s/<session>/v1/...: one episode's conversation, kept by the server)

Each reply carries vLLM's field names for the tokens: `prompt_token_ids` beside the choices, and
in each choice `token_ids` and `logprobs` (chat: `logprobs.content[i].logprob`; completions:
`logprobs.token_logprobs`). The sampling temperature and top_p are the trainer's (the log-probs
it trains with are computed at them); a request's `max_tokens` can only lower the rollout's.

It listens on loopback and, like the viewer, refuses a request whose Host header is not its own
address (DNS rebinding). A standard-library server: a handful of JSON routes need no framework.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from posttrain.util.hosts import host_allowed

MAX_BODY = 16 * 1024 * 1024     # bytes of one request


class Turn(Protocol):
    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class PolicyBackend(Protocol):
    """One session's policy: `chat` and `complete` each sample one turn. `sampling`: the
    request's temperature, top_p and stop (a training session ignores them)."""

    def chat(self, messages: list[dict[str, Any]], tools: list | None = None,
             max_tokens: int | None = None, **sampling: Any) -> Turn: ...

    def complete(self, prompt: str | list[int], max_tokens: int | None = None,
                 **sampling: Any) -> Turn: ...


class RequestError(ValueError):
    """A request the endpoint answers with 400 (a malformed body; rollout/driven.py's
    EpisodeOver, an episode whose token budget is spent, is one too)."""


def token_texts(turn: Turn) -> list[str]:
    return list(getattr(turn, "tokens", None) or [str(t) for t in turn.completion_ids])


def chat_reply(turn: Turn, model: str) -> dict[str, Any]:
    content = [{"token": tok, "logprob": lp, "bytes": None, "top_logprobs": []}
               for tok, lp in zip(token_texts(turn), turn.logprobs)]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "prompt_token_ids": turn.prompt_ids,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": turn.text},
                         "finish_reason": turn.finish_reason, "token_ids": turn.completion_ids,
                         "logprobs": {"content": content}}],
            "usage": usage(turn)}


def completion_reply(turn: Turn, model: str) -> dict[str, Any]:
    tokens = token_texts(turn)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "prompt_token_ids": turn.prompt_ids,
            "choices": [{"index": 0, "text": turn.text, "finish_reason": turn.finish_reason,
                         "token_ids": turn.completion_ids,
                         "logprobs": {"tokens": tokens, "token_logprobs": turn.logprobs}}],
            "usage": usage(turn)}


def usage(turn: Turn) -> dict[str, int]:
    n, m = len(turn.prompt_ids), len(turn.completion_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def answer(backend: PolicyBackend, route: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    """One request's reply (RequestError: a 400)."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens={max_tokens!r}: a positive integer")
    if body.get("n", 1) != 1 or body.get("stream"):
        raise RequestError("n > 1 and stream are not supported: one turn per request")
    sampling = {k: body[k] for k in ("temperature", "top_p", "stop") if body.get(k) is not None}
    if route == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: a non-empty list of chat messages")
        return chat_reply(backend.chat(messages, body.get("tools"), max_tokens, **sampling), model)
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                            and all(isinstance(t, int) for t in prompt))):
            raise RequestError("prompt: a string or a list of token ids")
        return completion_reply(backend.complete(prompt, max_tokens, **sampling), model)
    raise KeyError(route)


class Endpoint:
    """The server: `add(backend)` opens a session and returns its base URL
    (`http://127.0.0.1:PORT/s/ID/v1`); `default` answers the plain `/v1` routes (posttrain
    serve). Exceptions a backend raises that are not RequestError are answered with 500."""

    def __init__(self, model: str = "policy", host: str = "127.0.0.1", port: int = 0,
                 default: PolicyBackend | None = None) -> None:
        self.model, self.default = model, default
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
        def allowed(self) -> bool:
            bound, port = self.server.server_address[:2]
            if host_allowed(self.headers.get("Host", ""), str(bound), port):
                return True
            self.send_json(403, error("Host is not the address this endpoint serves"))
            return False

        def do_GET(self) -> None:   # noqa: N802 (http.server's name)
            if self.allowed():
                backend, route = ep.backend(self.path)
                if route == "models" and backend is not None:
                    return self.send_json(200, {"object": "list", "data": [
                        {"id": ep.model, "object": "model", "owned_by": "posttrain"}]})
                self.send_json(404, error(f"no route {self.path}"))

        def do_POST(self) -> None:   # noqa: N802
            if not self.allowed():
                return
            size = self.headers.get("Content-Length") or "0"
            if not size.isdigit():
                return self.send_json(400, error("Content-Length: a non-negative integer"))
            if int(size) > MAX_BODY:
                return self.send_json(413, error(f"request body over {MAX_BODY} bytes"))
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


def send_json(handler: BaseHTTPRequestHandler, status: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}
