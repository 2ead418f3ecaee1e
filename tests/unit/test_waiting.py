"""An upload's wait for the index: the notification it may lose is made up for by reading
the index registry, less often the longer it stays quiet."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from services.common.domain.models import IndexEntry
from services.common.messages.events import DocIndexed
from services.gateway.service import waiting
from services.gateway.service.waiting import Events, Waiting


class Index:
    """The index registry, holding the entry from the `found_at`-th read on."""

    def __init__(self, found_at: int) -> None:
        self.found_at = found_at
        self.reads: list[float] = []

    async def get(self, key: str) -> IndexEntry | None:
        self.reads.append(time.monotonic())
        if len(self.reads) < self.found_at:
            return None
        kb_id, document_id = key.split(".")
        return IndexEntry(
            org_id="o",
            kb_id=kb_id,
            document_id=document_id,
            revision=1,
            checksum="c",
            settings_version=1,
            chunk_count=7,
        )

    async def settled(self) -> bool:
        return True  # nothing follows this registry: nothing to catch up with


def wait(index: Index, events: Events, seconds: float = 10.0) -> Any:
    w = Waiting(SimpleNamespace(index=index, documents=index), seconds)  # type: ignore[arg-type]
    return w.indexed(events, "o", "d1", {"kb"}, set(), 1, time.monotonic() + seconds)


def test_a_lost_notification_is_read_from_the_index_ever_less_often(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "_RECHECK_SECONDS", 0.05)
    monkeypatch.setattr(waiting, "_RECHECK_MAX_SECONDS", 0.2)
    index = Index(found_at=5)

    async def run() -> Any:
        started = time.monotonic()
        counts = await wait(index, asyncio.Queue())
        return counts, [b - a for a, b in zip([started, *index.reads], index.reads, strict=False)]

    counts, pauses = asyncio.run(run())
    assert counts == {"kb": 7}
    assert len(pauses) == 5
    # 0.05, 0.1, 0.2, then capped at 0.2 (timers may fire a little late, never early).
    for pause, least in zip(pauses, (0.05, 0.1, 0.2, 0.2, 0.2), strict=True):
        assert least - 0.01 <= pause < least + 0.15


def test_a_notification_ends_the_wait_without_reading_the_index(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "_RECHECK_SECONDS", 5.0)
    index = Index(found_at=1)

    async def run() -> Any:
        events: Events = asyncio.Queue()
        events.put_nowait(
            DocIndexed(org_id="o", kb_id="kb", document_id="d1", revision=1, chunk_count=3)
        )
        return await wait(index, events)

    assert asyncio.run(run()) == {"kb": 3}
    assert index.reads == []
