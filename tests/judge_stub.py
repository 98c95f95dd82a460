"""A stub OpenAI-compatible judge on loopback (`/v1/chat/completions`), for the judge's tests.

It scores a response 10 when its text (between 'Response:' and the instructions) contains the
reference answer, else 0; it answers HTTP 500 to every request whose response text has an odd
number of characters (`fail_odd`: a judge that fails half its calls, retries or not), and to the
first `fail_first` requests of all (a transient outage that retries get past)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubJudge:
    def __init__(self, fail_odd: bool = False, fail_first: int = 0, group: bool = False) -> None:
        self.fail_odd, self.fail_first, self.group = fail_odd, fail_first, group
        self.requests = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> "StubJudge":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reply(self, text: str) -> tuple[int, str]:
        with self.lock:
            self.requests += 1
            n = self.requests
        if n <= self.fail_first:
            return 500, ""
        answer = re.search(r"Reference answer: (.*)\n", text).group(1).strip()
        if self.group:
            parts = re.findall(r"Response \d+:\n(.*?)(?=\n\nResponse \d+:|\n\nFor each)", text, re.S)
            return 200, "Scores: " + json.dumps([10 if answer in p else 0 for p in parts])
        response = re.search(r"Response:\n(.*)\n\nIs the response", text, re.S).group(1)
        if self.fail_odd and len(response) % 2:
            return 500, ""
        return 200, f"Looks {'right' if answer in response else 'wrong'}.\nScore: {10 if answer in response else 0}"

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:   # noqa: N802 (the judge's startup check)
                out = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model"}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

            def do_POST(self) -> None:   # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, content = stub.reply(body["messages"][-1]["content"])
                out = json.dumps({"id": "x", "object": "chat.completion", "created": 0,
                                  "model": body["model"], "choices": [{
                                      "index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}]})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

            def log_message(self, *args) -> None:
                pass
        return Handler
