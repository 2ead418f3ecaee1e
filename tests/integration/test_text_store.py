"""The `texts` object store under replacement: a document's text is one object replaced in
place by each new upload, so a read may find its chunks purged under it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import ObjectStoreConfig

from services.common.bus.nats_server import NatsServer
from services.common.bus.registry import TextStore


@pytest.fixture
async def server(tmp_path) -> AsyncIterator[NatsServer]:
    with NatsServer(tmp_path / "nats") as running:
        yield running


@pytest.fixture
async def texts(server: NatsServer) -> AsyncIterator[TextStore]:
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        yield TextStore(await js.create_object_store("texts", ObjectStoreConfig(bucket="texts")))
    finally:
        await nc.close()


async def test_a_read_whose_chunks_were_purged_reads_the_replacement(texts):
    """Chunks of a replaced version never arrive: the stalled read gives up within seconds
    (nats-py's own `get` waits forever) and a read returns the current version, whole."""
    old, new = b"old " * 100_000, b"new " * 90_000  # several chunks each
    await texts.put("org/doc/text", old)
    stale = await texts.store.get_info("org/doc/text")
    await texts.put("org/doc/text", new)

    started = time.monotonic()
    assert await asyncio.wait_for(texts._chunks(stale.nuid or ""), 10) is None
    assert time.monotonic() - started < 5
    assert await texts.get("org/doc/text") == new
    assert await texts.get("org/doc/missing") is None
    await texts.put("org/doc/empty", b"")
    assert await texts.get("org/doc/empty") == b""


async def test_a_one_chunk_object_is_read_with_two_requests_and_no_consumer(server, texts):
    """Most texts fit one chunk: they are read as the chunk subject's last message (the
    object's info, then the chunk), without the consumer a multi-chunk read needs. A
    replacement under the read gives None there too, and `get` then reads the new text."""
    text = "één chunk ✓ ".encode() * 100
    await texts.put("org/doc/text", text)
    assert (await texts.store.get_info("org/doc/text")).chunks == 1

    spy = await nats.connect(server.url)
    requests = await spy.subscribe("$JS.API.>")
    marker = await spy.subscribe("test.read-done")
    await spy.flush()
    assert await texts.get("org/doc/text") == text
    # The spy hears the reader on a connection of its own, later than the reader has its
    # answers. The server keeps one sender's order: a marker the reader sends after its
    # requests reaches the spy after them, so once it is in, every request is queued.
    await texts.store._js._nc.publish("test.read-done", b"")
    await marker.next_msg(timeout=5)
    asked = [(await requests.next_msg(timeout=1)).subject for _ in range(requests.pending_msgs)]
    await spy.close()
    assert asked == ["$JS.API.STREAM.MSG.GET.OBJ_texts"] * 2  # info, then the chunk
    assert (await texts.store._js.stream_info("OBJ_texts")).state.consumer_count == 0

    stale = await texts.store.get_info("org/doc/text")
    await texts.put("org/doc/text", b"replacement")
    assert await texts._only_chunk(stale.nuid or "") is None
    assert await texts.get("org/doc/text") == b"replacement"
