"""Coalescing of concurrent embed requests into shared model calls: a model call costs much
more per text at batch 2 than at 32, so the chunks of concurrent documents ride in one call
(first-in first-out, a large request cut across calls, each request given back exactly its
own vectors). A call that fails with texts of several requests, for any reason but a
transient one, is repeated per request, so one bad input fails only its own request."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Encode = Callable[[list[str]], Awaitable[list[list[float]]]]


@dataclass(eq=False)
class _Request:
    texts: list[str]
    future: asyncio.Future[list[list[float]]]
    vectors: dict[int, list[float]] = field(default_factory=dict)  # by position in texts

    def fill(self, start: int, vectors: list[list[float]]) -> None:
        self.vectors.update(enumerate(vectors, start))
        if len(self.vectors) == len(self.texts) and not self.future.done():
            self.future.set_result([self.vectors[i] for i in range(len(self.texts))])

    def fail(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)


@dataclass(frozen=True)
class _Slice:
    request: _Request
    start: int
    end: int

    @property
    def texts(self) -> list[str]:
        return self.request.texts[self.start : self.end]


@dataclass
class BatcherStats:
    calls: int = 0
    texts: int = 0
    # Calls that carried texts of more than one request: proof that batching happened.
    shared_calls: int = 0
    split_retries: int = 0


class Batcher:
    """Runs `encode` over the texts of concurrent `submit` calls, at most `max_texts` a call.

    `linger_seconds`: how long an idle batcher waits for company before its first call
    (while calls run, new requests queue up for the next one). `concurrency`: calls in
    flight at most. A call takes its share of what is queued, busy workers counted (with
    two: half), so a worker that frees up while the other is busy leaves it work instead of
    taking all: the last calls shrink (half, a quarter, ...) and the workers finish
    together, where taking all kept one busy for a whole call while the other idled
    (docs/benchmarks.md, "Pipeline").
    """

    def __init__(
        self,
        encode: Encode,
        *,
        max_texts: int,
        linger_seconds: float = 0.0,
        concurrency: int = 1,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self._encode = encode
        self._observe = observe  # seconds of each successful call (a metrics histogram)
        self._max = max(1, max_texts)
        self._linger = max(0.0, linger_seconds)
        self._pending: deque[_Slice] = deque()
        self._drainer: asyncio.Task[None] | None = None
        self._concurrency = max(1, concurrency)
        self._slots = asyncio.Semaphore(self._concurrency)
        self._calls: set[asyncio.Task[None]] = set()
        self.stats = BatcherStats()

    async def submit(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        request = _Request(texts, asyncio.get_running_loop().create_future())
        self._pending.append(_Slice(request, 0, len(texts)))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        if self._linger and self.queued < self._max:
            await asyncio.sleep(self._linger)
        while self._pending:
            await self._slots.acquire()
            group = self._take(math.ceil(self.queued / self._concurrency))
            if not group:
                self._slots.release()
                continue
            call = asyncio.create_task(self._call(group))
            self._calls.add(call)  # held: the loop keeps only weak references to tasks
            call.add_done_callback(self._calls.discard)

    async def _call(self, group: list[_Slice]) -> None:
        try:
            await self._run(group)
        finally:
            self._slots.release()

    @property
    def queued(self) -> int:
        """Texts waiting for a call."""
        return sum(s.end - s.start for s in self._pending)

    def _take(self, share: int) -> list[_Slice]:
        """Slices first-in first-out until the call holds `share` texts (at most `max_texts`);
        the last one may be cut, its rest staying first in line."""
        group: list[_Slice] = []
        room = max(1, min(share, self._max))
        while self._pending and room:
            head = self._pending.popleft()
            if head.request.future.done():  # failed or its caller went away
                continue
            if head.end - head.start > room:
                self._pending.appendleft(_Slice(head.request, head.start + room, head.end))
                head = _Slice(head.request, head.start, head.start + room)
            group.append(head)
            room -= head.end - head.start
        return group

    async def _run(self, group: list[_Slice]) -> None:
        flat = [text for s in group for text in s.texts]
        requests = {id(s.request): s.request for s in group}
        started = time.perf_counter()
        try:
            vectors = await self._encode(flat)
        except asyncio.CancelledError:
            for request in requests.values():
                request.future.cancel()
            raise
        except Exception as err:
            # A transient error (provider down, rate limit) is everybody's: their messages
            # are redelivered later. Anything else may be one input's fault.
            if len(requests) == 1 or getattr(err, "retryable", False):
                for request in requests.values():
                    request.fail(err)
                return
            log.warning(
                "embed_batch_failed requests=%d texts=%d error=%r; retrying each alone",
                len(requests),
                len(flat),
                str(err)[:200],
            )
            self.stats.split_retries += 1
            for s in group:
                if not s.request.future.done():
                    await self._run([s])
            return
        if self._observe is not None:
            self._observe(time.perf_counter() - started)
        self.stats.calls += 1
        self.stats.texts += len(flat)
        if len(requests) > 1:
            self.stats.shared_calls += 1
        offset = 0
        for s in group:
            s.request.fill(s.start, vectors[offset : offset + s.end - s.start])
            offset += s.end - s.start
