"""`posttrain view RUN [RUN ...]`: a local web page over one or more run folders.

A small HTTP server from the standard library (`http.server`: nothing to install, and a page
that only reads local files needs no framework) answers the page's JSON requests by reading the
run folders on each request, so a run that is still writing shows its newest steps on the next
refresh. The page (static/: plain JavaScript, no build step) draws its curves with uPlot
(static/vendor, MIT, 50 KB: small, fast on 1,000s of points, no dependencies), served from the
installed package: no CDN, it works offline.

    GET /                              the page
    GET /api/runs                      [{id, name, path, config}]
    GET /api/metrics?run=I             metrics.jsonl's rows
    GET /api/steps?run=I               the steps with per-token records
    GET /api/rollouts?run=I&step=S     that step's records (tokens/step_S.parquet)
    GET /api/evals?run=I               eval_samples.jsonl's rows (every held-out answer)

A request whose `Host` header is not the address the viewer serves is refused (403): a page on
another site that points a DNS name at 127.0.0.1 (DNS rebinding) would otherwise read every
rollout through the browser of whoever runs the viewer. A client socket that sends or reads
nothing for `client_timeout_s` is dropped, so an idle connection cannot hold a thread forever.
"""

from __future__ import annotations

import json
import math
import mimetypes
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from posttrain.logs.metrics import TOKENS_DIR
from posttrain.util.hosts import host_allowed

STATIC = Path(__file__).parent / "static"
CLIENT_TIMEOUT_S = 60.0   # a client socket that sends or reads nothing this long is dropped


class ViewError(ValueError):
    """A folder that is not a run (raised before the server starts)."""


def check_runs(paths: list[str | Path]) -> list[Path]:
    """The run folders, each holding metrics.jsonl; a one-line error naming the fix otherwise."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_dir():
            raise ViewError(f"{path} is not a folder (posttrain view takes run folders, e.g. runs/grpo-...)")
        if not (path / "metrics.jsonl").is_file():
            raise ViewError(f"{path} has no metrics.jsonl: not a posttrain run folder (a run's "
                            "folder holds metrics.jsonl once its first step or evaluation is logged)")
        out.append(path)
    return out


def run_names(paths: list[Path]) -> list[str]:
    """Short names: the folder's name, or parent/name where two runs share a name."""
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete rows of a JSONL file (a line still being written is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def token_steps(run_dir: Path) -> list[int]:
    folder = run_dir / TOKENS_DIR
    if not folder.is_dir():
        return []
    return sorted(int(f.stem.split("_")[1]) for f in folder.glob("step_*.parquet"))


def rollouts(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """A step's per-token records as plain rows (non-finite numbers as None: JSON has none)."""
    import pyarrow.parquet as pq
    path = run_dir / TOKENS_DIR / f"step_{step:06d}.parquet"
    if not path.is_file():
        return []
    return [_finite(r) for r in pq.read_table(path).to_pylist()]


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, list):
        return [_finite(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def run_info(i: int, name: str, path: Path) -> dict[str, Any]:
    cfg = path / "config.json"
    config = json.loads(cfg.read_text()) if cfg.is_file() else {}
    return {"id": i, "name": name, "path": str(path), "preset": config.get("preset"),
            "config": config}


class Viewer:
    """What the page asks for, answered from the run folders."""

    def __init__(self, runs: list[Path]) -> None:
        self.runs = runs
        self.names = run_names(runs)

    def answer(self, route: str, query: dict[str, str]) -> Any:
        if route == "runs":
            return [run_info(i, n, p) for i, (n, p) in enumerate(zip(self.names, self.runs))]
        run = self.runs[int(query.get("run", 0))]
        if route == "metrics":
            return _finite(read_jsonl(run / "metrics.jsonl"))
        if route == "steps":
            return token_steps(run)
        if route == "rollouts":
            return rollouts(run, int(query["step"]))
        if route == "evals":
            return read_jsonl(run / "eval_samples.jsonl")
        raise KeyError(route)


def make_handler(viewer: Viewer, client_timeout_s: float = CLIENT_TIMEOUT_S
                 ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = client_timeout_s   # (socketserver: each read and write of the client socket)

        def do_GET(self) -> None:   # noqa: N802 (http.server's name)
            bound, port = self.server.server_address[:2]
            if not host_allowed(self.headers.get("Host", ""), str(bound), port):
                return self.send_error(403, "Host is not the address this viewer serves")
            url = urlparse(self.path)
            if url.path.startswith("/api/"):
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    body = json.dumps(viewer.answer(url.path[len("/api/"):], query)).encode()
                except (KeyError, ValueError, IndexError) as e:
                    return self.send_error(404, f"no such data: {e}")
                return self.reply(body, "application/json")
            if url.path == "/favicon.ico":
                return self.reply(b"", "image/x-icon")
            name = "index.html" if url.path in ("/", "") else url.path.lstrip("/")
            file = (STATIC / name).resolve()
            if not file.is_relative_to(STATIC.resolve()) or not file.is_file():
                return self.send_error(404)
            self.reply(file.read_bytes(), mimetypes.guess_type(file.name)[0] or "text/plain")

        def reply(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")   # a running run: always the newest
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:   # quiet: the terminal shows the address only
            pass
    return Handler


def serve(runs: list[Path], host: str = "127.0.0.1", port: int = 8765, background: bool = False,
          client_timeout_s: float = CLIENT_TIMEOUT_S) -> ThreadingHTTPServer:
    """Start the server (port 0: any free port; the address is `server.server_address`). In the
    background (tests, notebooks) it runs in a daemon thread; else this call blocks."""
    server = ThreadingHTTPServer((host, port), make_handler(Viewer(runs), client_timeout_s))
    server.daemon_threads = True   # (a client still connected never holds up Ctrl-C)
    if background:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    else:
        server.serve_forever()
    return server


def view_until_stopped(paths: list[str], host: str, port: int, open_page: bool = False) -> None:
    """`posttrain view`: the page until Ctrl-C (a folder that is no run: one line, before a
    port is taken)."""
    runs = check_runs(paths)
    try:
        server = serve(runs, host, port, background=True)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); "
                         "choose another with --port (0: any free one)") from None
    host, port = server.server_address[:2]
    url = f"http://{'localhost' if host in ('127.0.0.1', '0.0.0.0') else host}:{port}/"
    print(f"posttrain view: {len(runs)} run(s) at {url}  (Ctrl-C stops)", flush=True)
    if open_page:
        import webbrowser
        webbrowser.open(url)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
