"""Waiting on a registry key (`?wait=true` uploads, waiting updates and deletes) leaves
nothing behind on the server once the wait is over."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from pydantic import BaseModel

from services.common.bus.nats_server import NatsServer
from services.common.bus.registry import Registry
from tests.support.domain import wait_until


class Record(BaseModel):
    value: int = 0


@pytest.fixture
async def bucket(
    nats_server: NatsServer,
) -> AsyncIterator[tuple[JetStreamContext, str, Registry[Record]]]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    name = f"wait-{uuid.uuid4().hex[:12]}"
    try:
        kv = await js.create_key_value(KeyValueConfig(bucket=name, history=1))
        yield js, f"KV_{name}", Registry(kv, Record)
    finally:
        await js.delete_key_value(name)
        await nc.close()


async def test_a_finished_wait_leaves_no_consumer_on_the_bucket(bucket):
    """A wait of two minutes that is answered at once leaves no consumer behind within
    seconds. Each wait watches its key through a consumer; one left for the whole timeout
    after its wait ended piled up under a burst of `wait=true` uploads (about a thousand
    within the timeout) until NATS refused new ones ("maximum consumers limit reached")
    and the uploads failed with 500."""
    js, stream, records = bucket
    await records.create("k", Record(value=1))
    for _ in range(3):
        ok, found = await records.wait_for("k", lambda r: r is not None, timeout=120)
        assert ok and found == Record(value=1)

    async def none_left() -> bool:
        return (await js.stream_info(stream)).state.consumer_count == 0

    await wait_until(none_left, timeout=30, interval=0.5, what="the waits' consumers to go")


async def test_a_wait_longer_than_the_consumer_idle_limit_still_sees_the_change(bucket):
    """The change comes 7 s into the wait, after the idle limit of a watch's consumer (5 s):
    the wait still answers with it (its subscription keeps the consumer alive)."""
    _, _, records = bucket
    await records.create("late", Record(value=1))

    async def change_later() -> None:
        await asyncio.sleep(7)  # the delay under test: past the consumer's idle limit
        found = await records.get_versioned("late")
        assert found is not None
        await records.update("late", Record(value=2), found[1])

    changing = asyncio.create_task(change_later())
    ok, found = await records.wait_for("late", lambda r: r is not None and r.value == 2, 60)
    await changing
    assert ok and found == Record(value=2)
