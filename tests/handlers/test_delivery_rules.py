"""The delivery rules every subscriber gets from `consume` (services/common/infra/bus.py), tested at
the handler level with FastStream's `TestNatsBroker` over a real nats-server (JetStream pull
consumers need one: their acks, redeliveries and delivery counts are the server's):

- a handler that returns acks, and the message is not delivered again;
- a transient error is nacked and redelivered with backoff, then acked once it succeeds;
- a permanent error (`InvalidInput`) is rejected at once: dead-lettered with the reason,
  after the owner's failure hook ran, and never redelivered;
- a transient error on the last allowed delivery is dead-lettered the same way;
- a message that is not its event is dead-lettered without reaching the handler;
- an upstream publisher's event reaches the handler with the publisher known, unless it
  names another org than the publisher's: then it is dead-lettered unread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from faststream.nats import NatsRouter, TestNatsBroker
from opentelemetry import trace

from services.common.domain.errors import InvalidInput
from services.common.infra.bus import CURRENT_PUBLISHER, Bus, consume, declare_consumer
from services.common.infra.busauth import Publisher, upstream_subject
from services.common.infra.natsproc import NatsServer
from services.common.messages.events import DLQ_STREAM, STREAM, DocDeleted, Subject, dlq_subject
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
    settings = Settings(bus=BusSettings(max_deliver=3, backoff_seconds=[0.05, 0.1]))
    bus = Bus(nats_url, trace.get_tracer_provider(), rules=settings.bus)
    durable = f"test-{uuid.uuid4().hex[:8]}"
    router = NatsRouter()
    consume(router, bus, SUBJECT, durable, handler, on_failure=on_failure, upstream=upstream)
    bus.broker.include_router(router)
    await bus.connect(administer=True)
    # The topology step creates the consumers of services/common/infra/busauth.WORK: this
    # test's own durables are created here, as the operator would.
    for consumer in bus.consumers:
        await declare_consumer(bus.js, consumer, settings.bus)
    # A new durable reads the stream from its start: earlier tests' events are not ours.
    await bus.js.purge_stream(STREAM)
    try:
        async with TestNatsBroker(bus.broker, with_real=True):
            yield bus, durable
    finally:
        await bus.close()


async def settled(bus: Bus, durable: str) -> None:
    """Until the durable has nothing pending and nothing unacknowledged."""

    async def idle() -> bool:
        info = await bus.js.consumer_info(STREAM, durable)
        return info.num_pending == 0 and info.num_ack_pending == 0

    await wait_until(idle, timeout=30, what=f"{durable} to settle")


@contextlib.asynccontextmanager
async def dead_letters(nats_url: str) -> AsyncIterator[asyncio.Queue[nats.aio.msg.Msg]]:
    """Dead letters of SUBJECT published from now on."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    queue: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()

    async def on_letter(msg: nats.aio.msg.Msg) -> None:
        await queue.put(msg)

    sub = await js.subscribe(
        dlq_subject(SUBJECT), stream=DLQ_STREAM, cb=on_letter, deliver_policy="new"
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
    is dead-lettered as Forbidden and the handler never sees it."""
    seen: list[tuple[str, Publisher | None]] = []

    async def handler(ev: DocDeleted) -> None:
        seen.append((ev.org_id, CURRENT_PUBLISHER.get()))

    feeder = Publisher(name="feeder", org_id="acme")
    subject = upstream_subject(SUBJECT, feeder)
    nc = await nats.connect(nats_url)
    letters = await nc.subscribe(dlq_subject(subject))
    try:
        async with subscribed(nats_url, handler, upstream=True) as (bus, durable):
            for org in ("acme", "victim"):
                sent = DocDeleted(org_id=org, document_ids=[uuid.uuid4().hex])
                await bus.js.publish(
                    subject, sent.model_dump_json().encode(), headers={"Nats-Msg-Id": sent.event_id}
                )
            letter = await letters.next_msg(timeout=30)
            await settled(bus, f"{durable}-upstream")
    finally:
        await nc.close()
    assert seen == [("acme", feeder)]
    assert json.loads(letter.data)["org_id"] == "victim"
    assert letter.headers is not None and letter.headers["Kbmesh-Error-Type"] == "Forbidden"
