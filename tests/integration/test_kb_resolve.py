"""Resolving a KB reference (id, either UUID spelling, or name) on the live mirror of the
`kbs` bucket, with the bucket behind it for what the mirror has not seen yet."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js.api import KeyValueConfig

from services.common.bus.nats_server import NatsServer
from services.common.bus.registry import KbRegistry
from services.common.domain.models import KnowledgeBase


def kb(kb_id: str, name: str, description: str = "") -> KnowledgeBase:
    return KnowledgeBase(org_id="org", kb_id=kb_id, name=name, description=description)


class Counting(KbRegistry):
    """Counts reads that go to the bucket."""

    bucket_reads = 0

    async def get(self, key: str) -> KnowledgeBase | None:
        self.bucket_reads += 1
        return await super().get(key)


@pytest.fixture
async def registries(tmp_path: Path) -> AsyncIterator[tuple[Counting, KbRegistry]]:
    """A mirrored registry (a gateway) and a second writer on the same bucket (another)."""
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        try:
            kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="kbs"))
            mirrored, other = Counting(kv, KnowledgeBase), KbRegistry(kv, KnowledgeBase)
            await mirrored.mirror()
            yield mirrored, other
            await mirrored.close()
        finally:
            await nc.close()


async def test_ids_and_names_known_to_the_mirror_need_no_bucket_read(
    registries: tuple[Counting, KbRegistry],
) -> None:
    """Ids (either UUID spelling) and names the mirror holds resolve without a round trip;
    an id wins over another KB's name equal to it."""
    mirrored, _ = registries
    dashed = str(uuid.uuid4())
    for value in (kb("alpha", "one"), kb("beta", "alpha"), kb(dashed, "docs")):
        await mirrored.put(mirrored.key("org", value.kb_id), value)
    found = [
        await mirrored.resolve("org", ref)
        for ref in ("alpha", "one", "docs", dashed, uuid.UUID(dashed).hex)
    ]
    assert [f.kb_id if f else None for f in found] == ["alpha", "alpha", dashed, dashed, dashed]
    assert mirrored.bucket_reads == 0
    assert await mirrored.resolve("other-org", "alpha") is None
    assert await mirrored.resolve("org", "no such kb") is None


async def test_what_the_mirror_has_not_seen_is_read_from_the_bucket(
    registries: tuple[Counting, KbRegistry],
) -> None:
    """A KB created elsewhere and not yet delivered to the mirror still resolves by id;
    `fresh` (before a write) always reads the bucket."""
    mirrored, other = registries
    await mirrored.put(mirrored.key("org", "alpha"), kb("alpha", "one", "old"))
    await mirrored.close()  # the watch delivers nothing more
    await other.put(other.key("org", "gamma"), kb("gamma", "three"))
    await other.put(other.key("org", "alpha"), kb("alpha", "one", "new"))

    created = await mirrored.resolve("org", "gamma")
    assert created is not None and created.name == "three"
    stale = await mirrored.resolve("org", "alpha")
    fresh = await mirrored.resolve("org", "alpha", fresh=True)
    assert stale is not None and stale.description == "old"
    assert fresh is not None and fresh.description == "new"
    assert await mirrored.resolve("org", "absent") is None
