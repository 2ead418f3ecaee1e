"""Compare-and-set on a real JetStream KV bucket: a write, create or delete from a stale
revision loses (`Raced`) and changes nothing, and concurrent `Registry.change` calls each
count."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import KeyValueConfig
from pydantic import BaseModel

from services.common.bus.nats_server import NatsServer
from services.common.bus.registry import Registry
from services.common.domain.errors import Raced


class Counter(BaseModel):
    value: int = 0


@pytest.fixture
async def counters(nats_server: NatsServer) -> AsyncIterator[Registry[Counter]]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    bucket = f"cas-{uuid.uuid4().hex[:12]}"
    try:
        kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1))
        yield Registry(kv, Counter)
    finally:
        await js.delete_key_value(bucket)
        await nc.close()


async def test_writes_from_a_stale_revision_are_raced_and_change_nothing(counters):
    """Another writer got in between: update, create and delete from the old revision each
    raise Raced, and the other writer's value stays."""
    first = await counters.create("org.c", Counter(value=1))
    second = await counters.update("org.c", Counter(value=2), first)
    with pytest.raises(Raced):
        await counters.update("org.c", Counter(value=3), first)
    with pytest.raises(Raced):
        await counters.create("org.c", Counter(value=4))
    with pytest.raises(Raced):
        await counters.delete_unchanged("org.c", first)
    assert await counters.get("org.c") == Counter(value=2)
    await counters.delete_unchanged("org.c", second)
    assert await counters.get("org.c") is None


async def test_concurrent_changes_each_count(counters):
    """Ten writers increment one counter at once: each lost race re-reads and re-applies, so
    no increment is lost; a missing key is reported, not created."""
    await counters.create("org.c", Counter())

    def bump(current: Counter) -> Counter:
        current.value += 1
        return current

    results = await asyncio.gather(*(counters.change("org.c", bump) for _ in range(10)))
    assert await counters.get("org.c") == Counter(value=10)
    assert sorted(new.value for _, new in results) == list(range(1, 11))
    assert await counters.change("org.missing", bump) is None
