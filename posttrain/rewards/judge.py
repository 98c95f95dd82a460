"""An LLM judge as a reward (docs/rewards.md): a prompt template filled with the problem, the
response and the reference answer, sent to a model behind any OpenAI-compatible endpoint (vLLM,
SGLang, a hosted API, or `posttrain serve` over a local model), and its reply parsed into a score
in [0, 1].

A call that still fails after its retries (the endpoint down, a timeout, a reply with no score)
leaves the response *unscorable*: `None`, never 0.0. A wrong answer and a judge outage are
different things; the trainer leaves unscorable responses out of their group's baseline and out
of the loss (losses/advantages.py `excluding_unscored`) and counts them (reward/judge_unscorable).

The model's text reaches the judge as data inside a JSON request and nothing here evaluates it or
the judge's reply: the reply is read by a regular expression and `json.loads`, bounded in size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.util.errors import ConfigError

MAX_REPLY_CHARS = 20_000    # a judge reply read past this is cut (the score line ends the reply)

TEMPLATES: dict[str, str] = {
    "correctness": (
        "You grade a response to a problem against its reference answer.\n\n"
        "Problem:\n{prompt}\n\nReference answer: {answer}\n\nResponse:\n{completion}\n\n"
        "Is the response's final answer correct (equal to the reference answer)? Explain in one "
        "sentence, then end with a line 'Score: N' where N is 10 if it is correct, else 0."),
    "rubric": (
        "You rate a response to a request.\n\nRequest:\n{prompt}\n\nResponse:\n{completion}\n\n"
        "Rate how correct, helpful and concise the response is. Explain in one sentence, then "
        "end with a line 'Score: N' where N is an integer from 0 (worst) to 10 (best)."),
    "yes_no": (   # (for small judges, which rarely write a score line)
        "Problem: {prompt}\nReference answer: {answer}\nResponse: {completion}\n\n"
        "Is the response's final answer equal to the reference answer? Answer Yes or No."),
}
GROUP_TEMPLATES: dict[str, str] = {
    "correctness": (
        "You grade {n} responses to one problem against its reference answer.\n\n"
        "Problem:\n{prompt}\n\nReference answer: {answer}\n\n{responses}\n\n"
        "For each response in order, 10 if its final answer is correct, else 0. End with a line "
        "'Scores: [s1, s2, ...]' holding exactly {n} numbers."),
    "rubric": (
        "You rank {n} responses to one request against each other.\n\nRequest:\n{prompt}\n\n"
        "{responses}\n\nScore each response in order from 0 (worst) to 10 (best), relative to the "
        "others. End with a line 'Scores: [s1, s2, ...]' holding exactly {n} numbers."),
}
FIELDS = {"prompt", "completion", "answer"}
GROUP_FIELDS = {"prompt", "answer", "responses", "n"}
MAX_SCORE = 10.0

_SCORE = re.compile(r"score\W{0,3}\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_VERDICT = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)
_SCORES = re.compile(r"scores\W{0,3}\s*[:=]\s*\**\s*(\[[^\[\]]*\])", re.IGNORECASE)


def parse_score(reply: str, max_score: float = MAX_SCORE) -> float | None:
    """The last 'Score: N' (or JSON '"score": N') in a judge's reply, as N / max_score, else a
    reply that starts with Yes (1) or No (0); None when there is neither or N is outside
    [0, max_score]."""
    found = _SCORE.findall(reply[-MAX_REPLY_CHARS:])
    if not found:
        verdict = _VERDICT.match(reply[:100])
        return None if verdict is None else float(verdict[1].lower() == "yes")
    value = float(found[-1])
    return value / max_score if 0.0 <= value <= max_score else None


def parse_group_scores(reply: str, n: int, max_score: float = MAX_SCORE) -> list[float] | None:
    """The last 'Scores: [s1, ..., sn]' in a reply, each / max_score; None unless it holds
    exactly n numbers in [0, max_score] (a ranking of the wrong size scores nobody)."""
    found = _SCORES.findall(reply[-MAX_REPLY_CHARS:])
    if not found:
        return None
    try:
        values = json.loads(found[-1])
    except ValueError:
        return None
    if (len(values) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                    and 0.0 <= v <= max_score for v in values)):
        return None
    return [float(v) / max_score for v in values]


def load_template(spec: str, group: bool) -> str:
    """A built-in template's text, or a text file's; its {fields} are checked here (a typo fails
    before any model loads). Literal braces in a file are written {{ and }}."""
    builtin = GROUP_TEMPLATES if group else TEMPLATES
    allowed = GROUP_FIELDS if group else FIELDS
    if spec in builtin:
        return builtin[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"reward.judge_template={spec!r} is neither a built-in template "
                          f"({', '.join(sorted(builtin))}) nor a file")
    text = path.read_text()
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise ConfigError(f"{path}: reward.judge_template is not a valid template ({e}); write "
                          "literal braces as {{ and }}") from None
    needed = "responses" if group else "completion"
    if names - allowed or needed not in names:
        raise ConfigError(f"{path}: reward.judge_template uses {sorted(names - allowed) or 'no'} "
                          f"unknown field(s) and {sorted(names & allowed)}; it must use "
                          f"{{{needed}}} and may use {sorted(allowed)}")
    return text


class ReplyCache:
    """Judge replies on disk (SQLite, write-ahead log: safe across threads, ranks and crashes),
    keyed by the sha256 of the endpoint, its model name and the exact request, so a response
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
    def key(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> str:
        return hashlib.sha256(json.dumps([url, model, messages, max_tokens]).encode()).hexdigest()

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
        self.client = OpenAI(base_url=settings.url, max_retries=settings.retries,
                             timeout=settings.timeout_s,
                             api_key=os.environ.get(settings.api_key_env) or "no-key")
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
            jobs = [(self.group_messages(prompts[i], completions[i:i + G], answers[i]),
                     range(i, i + G)) for i in range(0, len(completions), G)]
        else:
            jobs = [(self.messages(p, c, a), range(i, i + 1))
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
        text = self.template.format(prompt=prompt, completion=completion, answer=answer)
        return [{"role": "user", "content": text}]

    def group_messages(self, prompt: str, completions: list[str], answer: str) -> list[dict[str, str]]:
        block = "\n\n".join(f"Response {k + 1}:\n{c}" for k, c in enumerate(completions))
        text = self.template.format(prompt=prompt, answer=answer, responses=block,
                                    n=len(completions))
        return [{"role": "user", "content": text}]

    def ask(self, job) -> tuple[list[float] | None, tuple[bool, str]]:
        """One request: (scores or None, (served from the cache, the failure's reason))."""
        messages, rows = job
        key = ReplyCache.key(self.s.url, self.s.model, messages, self.s.max_tokens)
        reply = self.cache.get(key) if self.cache is not None else None
        hit = reply is not None
        if reply is None:
            self.limit.wait()
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
        reply = self.client.chat.completions.create(
            model=self.s.model, messages=messages, max_tokens=self.s.max_tokens, temperature=0.0)
        return (reply.choices[0].message.content or "")[:MAX_REPLY_CHARS]

    def parse(self, reply: str, n: int) -> list[float] | None:
        if self.s.group:
            return parse_group_scores(reply, n)
        score = parse_score(reply)
        return None if score is None else [score]
