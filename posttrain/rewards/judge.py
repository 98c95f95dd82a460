"""An LLM judge as a reward (docs/environments.md, 'An LLM judge as a reward'): a prompt
template filled with the problem, the response and the reference answer, sent to a model behind
any OpenAI-compatible endpoint (vLLM, SGLang, a hosted API, or `posttrain serve` over a local
model), and its reply parsed into a score in [0, 1].

A call that still fails after its retries (the endpoint down, a timeout, a reply with no score)
leaves the response *unscorable*: `None`, never 0.0. A wrong answer and a judge outage are
different things; the trainer leaves unscorable responses out of their group's baseline and out
of the loss (losses/advantages.py `excluding_unscored`) and counts them (reward/judge_unscorable).

The model's text reaches the judge as data inside a JSON request and nothing here evaluates it or
the judge's reply: the reply is read by a regular expression and `json.loads`, bounded in size,
and only in the format its template asks for; each response is fenced by a boundary drawn per
request (rewards/judge_format.py: the templates, the fences and the parsers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.rewards.judge_format import (GROUP_TEMPLATES, MAX_REPLY_CHARS, TEMPLATES,  # noqa: F401
                                            draw_boundary, fenced, load_template,
                                            parse_group_scores, parse_score, template_format)
from posttrain.util.errors import ConfigError

log = logging.getLogger("posttrain")


class ReplyCache:
    """Judge replies on disk (SQLite, write-ahead log: safe across threads, ranks and crashes),
    keyed by the sha256 of the endpoint, its model name and the request's texts, so a response
    judged once (in this run or a resumed one) is not paid for again. Only replies that parsed
    are stored. Opened on first use (a refused run leaves no folder); a cache that fails (a
    locked or broken file) is a miss, never a failed step."""

    def __init__(self, path: Path) -> None:
        self.path, self.db = path, None
        self.lock = threading.Lock()

    def _open(self):
        if self.db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False,
                                      isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, reply TEXT)")
        return self.db

    @staticmethod
    def key(url: str, model: str, request: list, max_tokens: int) -> str:
        """`request`: the template and the texts it is filled with (not the message sent, whose
        fences are drawn afresh for each request)."""
        return hashlib.sha256(json.dumps([url, model, request, max_tokens]).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        try:
            with self.lock:
                row = self._open().execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error:
            return None
        return None if row is None else row[0]

    def put(self, key: str, reply: str) -> None:
        try:
            with self.lock:
                self._open().execute("INSERT OR REPLACE INTO replies VALUES (?, ?)", (key, reply))
        except sqlite3.Error:
            pass

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


class RateLimit:
    """At most `per_second` call starts per second, across threads (0: no limit). Hand-written:
    a few lines, and the limiter libraries on PyPI are asyncio-only."""

    def __init__(self, per_second: float) -> None:
        self.gap = 1.0 / per_second if per_second > 0 else 0.0
        self.next = 0.0
        self.lock = threading.Lock()

    def wait(self) -> None:
        if not self.gap:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next)
            self.next = start + self.gap
        time.sleep(max(0.0, start - now))


@dataclass
class JudgeSettings:
    url: str
    model: str = "default"
    template: str = "correctness"
    group: bool = False
    concurrency: int = 4
    rate: float = 0.0
    retries: int = 3
    timeout_s: float = 60.0
    max_tokens: int = 256
    cache: Path | None = None
    api_key_env: str = "OPENAI_API_KEY"


@dataclass
class Verdicts:
    """A batch's judged scores in [0, 1] (None: unscorable) and what it took."""

    scores: list[float | None]
    calls: int = 0                 # requests sent (cache hits excluded)
    cache_hits: int = 0
    errors: list[str] = field(default_factory=list)   # each unscorable request's reason

    @property
    def unscorable(self) -> int:
        return sum(s is None for s in self.scores)


class Judge:
    """Scores responses with the endpoint's model: one request per response, or (group mode,
    RULER-style) one request per prompt that ranks its whole group. Requests run `concurrency`
    at a time under the rate limit; the OpenAI client retries connection errors, 408/409/429 and
    5xx with exponential backoff `retries` times before a response is given up as unscorable."""

    def __init__(self, settings: JudgeSettings) -> None:
        try:
            from openai import OpenAI
        except ImportError:
            raise ConfigError("reward.judge needs the openai client: pip install "
                              "'posttrain[judge]'") from None
        self.s = settings
        self.template = load_template(settings.template, settings.group)
        self.format = "scores" if settings.group else template_format(settings.template,
                                                                      self.template)
        key = os.environ.get(settings.api_key_env)
        log.info("reward.judge: %s", f"the API key in ${settings.api_key_env} is sent to "
                 f"{settings.url}" if key else f"${settings.api_key_env} is not set: no API key "
                 f"is sent to {settings.url}")
        self.client = OpenAI(base_url=settings.url, max_retries=settings.retries,
                             timeout=settings.timeout_s, api_key=key or "no-key")
        self.cache = ReplyCache(settings.cache) if settings.cache is not None else None
        self.limit = RateLimit(settings.rate)
        self.pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="judge")

    def check(self) -> None:
        """Before any model loads: the endpoint answers and serves `judge_model` (a name it does
        not serve would make every response unscorable). 'default' takes the one it serves."""
        try:
            served = [m.id for m in self.client.models.list()]
        except Exception as e:  # noqa: BLE001 - said in one line, with the fix
            raise ConfigError(f"reward.judge={self.s.url!r}: the endpoint does not answer "
                              f"GET /models ({type(e).__name__}: {str(e)[:200]}); start it first "
                              "(posttrain serve, vLLM) or fix the URL") from None
        if self.s.model == "default" and len(served) == 1:
            self.s.model = served[0]
        elif served and self.s.model not in served:
            raise ConfigError(f"reward.judge_model={self.s.model!r} is not served at "
                              f"{self.s.url} (it serves {served[:10]})")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.cache is not None:
            self.cache.close()

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str],
                 group_size: int) -> Verdicts:
        """Scores for B = P * group_size responses, in order (rows of one prompt are adjacent)."""
        out = Verdicts([None] * len(completions))
        if self.s.group:
            G = group_size
            jobs = [((prompts[i], completions[i:i + G], answers[i]), range(i, i + G))
                    for i in range(0, len(completions), G)]
        else:
            jobs = [((p, c, a), range(i, i + 1))
                    for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True))]
        for (_, rows), (scores, reply_state) in zip(jobs, self.pool.map(self.ask, jobs)):
            hit, error = reply_state
            out.cache_hits += hit
            out.calls += not hit
            if scores is None:
                out.errors.append(error)
                continue
            for row, score in zip(rows, scores):
                out.scores[row] = score
        return out

    def messages(self, prompt: str, completion: str, answer: str) -> list[dict[str, str]]:
        """The request for one response, fenced by a boundary drawn for this request."""
        fence = fenced(completion, draw_boundary([prompt, completion, answer]))
        text = self.template.format(prompt=prompt, completion=fence, answer=answer)
        return [{"role": "user", "content": text}]

    def group_messages(self, prompt: str, completions: list[str], answer: str) -> list[dict[str, str]]:
        """The request for a group: `Response k:` then its fence, every fence with one boundary
        drawn for this request, so a response cannot end early or pose as response k."""
        boundary = draw_boundary([prompt, answer, *completions])
        block = "\n\n".join(f"Response {k}:\n{fenced(c, boundary, k)}"
                             for k, c in enumerate(completions, 1))
        text = self.template.format(prompt=prompt, answer=answer, responses=block,
                                    n=len(completions))
        return [{"role": "user", "content": text}]

    def ask(self, job) -> tuple[list[float] | None, tuple[bool, str]]:
        """One request: (scores or None, (served from the cache, the failure's reason))."""
        (prompt, completion, answer), rows = job
        request = [self.template, prompt, completion, answer]
        key = ReplyCache.key(self.s.url, self.s.model, request, self.s.max_tokens)
        reply = self.cache.get(key) if self.cache is not None else None
        hit = reply is not None
        if reply is None:
            self.limit.wait()
            messages = (self.group_messages if self.s.group else self.messages)(
                prompt, completion, answer)
            try:
                reply = self.request(messages)
            except Exception as e:   # (the client already retried what is worth retrying)
                return None, (False, f"{type(e).__name__}: {str(e)[:300]}")
        scores = self.parse(reply, len(rows))
        if scores is None:
            return None, (hit, f"no score in the judge's reply: {reply[-200:]!r}")
        if self.cache is not None and not hit:
            self.cache.put(key, reply)
        return scores, (hit, "")

    def request(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply; one cut short (max_tokens, or past MAX_REPLY_CHARS) is an error
        unless its verdict opens it (yes_no): what ends a cut reply may be a quote of the
        response, not the judge's score."""
        reply = self.client.chat.completions.create(
            model=self.s.model, messages=messages, max_tokens=self.s.max_tokens, temperature=0.0)
        choice = reply.choices[0]
        text = choice.message.content or ""
        if self.format == "yes_no":
            return text[:MAX_REPLY_CHARS]
        if choice.finish_reason == "length" or len(text) > MAX_REPLY_CHARS:
            raise ValueError(f"the judge's reply was cut at {len(text)} characters "
                             f"(finish_reason {choice.finish_reason!r}; reward.judge_max_tokens "
                             f"{self.s.max_tokens}): unscorable")
        return text

    def parse(self, reply: str, n: int) -> list[float] | None:
        if self.s.group:
            return parse_group_scores(reply, n)
        score = parse_score(reply, self.format)
        return None if score is None else [score]
