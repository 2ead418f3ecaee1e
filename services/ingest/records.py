"""Ingest's document records under compare-and-set: each read carries the revision it saw,
each write is made only from that revision, and a step that loses the race runs again on
what is there now (`compare_and_set`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.bus.registry import DocumentRegistry, compare_and_set
from services.common.domain.models import DocumentRecord

T = TypeVar("T")
# Ingest's consumers (uploads, OCR, tags, deletes, KB changes) run side by side and all write
# document records: every write is compare-and-set, and a lost race re-runs the read-decide-
# write step. A race that keeps being lost is left to the bus's redelivery with backoff.
CAS_ATTEMPTS = 10


class Records:
    def __init__(self, documents: DocumentRegistry) -> None:
        self.documents = documents

    async def get(self, key: str) -> tuple[DocumentRecord | None, int | None]:
        found = await self.documents.get_versioned(key)
        return found if found is not None else (None, None)

    async def save(self, record: DocumentRecord, last: int | None) -> int:
        """Compare-and-set: create when `last` is None, else update only from `last`
        (`Raced` otherwise, which `cas` answers by running its step again)."""
        if last is None:
            return await self.documents.create(record.key, record)
        return await self.documents.update(record.key, record, last)

    async def cas(self, step: Callable[[], Awaitable[T]]) -> T:
        return await compare_and_set(step, what="the document", attempts=CAS_ATTEMPTS)
