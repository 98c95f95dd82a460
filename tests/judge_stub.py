"""A stub OpenAI-compatible judge on loopback (`/v1/chat/completions`), for the judge's tests.

It reads each response as a careful judge would: between its fence's tags, the boundary taken
from the first tag (the request's own; a prompt without fences, by its 'Response:' or
'Response k:' headers), and scores it 10 when it contains the reference answer, else 0. It answers
HTTP 500 to every request whose response text has an odd number of characters (`fail_odd`: a judge
that fails half its calls, retries or not), and to the first `fail_first` requests of all (a
transient outage that retries get past). `reply`: a fixed reply instead; `keys`: the API key of
each request (its Authorization header)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubJudge:
    def __init__(self, fail_odd: bool = False, fail_first: int = 0, group: bool = False,
                 reply: str | None = None, finish_reason: str = "stop") -> None:
        self.fail_odd, self.fail_first, self.group, self.fixed = fail_odd, fail_first, group, reply
        self.finish_reason = finish_reason
        self.requests, self.keys = 0, []
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
        if self.fixed is not None:
            return 200, self.fixed
        answer = re.search(r"Reference answer: (.*)\n", text).group(1).strip()
        if self.group:
            parts = group_responses(text)
            return 200, "Scores: " + json.dumps([10 if answer in p else 0 for p in parts])
        fence = re.search(r"<response-(\w+)>\n(.*?)\n</response-\1>", text, re.S)
        response = (fence.group(2) if fence else
                    re.search(r"Response:\n(.*)\n\nIs the response", text, re.S).group(1))
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
                stub.keys.append(self.headers.get("Authorization", "").removeprefix("Bearer "))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, content = stub.reply(body["messages"][-1]["content"])
                out = json.dumps({"id": "x", "object": "chat.completion", "created": 0,
                                  "model": body["model"], "choices": [{
                                      "index": 0, "finish_reason": stub.finish_reason,
                                      "message": {"role": "assistant", "content": content}}]})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

            def log_message(self, *args) -> None:
                pass
        return Handler


def group_responses(text: str) -> list[str]:
    """A group request's responses in order: the fenced ones (response k between <response-k-B>
    and </response-k-B>, B read from response 1's tag), else the text after each 'Response k:'."""
    first = re.search(r"<response-1-(\w+)>", text)
    if first is None:
        return re.findall(r"Response \d+:\n(.*?)(?=\n\nResponse \d+:|\n\n\S+ each)", text, re.S)
    parts, b = [], first.group(1)
    while (m := re.search(rf"<response-{len(parts) + 1}-{b}>\n(.*?)\n</response-{len(parts) + 1}-{b}>",
                          text, re.S)):
        parts.append(m.group(1))
    return parts
