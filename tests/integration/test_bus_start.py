"""How a service's start meets the bus: what NATS refuses for good (credentials) ends the
start at once with a message that says what to fix; a bus that never answers ends it at the
start deadline, not never; and what counts as the bus being unavailable. Real nats-server
processes; the failover case, where the start waits and then succeeds, is
tests/e2e/test_start_during_failover.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.errors import ServerError
from opentelemetry import trace

from services.common.bus.auth import Credentials, new_password, server_accounts
from services.common.bus.client import (
    BUS_UNAVAILABLE,
    STARTING_STREAMS,
    Bus,
    BusStartError,
    declare_topology,
)
from services.common.bus.nats_server import NatsServer, free_port
from services.common.bus.registry import Registries
from services.common.messages.events import KbChanged
from services.common.messages.names import STREAM, Subject
from services.common.settings import BusSettings
from tests.support.domain import wait_until


async def test_a_wrong_password_ends_the_start_at_once_naming_the_user(tmp_path):
    """NATS answers "Authorization Violation": retrying cannot help, so the start fails
    within seconds (not after the deadline, and not never) and names the user and the
    settings to check."""
    ingest = Credentials("ingest", new_password())
    server = NatsServer(
        tmp_path / "nats", accounts=lambda: server_accounts({"ingest": ingest})
    ).start()
    bus = Bus(server.url, trace.get_tracer_provider(), Credentials("ingest", "not-the-password"))
    started = time.monotonic()
    try:
        async with asyncio.timeout(30):
            with pytest.raises(BusStartError) as refused:
                await bus.connect()
    finally:
        await bus.close()
        server.stop()
    assert time.monotonic() - started < 10
    message = str(refused.value)
    assert "'ingest'" in message and "Authorization Violation" in message
    assert "KBMESH_NATS__PASSWORD" in message


async def test_a_bus_that_never_answers_ends_the_start_at_its_deadline(tmp_path):
    """Nothing listens at the URL for the whole start: the start gives up once its
    deadline has passed, saying for how long it waited and what it last saw."""
    url = f"nats://127.0.0.1:{free_port()}"
    bus = Bus(url, trace.get_tracer_provider(), start_deadline_seconds=2.0)
    started = time.monotonic()
    try:
        async with asyncio.timeout(30):
            with pytest.raises(BusStartError) as gave_up:
                await bus.connect()
    finally:
        await bus.close()
    assert 2.0 <= time.monotonic() - started < 10
    assert "was not ready within 2 s" in str(gave_up.value)
    assert url in str(gave_up.value)


async def test_a_configuration_jetstream_refuses_ends_the_start_at_once(tmp_path):
    """Three replicas asked of a single server: JetStream answers 500 "replicas > 1 not
    supported in non-clustered mode", which no retry changes; the start fails at once with
    JetStream's words, not after the deadline."""
    server = NatsServer(tmp_path / "nats").start()
    bus = Bus(server.url, trace.get_tracer_provider(), rules=BusSettings(replicas=3))
    started = time.monotonic()
    try:
        async with asyncio.timeout(30):
            with pytest.raises(ServerError, match="replicas > 1 not supported"):
                await bus.connect()
    finally:
        await bus.close()
        server.stop()
    assert time.monotonic() - started < 10


async def test_an_event_no_stream_answers_is_the_bus_being_unavailable(tmp_path):
    """A publish that no stream leader answers (in a cluster: the leader just died and the
    next is not elected yet; here: the stream is gone) is classified as the bus being
    unavailable, which callers answer with 503 and Retry-After or retry, never a 500."""
    server = NatsServer(tmp_path / "nats").start()
    bus = Bus(server.url, trace.get_tracer_provider())
    try:
        await bus.connect()
        await bus.js.delete_stream(STREAM)
        event = KbChanged(org_id="acme", kb_id="kb1", change="created")
        with pytest.raises(BUS_UNAVAILABLE):
            await bus.publish(Subject.KB_CHANGED, event)
    finally:
        await bus.close()
        server.stop()


async def test_a_start_waits_for_a_bucket_that_is_being_created(tmp_path, caplog):
    """Opening the registries finds a bucket missing (on a cluster, one created a moment ago
    by another process may not be found at once; a stack's setup may create it after the
    service): the start waits, logging why, and goes on once the bucket exists."""
    server = NatsServer(tmp_path / "nats").start()
    bus = Bus(server.url, trace.get_tracer_provider())
    try:
        await bus.connect()
        await bus.js.delete_key_value("prompts")
        opening = asyncio.create_task(
            bus.starting("registries", lambda: Registries.open(bus.js), waits_for=STARTING_STREAMS)
        )

        async def waiting() -> bool:
            if opening.done():
                opening.result()  # raises what ended it
            return any("start_waiting step=registries" in r.getMessage() for r in caplog.records)

        await wait_until(waiting, timeout=20, what="the start to wait for the bucket")
        await declare_topology(bus.js, BusSettings())
        registries = await asyncio.wait_for(opening, 20)
        await registries.close()
    finally:
        await bus.close()
        server.stop()
