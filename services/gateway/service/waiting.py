"""Read-your-writes: everything a request waits on — embed's (un)indexed notifications and
the document registry reaching a state — in one place.

Register (`watch`) before publishing, so no notification can slip past."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

from services.common.bus.registry import Registries
from services.common.domain.models import DocumentRecord
from services.common.messages.events import DocFailed, DocIndexed, Event

Events = asyncio.Queue[DocIndexed | DocFailed]
# A wait with no notification for this long reads the registries instead, and each quiet
# read doubles the next pause, up to `_RECHECK_MAX_SECONDS`: a lost notification is rare,
# and the uploads of a long ingest, all waiting, would otherwise each read every second.
_RECHECK_SECONDS = 1.0
_RECHECK_MAX_SECONDS = 4.0


class IndexWaiter:
    """The gateway's index notifications (heard by its subscribers, handlers.py), fanned out
    to per-document queues."""

    def __init__(self) -> None:
        self._queues: dict[str, list[Events]] = defaultdict(list)

    def dispatch(self, event: DocIndexed | DocFailed) -> None:
        if event.document_id:
            for queue in self._queues.get(event.document_id, []):
                queue.put_nowait(event)

    @contextlib.asynccontextmanager
    async def watch(self, document_ids: list[str]) -> AsyncIterator[Events]:
        queue: Events = asyncio.Queue()
        for document_id in document_ids:
            self._queues[document_id].append(queue)
        try:
            yield queue
        finally:
            for document_id in document_ids:
                self._queues[document_id].remove(queue)
                if not self._queues[document_id]:
                    del self._queues[document_id]


class Waiting:
    """The waits of write requests, each bounded by a deadline (`KBMESH_WAIT_TIMEOUT_SECONDS`)."""

    def __init__(self, registries: Registries, timeout_seconds: float) -> None:
        self.reg = registries
        self.timeout_seconds = timeout_seconds
        self.events = IndexWaiter()

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_seconds

    def watch(self, document_ids: list[str]) -> contextlib.AbstractAsyncContextManager[Events]:
        return self.events.watch(document_ids)

    async def record(
        self,
        key: str,
        predicate: Callable[[DocumentRecord], bool] | None,
        deadline: float,
        events: Events | None = None,
        cause: Event | None = None,
    ) -> DocumentRecord | DocFailed | None:
        """The document record once it satisfies `predicate` (None: once it is gone; then
        None is returned), watched in the registry; or, with `events`, ingest's failure to
        handle `cause` reported meanwhile; or None on timeout."""

        def reached(record: DocumentRecord | None) -> bool:
            return record is None if predicate is None else record is not None and predicate(record)

        watch = asyncio.ensure_future(
            self.reg.documents.wait_for(key, reached, deadline - time.monotonic())
        )
        failure = None
        if events is not None and cause is not None:
            failure = asyncio.ensure_future(_ingest_failure(events, cause))
        try:
            await asyncio.wait(
                [t for t in (watch, failure) if t is not None],
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for task in (watch, failure):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if failure is not None and failure.done() and not failure.cancelled():
            return failure.result()
        ok, record = watch.result()
        return record if ok else None

    async def indexed(
        self,
        events: Events,
        org_id: str,
        document_id: str,
        index_kbs: set[str],
        remove_kbs: set[str],
        revision: int,
        deadline: float,
    ) -> dict[str, int] | DocFailed | None:
        """Wait for doc.indexed from every KB in index_kbs (at `revision` or later) and a
        removal from every KB in remove_kbs. Returns chunk counts, the failure, or None on
        timeout. Document ids are per org: another org's events for the same id are not
        ours. The notifications are core NATS (at most once; a slow subscriber may lose
        some), so a quiet second reads the index registry, which embed writes before it
        announces (then two quiet seconds, four, ...)."""
        counts: dict[str, int] = {}
        removed: set[str] = set()
        quiet = _RECHECK_SECONDS
        while (index_kbs - counts.keys()) or (remove_kbs - removed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                ev = await asyncio.wait_for(events.get(), timeout=min(remaining, quiet))
            except TimeoutError:
                await self._read_index(document_id, index_kbs - counts.keys(), revision, counts)
                await self._read_removals(document_id, remove_kbs - removed, removed)
                quiet = min(quiet * 2, _RECHECK_MAX_SECONDS)
                continue
            if ev.org_id != org_id:
                continue
            if isinstance(ev, DocFailed):
                if ev.kb_id in index_kbs and (ev.revision or revision) >= revision:
                    return ev
                continue
            if not isinstance(ev, DocIndexed) or ev.revision < revision:
                continue
            if ev.removed:
                removed.add(ev.kb_id)
            elif ev.kb_id in index_kbs:
                counts[ev.kb_id] = ev.chunk_count
        await self._caught_up()
        return counts

    async def _caught_up(self) -> None:
        """A change the caller waited for shows in what it reads next: the KB figures and
        listings come from the gateway's live view of the registries (catalog.py), which
        another process's write reaches a moment after its notification."""
        await self.reg.documents.settled()
        await self.reg.index.settled()

    async def _read_index(
        self, document_id: str, kb_ids: set[str], revision: int, counts: dict[str, int]
    ) -> None:
        for kb_id in kb_ids:
            entry = await self.reg.index.get(f"{kb_id}.{document_id}")
            if entry is not None and entry.revision >= revision:
                counts[kb_id] = entry.chunk_count

    async def _read_removals(self, document_id: str, kb_ids: set[str], removed: set[str]) -> None:
        for kb_id in kb_ids:
            if await self.reg.index.get(f"{kb_id}.{document_id}") is None:
                removed.add(kb_id)

    async def removed(
        self, events: Events, org_id: str, records: list[DocumentRecord], deadline: float
    ) -> None:
        """Until each document reported one removal per KB it was in and left the registry."""
        expected = sum(len(r.kb_ids) for r in records)
        seen: set[tuple[str, str]] = set()
        while len(seen) < expected and time.monotonic() < deadline:
            try:
                ev = await asyncio.wait_for(events.get(), deadline - time.monotonic())
            except TimeoutError:
                break
            if isinstance(ev, DocIndexed) and ev.removed and ev.org_id == org_id:
                seen.add((ev.document_id, ev.kb_id))
        for r in records:
            await self.record(r.key, None, deadline)
        await self._caught_up()


async def _ingest_failure(events: Events, cause: Event) -> DocFailed:
    """Ingest's failure to handle `cause`, next on `events` (a concurrent write's failure
    is not ours); every other event read meanwhile is
    put back, in order, before those that arrived after (the index waits read them next)."""
    passed: list[DocIndexed | DocFailed] = []
    try:
        while True:
            ev = await events.get()
            if (
                isinstance(ev, DocFailed)
                and ev.stage == "ingest"
                and ev.org_id == cause.org_id
                and ev.cause == cause.event_id
            ):
                return ev
            passed.append(ev)
    finally:
        later = [events.get_nowait() for _ in range(events.qsize())]
        for ev in (*passed, *later):
            events.put_nowait(ev)
