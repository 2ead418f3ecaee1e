"""The delivery rules every subscriber gets from `consume` (services/common/bus/client.py):

- a handler that returns acks, and the message is not delivered again;
- a transient error is nacked and redelivered with backoff, then acked once it succeeds;
- a permanent error (`InvalidInput`) is rejected at once: dead-lettered with the reason,
  after the owner's failure hook ran, and never redelivered;
- a transient error on the last allowed delivery is dead-lettered the same way;
- a message that is not its event is dead-lettered without reaching the handler;
- an upstream publisher's event reaches the handler with the publisher known, unless it
  names another org than the publisher's: then it is dead-lettered unread;
- a handler at work reports progress, so its message is not redelivered meanwhile.

Each rule is tested twice. In memory, with FastStream's `TestNatsBroker`: the outcome the
consumer gives each delivery (ack, nack and its delay, reject), its dead letter and its
failure hook, for a message delivered as JetStream's n-th delivery. Against a real
nats-server (`with_real=True`), where what follows is the server's: redeliveries, their
counts, and a durable left with nothing pending."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from faststream.nats import JStream, NatsRouter, TestNatsBroker
from faststream.nats.annotations import NatsMessage
from faststream.nats.testing import PatchedMessage
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import TracerProvider as AnyTracerProvider

from services.common.bus.auth import Publisher, publisher_of, upstream_subject
from services.common.bus.client import CURRENT_PUBLISHER, Bus, consume, declare_consumer
from services.common.bus.nats_server import NatsServer
from services.common.domain.errors import InvalidInput
from services.common.messages.events import DocDeleted
from services.common.messages.names import DLQ_STREAM, STREAM, UPSTREAM_STREAM, Subject, dlq_subject
from services.common.settings import BusSettings, Settings
from tests.support.domain import wait_until

SUBJECT = Subject.DOC_DELETED


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """A nats-server of this module's own: the tests declare the event stream and durable
    consumers, which must not meet other tests' subscribers."""
    server = NatsServer(Path(tmp_path_factory.mktemp("delivery-nats"))).start()
    yield server.url
    server.stop()


@contextlib.asynccontextmanager
async def subscribed(
    nats_url: str,
    handler: Callable[[DocDeleted], Awaitable[None]],
    on_failure: Callable[[Any, Exception], Awaitable[None]] | None = None,
    upstream: bool = False,
) -> AsyncIterator[tuple[Bus, str]]:
    """`handler` behind `consume` on a durable of its own, started by TestNatsBroker against
    the real server; yields the bus and the durable's name."""
    settings = Settings(bus=BusSettings(max_deliver=3))
    bus = Bus(nats_url, trace.get_tracer_provider(), rules=settings.bus, backoff=(0.05, 0.1))
    durable = f"test-{uuid.uuid4().hex[:8]}"
    router = NatsRouter()
    consume(router, bus, SUBJECT, durable, handler, on_failure=on_failure, upstream=upstream)
    bus.broker.include_router(router)
    await bus.connect(administer=True)
    # The topology step creates the consumers of services/common/bus/auth.WORK: this
    # test's own durables are created here, as the operator would.
    for consumer in bus.consumers:
        if consumer.stream == UPSTREAM_STREAM:
            # A work-queue stream takes one consumer per filter: the topology's own (no
            # process of this test pulls from it) makes way for this test's.
            for info in await bus.js.consumers_info(UPSTREAM_STREAM):
                if info.config.filter_subject == consumer.subject:
                    await bus.js.delete_consumer(UPSTREAM_STREAM, info.name)
        await declare_consumer(bus.js, consumer, settings.bus, bus.ack_wait)
    # A new durable reads the stream from its start: earlier tests' events are not ours.
    await bus.js.purge_stream(STREAM)
    try:
        async with TestNatsBroker(bus.broker, with_real=True):
            yield bus, durable
    finally:
        await bus.close()


async def settled(bus: Bus, durable: str, stream: str = STREAM) -> None:
    """Until the durable has nothing pending and nothing unacknowledged."""

    async def idle() -> bool:
        info = await bus.js.consumer_info(stream, durable)
        return info.num_pending == 0 and info.num_ack_pending == 0

    await wait_until(idle, timeout=30, what=f"{durable} to settle")


@contextlib.asynccontextmanager
async def dead_letters(nats_url: str) -> AsyncIterator[asyncio.Queue[nats.aio.msg.Msg]]:
    """Dead letters of SUBJECT published from now on, whichever org they were filed under."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    queue: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()

    async def on_letter(msg: nats.aio.msg.Msg) -> None:
        await queue.put(msg)

    sub = await js.subscribe(
        dlq_subject("*", SUBJECT), stream=DLQ_STREAM, cb=on_letter, deliver_policy="new"
    )
    try:
        yield queue
    finally:
        await sub.unsubscribe()
        await nc.close()


def event() -> DocDeleted:
    return DocDeleted(org_id="org", document_ids=[uuid.uuid4().hex])


async def test_success_acks_once(nats_url: str) -> None:
    calls: list[DocDeleted] = []

    async def handler(ev: DocDeleted) -> None:
        calls.append(ev)

    async with subscribed(nats_url, handler) as (bus, durable):
        sent = event()
        await bus.publish(SUBJECT, sent)
        await wait_until(lambda: _true(calls), what="the handler")
        await settled(bus, durable)
        info = await bus.js.consumer_info(STREAM, durable)
    assert [c.event_id for c in calls] == [sent.event_id]
    assert info.num_redelivered == 0 and info.ack_floor.stream_seq >= 1


async def test_transient_error_is_nacked_and_redelivered_until_it_succeeds(nats_url: str) -> None:
    deliveries: list[str] = []

    async def handler(ev: DocDeleted) -> None:
        deliveries.append(ev.event_id)
        if len(deliveries) < 2:
            raise ConnectionError("the store is restarting")

    async with dead_letters(nats_url) as letters, subscribed(nats_url, handler) as (bus, durable):
        sent = event()
        await bus.publish(SUBJECT, sent)
        await wait_until(lambda: _true(len(deliveries) >= 2), what="the redelivery")
        await settled(bus, durable)
    assert deliveries == [sent.event_id, sent.event_id]
    assert letters.empty()


async def test_permanent_error_is_rejected_and_dead_lettered_after_the_failure_hook(
    nats_url: str,
) -> None:
    deliveries: list[str] = []
    hooked: list[tuple[str, str]] = []

    async def handler(ev: DocDeleted) -> None:
        deliveries.append(ev.event_id)
        raise InvalidInput("document_ids: not a document", field="document_ids")

    async def on_failure(ev: DocDeleted, err: Exception) -> None:
        hooked.append((ev.event_id, str(err)))

    async with (
        dead_letters(nats_url) as letters,
        subscribed(nats_url, handler, on_failure) as (bus, durable),
    ):
        sent = event()
        await bus.publish(SUBJECT, sent)
        letter = await asyncio.wait_for(letters.get(), timeout=30)
        await settled(bus, durable)
    assert deliveries == [sent.event_id]
    assert hooked == [(sent.event_id, "document_ids: not a document")]
    assert letter.headers["Kbmesh-Error-Type"] == "ValidationError"
    assert letter.headers["Kbmesh-Original-Subject"] == SUBJECT
    assert letter.headers["Kbmesh-Delivered"] == "1"
    assert json.loads(letter.data)["event_id"] == sent.event_id


async def test_transient_error_on_the_last_delivery_is_dead_lettered(nats_url: str) -> None:
    deliveries: list[str] = []

    async def handler(ev: DocDeleted) -> None:
        deliveries.append(ev.event_id)
        raise TimeoutError("the provider did not answer")

    async with dead_letters(nats_url) as letters, subscribed(nats_url, handler) as (bus, durable):
        await bus.publish(SUBJECT, event())
        letter = await asyncio.wait_for(letters.get(), timeout=30)
        await settled(bus, durable)
    assert len(deliveries) == 3  # max_deliver
    assert letter.headers["Kbmesh-Error-Type"] == "TimeoutError"
    assert letter.headers["Kbmesh-Delivered"] == "3"


async def test_malformed_message_is_dead_lettered_without_reaching_the_handler(
    nats_url: str,
) -> None:
    calls: list[DocDeleted] = []

    async def handler(ev: DocDeleted) -> None:
        calls.append(ev)

    async with dead_letters(nats_url) as letters, subscribed(nats_url, handler) as (bus, durable):
        await bus.js.publish(SUBJECT, b'{"org_id": 7}', stream=STREAM)
        letter = await asyncio.wait_for(letters.get(), timeout=30)
        await settled(bus, durable)
    assert calls == []
    assert letter.headers["Kbmesh-Error-Type"] == "ValidationError"
    assert "malformed event" in letter.headers["Kbmesh-Error"]
    assert letter.data == b'{"org_id": 7}'


async def _true(value: object) -> bool:
    return bool(value)


async def test_an_upstream_event_of_the_publishers_org_only_reaches_the_handler(
    nats_url: str,
) -> None:
    """The subject names the publisher (the server's account import writes it there): an
    event for its own org is handled with `CURRENT_PUBLISHER` set; one naming another org
    is dead-lettered as Forbidden, filed under the publisher's org, and the handler never
    sees it."""
    seen: list[tuple[str, Publisher | None]] = []

    async def handler(ev: DocDeleted) -> None:
        seen.append((ev.org_id, CURRENT_PUBLISHER.get()))

    feeder = Publisher(name="feeder", org_id="acme")
    subject = upstream_subject(SUBJECT, feeder)
    nc = await nats.connect(nats_url)
    # Filed under the publisher's org, whichever org its event names.
    letters = await nc.subscribe(dlq_subject(feeder.org_id, subject))
    try:
        async with subscribed(nats_url, handler, upstream=True) as (bus, durable):
            for org in ("acme", "victim"):
                sent = DocDeleted(org_id=org, document_ids=[uuid.uuid4().hex])
                await bus.js.publish(
                    subject, sent.model_dump_json().encode(), headers={"Nats-Msg-Id": sent.event_id}
                )
            letter = await letters.next_msg(timeout=30)
            await settled(bus, f"{durable}-upstream", UPSTREAM_STREAM)
    finally:
        await nc.close()
    assert seen == [("acme", feeder)]
    assert json.loads(letter.data)["org_id"] == "victim"
    assert letter.headers is not None and letter.headers["Kbmesh-Error-Type"] == "Forbidden"


# --- in memory: FastStream's TestNatsBroker, no server -----------------------------------

MAX_DELIVER = 3
BACKOFF = [0.05, 0.1]
Outcome = tuple[str, str, float | None]  # subject, "ack" / "nak" / "term" / "in_progress", delay


@pytest.fixture
def outcomes(monkeypatch: pytest.MonkeyPatch) -> list[Outcome]:
    """What the consumer told JetStream about each in-memory delivery, in order. The test
    broker's messages answer acks with nothing; here they record them."""
    seen: list[Outcome] = []

    async def ack(self: PatchedMessage) -> None:
        seen.append((self.subject, "ack", None))

    async def nak(self: PatchedMessage, delay: float | None = None) -> None:
        seen.append((self.subject, "nak", delay))

    async def term(self: PatchedMessage) -> None:
        seen.append((self.subject, "term", None))

    async def in_progress(self: PatchedMessage) -> None:
        seen.append((self.subject, "in_progress", None))

    for name, method in (("ack", ack), ("nak", nak), ("term", term), ("in_progress", in_progress)):
        monkeypatch.setattr(PatchedMessage, name, method)
    return seen


class InMemory:
    """A consumer behind `consume` on FastStream's in-memory broker, and the dead letters it
    publishes (caught by a subscriber on the dead-letter stream)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.letters: list[Msg] = []
        self._sequence = 0

    async def deliver(self, body: bytes, *, delivered: int = 1, subject: str = SUBJECT) -> None:
        """Hand `body` to the consumer as JetStream's `delivered`-th delivery of a message:
        JetStream names the delivery count and stream sequence in the reply subject."""
        self._sequence += 1
        seq = self._sequence
        # Upstream publishers' events are in a stream of their own.
        stream = UPSTREAM_STREAM if publisher_of(subject) is not None else STREAM
        reply = f"$JS.ACK.{stream}.test.{delivered}.{seq}.{seq}.{time.time_ns()}.0"
        await self.bus.broker.publish(body, subject, stream=stream, reply_to=reply)


@contextlib.asynccontextmanager
async def in_memory(
    handler: Callable[[DocDeleted], Awaitable[None]],
    on_failure: Callable[[Any, Exception], Awaitable[None]] | None = None,
    *,
    upstream: bool = False,
    ack_wait: float = 10.0,
    tracer_provider: AnyTracerProvider | None = None,
) -> AsyncIterator[InMemory]:
    rules = BusSettings(max_deliver=MAX_DELIVER)
    provider = tracer_provider or trace.get_tracer_provider()
    # Never connected: TestNatsBroker stands in for the server.
    bus = Bus("nats://127.0.0.1:4222", provider, rules=rules, backoff=BACKOFF, ack_wait=ack_wait)
    router = NatsRouter()
    consume(router, bus, SUBJECT, "test", handler, on_failure=on_failure, upstream=upstream)
    memory = InMemory(bus)

    async def undecoded(msg: NatsMessage) -> bytes:
        body: bytes = msg.body  # a dead letter's body may be anything
        return body

    @router.subscriber("dlq.>", stream=JStream(DLQ_STREAM, declare=False), decoder=undecoded)
    async def on_letter(msg: NatsMessage) -> None:
        memory.letters.append(msg.raw_message)

    bus.broker.include_router(router)
    async with TestNatsBroker(bus.broker):
        yield memory


def consumer(outcomes: list[Outcome], subject: str = SUBJECT) -> list[tuple[str, float | None]]:
    """The consumer's outcomes on `subject` (the dead-letter subscriber's own acks left out)."""
    return [(kind, delay) for s, kind, delay in outcomes if s == subject]


async def test_in_memory_success_is_acked(outcomes: list[Outcome]) -> None:
    calls: list[DocDeleted] = []

    async def handler(ev: DocDeleted) -> None:
        calls.append(ev)

    async with in_memory(handler) as bus:
        sent = event()
        await bus.deliver(sent.model_dump_json().encode())
    assert calls == [sent]
    assert consumer(outcomes) == [("ack", None)]
    assert bus.letters == []


async def test_in_memory_transient_error_is_nacked_with_the_backoff_of_its_delivery(
    outcomes: list[Outcome],
) -> None:
    hooked: list[Exception] = []

    async def handler(ev: DocDeleted) -> None:
        raise ConnectionError("the store is restarting")

    async def on_failure(ev: DocDeleted, err: Exception) -> None:
        hooked.append(err)

    async with in_memory(handler, on_failure) as bus:
        body = event().model_dump_json().encode()
        for delivered in range(1, MAX_DELIVER):
            await bus.deliver(body, delivered=delivered)
    assert consumer(outcomes) == [("nak", BACKOFF[0]), ("nak", BACKOFF[1])]
    assert bus.letters == [] and hooked == []


async def test_in_memory_transient_error_on_the_last_delivery_is_rejected_and_dead_lettered(
    outcomes: list[Outcome],
) -> None:
    hooked: list[str] = []

    async def handler(ev: DocDeleted) -> None:
        raise TimeoutError("the provider did not answer")

    async def on_failure(ev: DocDeleted, err: Exception) -> None:
        hooked.append(ev.event_id)

    async with in_memory(handler, on_failure) as bus:
        sent = event()
        await bus.deliver(sent.model_dump_json().encode(), delivered=MAX_DELIVER)
    assert consumer(outcomes) == [("term", None)]
    assert hooked == [sent.event_id]
    [letter] = bus.letters
    assert letter.headers["Kbmesh-Error-Type"] == "TimeoutError"
    assert letter.headers["Kbmesh-Error"] == "the provider did not answer"
    assert letter.headers["Kbmesh-Delivered"] == str(MAX_DELIVER)
    assert json.loads(letter.data)["event_id"] == sent.event_id


async def test_in_memory_permanent_error_is_rejected_and_dead_lettered_after_the_failure_hook(
    outcomes: list[Outcome],
) -> None:
    hooked: list[tuple[str, str]] = []

    async def handler(ev: DocDeleted) -> None:
        raise InvalidInput("document_ids: not a document", field="document_ids")

    async def on_failure(ev: DocDeleted, err: Exception) -> None:
        # The hook runs before the dead letter is published.
        assert bus.letters == []
        hooked.append((ev.event_id, str(err)))

    async with in_memory(handler, on_failure) as bus:
        sent = event()
        await bus.deliver(sent.model_dump_json().encode())
    assert consumer(outcomes) == [("term", None)]
    assert hooked == [(sent.event_id, "document_ids: not a document")]
    [letter] = bus.letters
    assert letter.subject == dlq_subject(sent.org_id, SUBJECT)
    assert letter.headers["Kbmesh-Error-Type"] == "ValidationError"
    assert letter.headers["Kbmesh-Original-Subject"] == SUBJECT
    assert letter.headers["Kbmesh-Delivered"] == "1"
    assert letter.data == sent.model_dump_json().encode()


@pytest.mark.parametrize(
    "body",
    [
        b'{"org_id": 7}',  # valid JSON, not the event
        b"not json at all",
        b"\xff\xfe",  # not UTF-8
        b"[" * 20_000 + b"]" * 20_000,  # nesting too deep for any decoder
    ],
    ids=["wrong-fields", "not-json", "not-utf8", "deep-nesting"],
)
async def test_in_memory_malformed_message_is_rejected_and_dead_lettered_unread(
    outcomes: list[Outcome], body: bytes
) -> None:
    """Decoding is FastStream's decoder hook; whatever fails there is rejected (never
    redelivered) and dead-lettered, and neither the handler nor the failure hook runs."""
    calls: list[object] = []

    async def handler(ev: DocDeleted) -> None:
        calls.append(ev)

    async def on_failure(ev: DocDeleted, err: Exception) -> None:
        calls.append(err)

    async with in_memory(handler, on_failure) as bus:
        await bus.deliver(body)
    assert calls == []
    assert consumer(outcomes) == [("term", None)]
    [letter] = bus.letters
    assert letter.headers["Kbmesh-Error-Type"] == "ValidationError"
    assert letter.headers["Kbmesh-Error"].startswith("malformed event")
    assert letter.data == body


async def test_in_memory_upstream_event_of_another_org_is_rejected_unread(
    outcomes: list[Outcome],
) -> None:
    """An upstream publisher's event is handled with `CURRENT_PUBLISHER` naming it; one that
    names another org than the publisher's is dead-lettered as Forbidden, and neither the
    handler nor the failure hook (which would act for that org) runs."""
    seen: list[tuple[str, Publisher | None]] = []
    hooked: list[Exception] = []

    async def handler(ev: DocDeleted) -> None:
        seen.append((ev.org_id, CURRENT_PUBLISHER.get()))

    async def on_failure(ev: DocDeleted, err: Exception) -> None:
        hooked.append(err)

    feeder = Publisher(name="feeder", org_id="acme")
    subject = upstream_subject(SUBJECT, feeder)
    async with in_memory(handler, on_failure, upstream=True) as bus:
        own = DocDeleted(org_id="acme", document_ids=["d1"])
        foreign = DocDeleted(org_id="victim", document_ids=["d2"])
        await bus.deliver(own.model_dump_json().encode(), subject=subject)
        await bus.deliver(foreign.model_dump_json().encode(), subject=subject)
        # kbmesh's own services publish unnamed: no publisher while their events run.
        await bus.deliver(event().model_dump_json().encode())
    assert seen == [("acme", feeder), ("org", None)]
    assert CURRENT_PUBLISHER.get() is None
    assert hooked == []
    assert consumer(outcomes, subject) == [("ack", None), ("term", None)]
    [letter] = bus.letters
    assert letter.headers["Kbmesh-Error-Type"] == "Forbidden"
    assert json.loads(letter.data)["org_id"] == "victim"
    # Filed under the publisher's org, never the org it named.
    assert letter.subject == dlq_subject(feeder.org_id, subject)


async def test_in_memory_a_working_handler_reports_progress_until_it_ends(
    outcomes: list[Outcome],
) -> None:
    """Progress every third of the ack wait (at least a second), so long work is not
    redelivered to another worker while it runs; none once the message is acked."""
    reported = asyncio.Event()

    async def handler(ev: DocDeleted) -> None:
        await wait_until(
            lambda: _true(("in_progress", None) in consumer(outcomes)),
            timeout=10,
            what="a progress report",
        )
        reported.set()

    async with in_memory(handler, ack_wait=3.0) as bus:
        await bus.deliver(event().model_dump_json().encode())
    assert reported.is_set()
    kinds = [kind for kind, _ in consumer(outcomes)]
    assert kinds[-1] == "ack" and set(kinds[:-1]) == {"in_progress"}


async def test_in_memory_a_dead_letter_is_published_inside_the_trace_of_its_message(
    outcomes: list[Outcome],
) -> None:
    """The dead letter carries the trace of the delivery that gave up (so a replay continues
    it), and its publish is a span of that trace."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def handler(ev: DocDeleted) -> None:
        raise InvalidInput("document_ids: not a document")

    async with in_memory(handler, tracer_provider=provider) as bus:
        await bus.deliver(event().model_dump_json().encode())
    [letter] = bus.letters
    spans = {span.name: span for span in exporter.get_finished_spans()}
    processed = spans[f"{SUBJECT} process"].context.trace_id
    assert spans[f"{dlq_subject('org', SUBJECT)} publish"].context.trace_id == processed
    assert letter.headers["traceparent"].split("-")[1] == format(processed, "032x")
