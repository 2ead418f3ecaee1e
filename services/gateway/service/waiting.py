"""Read-your-writes: everything a request waits on — embed's (un)indexed notifications and
the document registry reaching a state — in one place.

Register (`watch`) before publishing, so no notification can slip past."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.common.events import DocFailed, DocIndexed, Event, Subject
from services.common.models import DocumentRecord
from services.common.registry import Registries

POLL_SECONDS = 0.05
Events = asyncio.Queue[DocIndexed | DocFailed]


class IndexWaiter:
    """One core-NATS subscription per gateway, fanned out to per-document queues."""

    def __init__(self) -> None:
        self._queues: dict[str, list[Events]] = defaultdict(list)
        self._subs: list[Subscription] = []

    async def start(self, nc: nats.NATS) -> None:
        self._subs = [
            await nc.subscribe(Subject.DOC_INDEXED, cb=self._on_indexed),
            await nc.subscribe(Subject.DOC_FAILED, cb=self._on_failed),
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_indexed(self, msg: Msg) -> None:
        with contextlib.suppress(ValidationError):
            self._dispatch(DocIndexed.model_validate_json(msg.data))

    async def _on_failed(self, msg: Msg) -> None:
        with contextlib.suppress(ValidationError):
            self._dispatch(DocFailed.model_validate_json(msg.data))

    def _dispatch(self, event: DocIndexed | DocFailed) -> None:
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
        None is returned), ingest's failure to handle `cause` reported meanwhile on
        `events`, or None on timeout."""
        while time.monotonic() < deadline:
            if events is not None and cause is not None:
                failed = drain_failure(events, cause)
                if failed is not None:
                    return failed
            record = await self.reg.documents.get(key)
            if predicate is None and record is None:
                return None
            if predicate is not None and record is not None and predicate(record):
                return record
            await asyncio.sleep(POLL_SECONDS)
        return None

    async def indexed(
        self,
        events: Events,
        org_id: str,
        index_kbs: set[str],
        remove_kbs: set[str],
        revision: int,
        deadline: float,
    ) -> dict[str, int] | DocFailed | None:
        """Wait for doc.indexed from every KB in index_kbs (at `revision` or later) and a
        removal from every KB in remove_kbs. Returns chunk counts, the failure, or None on
        timeout. Document ids are per org: another org's events for the same id are not
        ours."""
        counts: dict[str, int] = {}
        removed: set[str] = set()
        while (index_kbs - counts.keys()) or (remove_kbs - removed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                ev = await asyncio.wait_for(events.get(), timeout=remaining)
            except TimeoutError:
                return None
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
        return counts

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


def drain_failure(events: Events, cause: Event) -> DocFailed | None:
    """Ingest's failure to handle `cause` among the queued events (the others stay queued;
    a concurrent write's failure is not ours)."""
    pending: list[DocIndexed | DocFailed] = []
    failure = None
    while not events.empty():
        ev = events.get_nowait()
        if (
            isinstance(ev, DocFailed)
            and ev.stage == "ingest"
            and ev.org_id == cause.org_id
            and ev.cause == cause.event_id
            and failure is None
        ):
            failure = ev
        else:
            pending.append(ev)
    for ev in pending:
        events.put_nowait(ev)
    return failure
