"""The batcher that lets chunks of concurrent documents share model calls: each caller gets
exactly its own vectors, calls never exceed the limit, and one bad input fails only the
request that carried it."""

from __future__ import annotations

import asyncio

import pytest

from services.common.domain.errors import InvalidInput, Transient
from services.common.embedders import Batcher


class Model:
    """Vectors that name their text; refuses any call holding a text with `poison`."""

    def __init__(self, poison: str | None = None, error: type[Exception] = InvalidInput):
        self.calls: list[list[str]] = []
        self.poison = poison
        self.error = error

    async def __call__(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        await asyncio.sleep(0.01)
        if self.poison and any(self.poison in t for t in texts):
            raise self.error("refused")
        return [[float(len(t)), float(hash(t) % 1000)] for t in texts]


def vector(text: str) -> list[float]:
    return [float(len(text)), float(hash(text) % 1000)]


async def test_concurrent_requests_share_calls_and_get_their_own_vectors() -> None:
    """Five concurrent requests of 3–20 texts run in full calls of at most 16 texts (a large
    request is cut across calls); the first waits for company (linger) instead of going
    alone; every request gets its vectors in order."""
    model = Model()
    batcher = Batcher(model, max_texts=16, linger_seconds=0.01)
    requests = [[f"doc{d} chunk{c}" for c in range(n)] for d, n in enumerate([3, 20, 5, 4, 7])]
    results = await asyncio.gather(*(batcher.submit(r) for r in requests))
    for texts, vectors in zip(requests, results, strict=True):
        assert vectors == [vector(t) for t in texts]
    assert all(len(c) <= 16 for c in model.calls)
    assert sum(len(c) for c in model.calls) == 39
    # Full calls: 39 texts in calls of 16, 16 and 7.
    assert [len(c) for c in model.calls] == [16, 16, 7]
    assert batcher.stats.shared_calls == 2  # the last holds one request only


async def test_a_poisoned_request_fails_alone() -> None:
    """A refused shared call is repeated per request: the poisoned request gets the error,
    its batch-mates their vectors."""
    model = Model(poison="bad")
    batcher = Batcher(model, max_texts=64, linger_seconds=0.01)
    good = [["a1", "a2"], ["b1"], ["c1", "c2", "c3"]]
    results = await asyncio.gather(
        batcher.submit(good[0]),
        batcher.submit(["x", "bad text"]),
        batcher.submit(good[1]),
        batcher.submit(good[2]),
        return_exceptions=True,
    )
    assert isinstance(results[1], InvalidInput)
    for texts, vectors in zip(good, [results[0], results[2], results[3]], strict=True):
        assert vectors == [vector(t) for t in texts]
    assert len(model.calls[0]) == 8  # they did share the first call
    assert batcher.stats.split_retries == 1


async def test_a_transient_error_fails_the_whole_call_without_retrying_each() -> None:
    """Provider down is everybody's problem: every request of the call gets the transient
    error (its message is redelivered later) and no per-request calls follow."""
    model = Model(poison="", error=Transient)  # every call fails
    model.poison = "a"
    batcher = Batcher(model, max_texts=64, linger_seconds=0.01)
    results = await asyncio.gather(
        batcher.submit(["a1"]), batcher.submit(["a2", "a3"]), return_exceptions=True
    )
    assert all(isinstance(r, Transient) for r in results)
    assert len(model.calls) == 1


async def test_a_cancelled_caller_does_not_disturb_the_others() -> None:
    """A caller that goes away before its call runs is skipped; the rest are answered."""
    model = Model()
    batcher = Batcher(model, max_texts=4)
    first = asyncio.create_task(batcher.submit(["one", "two", "three", "four"]))
    gone = asyncio.create_task(batcher.submit(["gone"] * 4))
    last = asyncio.create_task(batcher.submit(["last"]))
    await asyncio.sleep(0)
    gone.cancel()
    assert await first == [vector(t) for t in ["one", "two", "three", "four"]]
    assert await last == [vector("last")]
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert ["gone"] * 4 not in model.calls


async def test_calls_run_side_by_side_up_to_the_concurrency() -> None:
    """With two workers, two calls are in flight at once and never a third; each request
    still gets exactly its own vectors, and a poisoned request fails alone."""
    running = 0
    most = 0

    async def model(texts: list[str]) -> list[list[float]]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.02)
        running -= 1
        if any("bad" in t for t in texts):
            raise InvalidInput("refused")
        return [vector(t) for t in texts]

    batcher = Batcher(model, max_texts=4, concurrency=2)
    requests = [[f"doc{d} chunk{c}" for c in range(3)] for d in range(8)]
    results = await asyncio.gather(
        *(batcher.submit(r) for r in requests), batcher.submit(["bad"]), return_exceptions=True
    )
    assert most == 2
    for texts, vectors in zip(requests, results, strict=False):
        assert vectors == [vector(t) for t in texts]
    assert isinstance(results[-1], InvalidInput)


def test_document_workers_split_the_cores() -> None:
    """One single-threaded child per core up to four; past that, threads per child;
    an operator's process count shares the cores among them."""
    from services.common.embedders.processes import document_workers

    assert document_workers(1) == (1, 1)
    assert document_workers(2) == (2, 1)
    assert document_workers(8) == (4, 2)
    assert document_workers(2, processes=1) == (1, 2)
    assert document_workers(16, processes=2) == (2, 8)
    assert document_workers(8, most=16) == (8, 1)


async def test_what_is_queued_is_shared_out_busy_workers_counted() -> None:
    """Two workers and 70 texts queued: the first call takes half (35), not 64, so that
    neither worker does it all while the other idles; more than both can take still fills
    calls."""
    model = Model()
    batcher = Batcher(model, max_texts=64, linger_seconds=0.01, concurrency=2)
    requests = [[f"doc{d} chunk{c}" for c in range(7)] for d in range(10)]
    results = await asyncio.gather(*(batcher.submit(r) for r in requests))
    for texts, vectors in zip(requests, results, strict=True):
        assert vectors == [vector(t) for t in texts]
    assert len(model.calls[0]) == 35
    assert sum(len(c) for c in model.calls) == 70

    model.calls.clear()
    requests = [[f"doc{d} chunk{c}" for c in range(10)] for d in range(20)]
    await asyncio.gather(*(batcher.submit(r) for r in requests))
    assert sum(len(c) for c in model.calls) == 200
    assert [len(c) for c in model.calls[:2]] == [64, 64]


async def test_a_free_worker_leaves_the_busy_one_its_share() -> None:
    """The end of an ingest: one worker is busy, the other frees up with 40 texts queued.
    It takes half, not all 40 (which would keep it busy a whole call while the first one
    idles once done); while the first stays busy, each next call takes half of the rest, so
    the last calls are short and the two finish together."""
    gate = asyncio.Event()
    sizes: list[int] = []

    async def model(texts: list[str]) -> list[list[float]]:
        sizes.append(len(texts))
        if texts == ["long call"]:
            await gate.wait()
        await asyncio.sleep(0)
        return [vector(t) for t in texts]

    batcher = Batcher(model, max_texts=64, concurrency=2)
    busy = asyncio.create_task(batcher.submit(["long call"]))
    while sizes != [1]:
        await asyncio.sleep(0)
    rest = await batcher.submit([f"chunk{c}" for c in range(40)])
    assert rest == [vector(f"chunk{c}") for c in range(40)]
    assert sizes == [1, 20, 10, 5, 3, 1, 1]
    gate.set()
    assert await busy == [vector("long call")]
