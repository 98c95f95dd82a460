"""Every Tinker request that does work is a future: its POST returns a request id at once, one
worker thread runs the work (one model, one CPU: requests one at a time), and
`POST /api/v1/retrieve_future` long-polls for the result (the SDK polls again at once on
`try_again`, so a server that answered at once would make it spin).

A training client's requests carry `seq_id`s; they run in that order (the SDK sends the chunks of
one forward_backward concurrently, the first last), a retried POST with a seq_id already taken
gets the same future, and a gap that no request fills within GAP_S is skipped with a warning (a
request the client never managed to send).

Work submitted as batched (`submit_batched`: sampling requests; forward_backward requests) runs
with the other waiting items of its key, as one call. An item of a training client joins only
while no earlier waiting request of that client is left behind (its `optim_step` between two
forward_backwards stays between them); a batch answers each item on its own, so one client's
wrong request fails that request alone.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("posttrain")

POLL_S = 25.0        # a retrieve waits this long for a result (the SDK's timeout is 45 s)
KEEP_S = 600.0       # a finished result stays this long for a client that polls late
GAP_S = 10.0         # a missing seq_id is waited for this long
MAX_BATCH = 64       # requests run as one batch at most (`tinker-serve --max_batch`)


@dataclass
class Future:
    request_id: str
    done: bool = False
    result: Any = None              # a dict (JSON) or bytes (protobuf)
    error: dict[str, str] | None = None
    finished_at: float = 0.0


@dataclass
class _Batched:
    """One request of work that runs in batches: `run(items)` answers every item at once."""
    key: str
    item: Any
    run: Callable[[list[Any]], list[Any]]   # a result per item; an exception answers its item alone


@dataclass(order=True)
class _Held:
    seq: int
    since: float = field(compare=False)
    task: Callable[[], Any] = field(compare=False)
    future: Future = field(compare=False)
    owner: str | None = field(compare=False, default=None)


@dataclass
class _Ready:
    """A request free to run: its work, its future and the training client it belongs to."""
    task: Callable[[], Any]
    future: Future
    owner: str | None = None


class Worker:
    """Runs submitted work one at a time, each training client's in seq_id order."""

    def __init__(self, user_errors: tuple[type[BaseException], ...], max_batch: int = MAX_BATCH) -> None:
        self.user_errors, self.max_batch = user_errors, max_batch
        self.futures: dict[str, Future] = {}
        self.by_seq: dict[tuple[str, int], Future] = {}
        self.next_seq: dict[str, int] = {}
        self.held: dict[str, list[_Held]] = {}
        self.ready: list[_Ready] = []
        self.cond = threading.Condition()
        self.stopped = False
        self._count = itertools.count()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="tinker-worker")
        self.thread.start()

    def submit(self, task: Callable[[], Any], model_id: str | None = None,
               seq: int | None = None) -> Future:
        """A future for `task`; with a model and seq_id, run after that model's earlier ones."""
        with self.cond:
            if model_id is not None and seq is not None and (model_id, seq) in self.by_seq:
                return self.by_seq[(model_id, seq)]          # (the same POST, retried)
            future = Future(f"req-{next(self._count)}-{uuid.uuid4().hex[:8]}")
            self.futures[future.request_id] = future
            if model_id is None or seq is None or model_id not in self.next_seq:
                self.ready.append(_Ready(task, future, model_id))
            else:
                self.by_seq[(model_id, seq)] = future
                heapq.heappush(self.held.setdefault(model_id, []),
                               _Held(seq, time.monotonic(), task, future, model_id))
                self._release(model_id)
            self.cond.notify_all()
            return future

    def submit_batched(self, key: str, item: Any, run: Callable[[list[Any]], list[Any]],
                       model_id: str | None = None, seq: int | None = None) -> Future:
        """A future for `item`, run with the other waiting items of the same `key` (up to
        `max_batch`) by one call of `run`; with a model and seq_id, in that model's order."""
        return self.submit(_Batched(key, item, run), model_id, seq)

    def expect(self, model_id: str, seq: int) -> None:
        """`model_id`'s next request is `seq` (a new client: 1, after its creation's 0)."""
        with self.cond:
            self.next_seq[model_id] = seq

    def _release(self, model_id: str, force: bool = False) -> None:
        heap = self.held.get(model_id, [])
        while heap and (heap[0].seq <= self.next_seq[model_id] or force):
            held = heapq.heappop(heap)
            if held.seq > self.next_seq[model_id]:
                log.warning("tinker: %s's request seq_id %d runs without seq_id %d..%d, which "
                            "never came", model_id, held.seq, self.next_seq[model_id], held.seq - 1)
            self.next_seq[model_id] = max(self.next_seq[model_id], held.seq + 1)
            self.ready.append(_Ready(held.task, held.future, held.owner))
            force = False

    def _next(self):
        with self.cond:
            while not self.ready and not self.stopped:
                self.cond.wait(timeout=1.0)
                now = time.monotonic()
                for model_id, heap in self.held.items():
                    if heap and now - heap[0].since > GAP_S:
                        self._release(model_id, force=True)
            if not self.ready:
                return None, None
            first = self.ready.pop(0)
            if not isinstance(first.task, _Batched):
                return first.task, first.future
            batch = [first, *self._joining(first.task.key)]
            self.ready = [e for e in self.ready if all(e is not b for b in batch)]
            return _batch_call(batch), [b.future for b in batch]

    def _joining(self, key: str) -> list[_Ready]:
        """The waiting items of `key` that may run now with the first: a training client's item
        only while none of its earlier requests is left behind."""
        same: list[_Ready] = []
        passed: set[str] = set()          # clients with an earlier request that does not join
        for e in self.ready:
            if len(same) >= self.max_batch - 1:
                break
            if isinstance(e.task, _Batched) and e.task.key == key and e.owner not in passed:
                same.append(e)
            elif e.owner is not None:
                passed.add(e.owner)
        return same

    def _loop(self) -> None:
        while not self.stopped:
            task, future = self._next()
            if task is None:
                continue
            futures = future if isinstance(future, list) else [future]
            try:
                results = task()
                results = results if isinstance(future, list) else [results]
            except Exception as e:
                results = [e] * len(futures)
            with self.cond:
                for f, result in zip(futures, results):
                    f.error = self._error(f, result) if isinstance(result, Exception) else None
                    f.result, f.done = None if f.error else result, True
                    f.finished_at = time.monotonic()
                self._forget_old()
                self.cond.notify_all()

    def _error(self, f: Future, e: Exception) -> dict[str, str]:
        """What the client is told: its own mistake in one line, or the server's fault (logged)."""
        if isinstance(e, self.user_errors):
            return {"error": " ".join(str(e).split()), "category": "user"}
        log.error("tinker: request %s failed", f.request_id, exc_info=e)
        return {"error": f"{type(e).__name__}: {e}", "category": "server"}

    def retrieve(self, request_id: str, timeout: float = POLL_S) -> Future | None:
        """The future once done, or still pending after `timeout`; None when unknown."""
        deadline = time.monotonic() + timeout
        with self.cond:
            future = self.futures.get(request_id)
            while future is not None and not future.done and time.monotonic() < deadline:
                self.cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            return future

    def _forget_old(self) -> None:
        now = time.monotonic()
        for key, f in list(self.futures.items()):
            if f.done and now - f.finished_at > KEEP_S:
                del self.futures[key]
        for key, f in list(self.by_seq.items()):
            if f.done and now - f.finished_at > KEEP_S:
                del self.by_seq[key]

    def stop(self, wait_s: float = 120.0) -> None:
        """No request starts after this; the one running finishes (at most `wait_s`): a process
        that exits while its worker is inside a backward pass is aborted by torch's C++ threads
        ('terminate called without an active exception')."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join(wait_s)
            if self.thread.is_alive():
                log.warning("tinker: the request running did not finish in %.0f s; exiting anyway",
                            wait_s)


def _batch_call(batch: list[_Ready]) -> Callable[[], list[Any]]:
    run, items = batch[0].task.run, [b.task.item for b in batch]
    return lambda: run(items)
