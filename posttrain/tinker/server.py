"""The routes the `tinker` SDK (0.38) calls, over TinkerService (service.py). A standard-library
server, as the policy's OpenAI endpoint (envs/endpoint.py): a thread per connection, which the
long-polled `retrieve_future` needs, and no framework for two dozen JSON routes.

    POST /api/v1/client/config, /create_session, /session_heartbeat, /telemetry,
         /sessions/ID/finish                                     (session life)
    POST /api/v1/create_model, /forward_backward (protobuf), /optim_step, /save_weights,
         /save_weights_for_sampler, /load_weights, /asample      (futures)
    POST /api/v1/retrieve_future                                 (long poll; protobuf results)
    POST /api/v1/get_info, /create_sampling_session, /weights_info
    GET  /api/v1/samplers/ID, /healthz, /get_server_capabilities,
         /training_runs/ID/checkpoints

It listens on loopback unless told otherwise; bound elsewhere it needs `--api_key` (every request's
X-API-Key must equal it; the SDK sends TINKER_API_KEY, which must start with `tml-`). A Host
header that is not the server's own is refused (DNS rebinding), and a body over
`max_request_mb` is refused before it is read.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from posttrain.tinker.futures import MAX_BATCH, Future, Worker
from posttrain.tinker.sampler import batch_key
from posttrain.tinker.service import TinkerService
from posttrain.tinker.wire import WireError, decode_forward_backward
from posttrain.util.hosts import host_allowed

log = logging.getLogger("posttrain")
PROTOBUF = "application/x-protobuf"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TinkerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: TinkerService,
                 api_key: str | None = None, max_request_mb: float = 256.0,
                 max_batch: int = MAX_BATCH, batch_clients: bool = False) -> None:
        if api_key is not None and not api_key.startswith(("tml-", "eyJ")):
            raise ValueError(f"--api_key {api_key[:4]}...: the tinker SDK sends only keys starting "
                             "with 'tml-' (TINKER_API_KEY); choose one such as tml-<random>")
        if address[0] not in LOOPBACK and not api_key:
            raise ValueError(f"posttrain tinker-serve on {address[0]} (not loopback) needs "
                             "--api_key KEY: any client on the network could train and sample")
        super().__init__(address, Handler)
        self.service, self.api_key = service, api_key
        self.max_bytes = int(max_request_mb * 2**20)
        self.worker = Worker((WireError, ValueError, KeyError), max_batch)
        self.batch_clients = batch_clients   # forward_backwards of several clients in one batch
        self.requests = 0

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def shutdown(self) -> None:
        self.worker.stop()
        super().shutdown()
        self.service.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: TinkerServer

    def log_message(self, fmt: str, *args: Any) -> None:   # (the run's log, not stderr)
        log.debug("tinker-serve: " + fmt, *args)

    def do_GET(self) -> None:
        self._handle(GET_ROUTES)

    def do_POST(self) -> None:
        self._handle(POST_ROUTES)

    def _handle(self, routes: list) -> None:
        try:
            self._check_caller()
            body = self._body()
            for pattern, route in routes:
                m = pattern.fullmatch(self.path.split("?")[0])
                if m:
                    self.server.requests += 1
                    return self._send(200, route(self.server, body, *m.groups()))
            raise HTTPError(404, f"no route {self.command} {self.path}")
        except (BrokenPipeError, ConnectionResetError):   # (the client went away: nothing to answer)
            self.close_connection = True
        except HTTPError as e:
            self.close_connection = True
            self._send(e.status, {"error": str(e), "category": "user"})
        except (WireError, ValueError, KeyError, TypeError, AttributeError) as e:   # (a malformed body)
            self._send(400, {"error": " ".join(str(e).split()), "category": "user"})
        except Exception as e:   # (the server's fault: answered, never a dropped connection,
            log.exception("tinker-serve: %s %s failed", self.command, self.path)   # which the SDK retries for hours)
            self._send(500, {"error": f"{type(e).__name__}: {e}", "category": "server"})

    def _check_caller(self) -> None:
        s = self.server
        if not host_allowed(self.headers.get("Host", ""), s.server_address[0], s.server_address[1]):
            raise HTTPError(403, "Host header is not this server's address")
        key = self.headers.get("X-API-Key", "")
        if s.api_key and not hmac.compare_digest(key.encode(), s.api_key.encode()):
            raise HTTPError(401, "X-API-Key is not this server's key (TINKER_API_KEY)")

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        if n < 0:
            raise HTTPError(400, f"Content-Length {n}")
        if n > self.server.max_bytes:
            self.close_connection = True
            raise HTTPError(413, f"request body of {n} bytes is over --max_request_mb")
        raw = self.rfile.read(n) if n else b""
        if self.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=self.server.max_bytes)
        if PROTOBUF in self.headers.get("Content-Type", ""):
            return raw
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError as e:
            raise HTTPError(400, f"the body is not JSON ({e})") from None

    def _send(self, status: int, out: Any) -> None:
        if isinstance(out, Future):
            out = future_body(out)
        data, kind = (out, PROTOBUF) if isinstance(out, bytes) else (json.dumps(out).encode(), "application/json")
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def future_body(f: Future) -> dict[str, Any]:
    return {"request_id": f.request_id}


def submitted(f: Future, **extra: Any) -> dict[str, Any]:
    return {"request_id": f.request_id, **extra}


def retrieve(server: TinkerServer, body: dict[str, Any]) -> Any:
    f = server.worker.retrieve(str(body.get("request_id", "")))
    if f is None:
        return {"error": f"request {body.get('request_id')!r} is unknown here (results are kept "
                         "10 minutes)", "category": "user"}
    if not f.done:
        return {"type": "try_again", "request_id": f.request_id, "queue_state": "active"}
    return f.error if f.error is not None else f.result


def _model_id(body: dict[str, Any]) -> str:
    return f"{body['session_id']}:train:{int(body['model_seq_id'])}"


def create_model(server: TinkerServer, body: dict[str, Any]) -> dict[str, Any]:
    model_id = _model_id(body)
    server.worker.expect(model_id, 1)
    # (owned by the client: none of its requests runs before it)
    f = server.worker.submit(lambda: server.service.create_model(body, model_id), model_id)
    return submitted(f, model_id=model_id)


def load_weights(server: TinkerServer, body: dict[str, Any]) -> dict[str, Any]:
    if "model_id" in body:      # (the deprecated load_state: into a client, in its order)
        model_id = body["model_id"]
        f = server.worker.submit(lambda: server.service.load_weights(body, model_id),
                                 model_id, int(body.get("seq_id", 0)))
    else:                       # (a new client from a checkpoint: its seq 0)
        model_id = _model_id(body)
        server.worker.expect(model_id, 1)
        f = server.worker.submit(lambda: server.service.load_weights(body, model_id), model_id)
    return submitted(f, model_id=model_id)


def forward_backward(server: TinkerServer, body: bytes) -> dict[str, Any]:
    """Run with the client's own waiting forward_backwards (the chunks the SDK splits a large one
    into), and with other clients' too under `batch_clients`; forwards with forwards."""
    req = decode_forward_backward(body)
    key = "forward" if req.forward_only else "forward_backward"
    key += "" if server.batch_clients else f":{req.model_id}"
    f = server.worker.submit_batched(key, req, server.service.forward_backward, req.model_id, req.seq_id)
    return submitted(f, model_id=req.model_id)


def ordered(op: str) -> Callable[[TinkerServer, dict[str, Any]], dict[str, Any]]:
    """A training client's request, run in its seq_id order."""
    def route(server: TinkerServer, body: dict[str, Any]) -> dict[str, Any]:
        server.service.models.run(body.get("model_id", ""))
        f = server.worker.submit(lambda: getattr(server.service, op)(body), body["model_id"],
                                 int(body.get("seq_id", 0)))
        return submitted(f, model_id=body["model_id"])
    return route


def asample(server: TinkerServer, body: dict[str, Any]) -> dict[str, Any]:
    n = server.service.check_sample(body)   # (a wrong request is said at once, not batched)
    f = server.worker.submit_batched(batch_key(body), body, lambda bodies: server.service.asample(bodies))
    return submitted(f, sample_sequence_ids=[f"{f.request_id}:{i}" for i in range(n)])


def finish(server: TinkerServer, body: dict[str, Any], session_id: str) -> dict[str, Any]:
    server.service.sessions.pop(session_id, None)
    return {}


def heartbeat(server: TinkerServer, body: dict[str, Any]) -> dict[str, Any]:
    if not server.service.heartbeat(str(body.get("session_id"))):
        raise HTTPError(410, f"session {body.get('session_id')!r} is finished or unknown")
    return {"type": "session_heartbeat"}


def capabilities(server: TinkerServer, body: Any) -> dict[str, Any]:
    return {"supported_models": [{"model_name": server.service.models.name, "trainable": True,
                                  "sampleable": True}]}


def weights_info(server: TinkerServer, body: dict[str, Any]) -> dict[str, Any]:
    from posttrain.tinker.revisions import folder_of, read_checkpoint
    _, meta, _ = read_checkpoint(folder_of(server.service.run_dir, body.get("tinker_path", "")), False)
    return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": int(meta["lora"]["rank"])}


POST_ROUTES = [(re.compile("/api/v1/" + path), route) for path, route in [
    ("client/config", lambda s, b: {"use_pyqwest_transport": False}),
    ("client/dynamic_config", lambda s, b: {}),
    ("create_session", lambda s, b: {"session_id": s.service.create_session(), "type": "create_session"}),
    ("session_heartbeat", heartbeat),
    ("telemetry", lambda s, b: {"status": "accepted"}),
    (r"sessions/([^/]+)/finish", finish),
    ("create_model", create_model),
    ("get_info", lambda s, b: s.service.get_info(b.get("model_id", ""))),
    ("forward_backward", forward_backward),
    ("optim_step", ordered("optim_step")),
    ("save_weights", ordered("save_weights")),
    ("save_weights_for_sampler", ordered("save_weights_for_sampler")),
    ("load_weights", load_weights),
    ("create_sampling_session", lambda s, b: {"sampling_session_id": s.service.create_sampling_session(b)}),
    ("asample", asample),
    ("retrieve_future", retrieve),
    ("weights_info", weights_info),
]]
GET_ROUTES = [(re.compile("/api/v1/" + path), route) for path, route in [
    ("healthz", lambda s, b: {"status": "ok"}),
    ("get_server_capabilities", capabilities),
    (r"samplers/([^/]+)", lambda s, b, sid: s.service.sampler(sid)),
    (r"training_runs/([^/]+)/checkpoints", lambda s, b, mid: s.service.checkpoints(mid)),
]]


def hf_sampler(models, run_dir, folder: str | None, max_lora_rank: int):
    from posttrain.tinker.sampler import HFSampler
    return HFSampler(models)


def vllm_sampler(models, run_dir, folder: str | None, max_lora_rank: int):
    from posttrain.tinker.sampler_vllm import VllmSampler
    if folder is None:
        raise ValueError("the vLLM sampler loads the base model from its folder: pass folder=")
    return VllmSampler(models, folder, run_dir, max_lora_rank=max_lora_rank)


SAMPLERS = {"hf": hf_sampler, "vllm": vllm_sampler}   # --sampler: what draws the samples


def start_server(model, tokenizer, name: str, run_dir, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, seed: int = 0,
                 aliases: tuple[str, ...] = (), max_batch: int = MAX_BATCH,
                 log_tokens: int = 8, batch_clients: bool = False, sampler: str = "hf",
                 folder: str | None = None, max_lora_rank: int = 32) -> TinkerServer:
    """A Tinker server over `model` (the base every client's adapter sits on), answering in a
    thread of its own; `name` (or one of `aliases`): the base model's name in create_model;
    `sampler`: a name in SAMPLERS (vllm: the base model read from `folder`, adapters up to
    `max_lora_rank`)."""
    import threading
    from pathlib import Path
    from posttrain.tinker.models import Models
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    models = Models(model, tokenizer, name, aliases)
    service = TinkerService(models, run_dir, seed, log_tokens,
                            SAMPLERS[sampler](models, run_dir, folder, max_lora_rank))
    try:
        server = TinkerServer((host, port), service, api_key=api_key, max_batch=max_batch,
                              batch_clients=batch_clients)
    except BaseException:   # (a port in use, a refused address: the sampler's engine stopped too)
        service.close()
        raise
    threading.Thread(target=server.serve_forever, daemon=True, name="tinker-serve").start()
    return server
