"""Request/reply on core NATS (services/common/bus/replies.py) against a real nats-server:
concurrency, failures, stopping, and the trace across the hop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.bus.replies import Responder, request

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
TRACER = PROVIDER.get_tracer("test")


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[nats.NATS]:
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


async def _until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_at_most_concurrency_requests_run_at_once_and_all_are_answered(nc):
    gate = asyncio.Event()
    running = 0
    most = 0

    async def handler(data: bytes) -> bytes:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await gate.wait()
        running -= 1
        return data.upper()

    responder = Responder("t.conc", handler, queue="q", concurrency=2)
    await responder.start(nc, TRACER)
    try:
        asks = [
            asyncio.create_task(request(nc, TRACER, "t.conc", f"r{i}".encode(), 5))
            for i in range(5)
        ]
        await _until(lambda: running == 2)
        await asyncio.sleep(0.1)  # a third, were it let in, would have started by now
        assert running == 2
        gate.set()
        assert sorted(await asyncio.gather(*asks)) == [f"R{i}".encode() for i in range(5)]
        assert most == 2
    finally:
        await responder.stop()


async def test_a_handler_that_raises_leaves_its_requester_to_time_out_and_answers_on(nc):
    async def handler(data: bytes) -> bytes:
        if data == b"boom":
            raise RuntimeError("boom")
        return b"ok"

    responder = Responder("t.fail", handler, queue="q", concurrency=4)
    await responder.start(nc, TRACER)
    try:
        with pytest.raises(TimeoutError):
            await request(nc, TRACER, "t.fail", b"boom", 0.3)
        assert await request(nc, TRACER, "t.fail", b"fine", 5) == b"ok"
    finally:
        await responder.stop()


async def test_stop_takes_no_new_requests_and_lets_running_ones_finish(nc):
    gate = asyncio.Event()
    started = asyncio.Event()

    async def handler(data: bytes) -> bytes:
        started.set()
        await gate.wait()
        return b"done"

    responder = Responder("t.stop", handler, queue="q", concurrency=4)
    await responder.start(nc, TRACER)
    asked = asyncio.create_task(request(nc, TRACER, "t.stop", b"x", 5))
    await asyncio.wait_for(started.wait(), 5)
    stopping = asyncio.create_task(responder.stop(grace_seconds=5))
    await asyncio.sleep(0.05)
    assert not stopping.done()  # waits for the answer under way
    gate.set()
    assert await asked == b"done"
    await stopping
    with pytest.raises(nats.errors.NoRespondersError):
        await request(nc, TRACER, "t.stop", b"y", 1)


async def test_the_requesters_trace_carries_on_in_the_responder(nc):
    async def handler(data: bytes) -> bytes:
        with TRACER.start_as_current_span("work"):
            return data

    responder = Responder("t.trace", handler, queue="q", concurrency=1)
    await responder.start(nc, TRACER)
    EXPORTER.clear()
    try:
        with TRACER.start_as_current_span("caller") as caller:
            assert await request(nc, TRACER, "t.trace", b"hi", 5) == b"hi"
    finally:
        await responder.stop()
    spans = {s.name: s for s in EXPORTER.get_finished_spans()}
    trace_id = caller.get_span_context().trace_id
    assert {"caller", "t.trace request", "t.trace process", "work"} <= set(spans)
    assert all(s.context.trace_id == trace_id for s in spans.values())
    assert spans["t.trace request"].parent.span_id == caller.get_span_context().span_id
    assert spans["t.trace process"].parent.span_id == spans["t.trace request"].context.span_id
    assert spans["work"].parent.span_id == spans["t.trace process"].context.span_id
