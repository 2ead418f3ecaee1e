"""The `texts` object store under replacement: a document's text is one object replaced in
place by each new upload, so a read may find its chunks purged under it."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.js.api import ObjectStoreConfig

from services.common.natsproc import NatsServer
from services.common.registry import TextStore


async def test_a_read_whose_chunks_were_purged_reads_the_replacement(tmp_path):
    """Chunks of a replaced version never arrive: the stalled read gives up within seconds
    (nats-py's own `get` waits forever) and a read returns the current version, whole."""
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            texts = TextStore(
                await js.create_object_store("texts", ObjectStoreConfig(bucket="texts"))
            )
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
        finally:
            await nc.close()
