"""Progress of long work in a knowledge base: the numbers (for stats) and the live feed (for
the server-sent event stream), driven by the bus's `doc.indexed` / `doc.failed`, `kb.changed`
and the KB records' own changes (heard by the gateway's subscribers, handlers.py) rather
than by polling."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import ServerSentEvent

from services.common.domain.models import KBStatus, KnowledgeBase
from services.common.messages.events import DocFailed, DocIndexed, KbChanged
from services.gateway.catalog import KbFigures
from services.gateway.schemas import KbProgress, ReindexProgress

# Idle streams get a comment this often, so proxies and clients keep them open.
KEEPALIVE_SECONDS = 15.0
# Snapshots are recomputed at most this often while events pour in.
SNAPSHOT_EVERY_SECONDS = 0.25


def kb_progress(kb: KnowledgeBase, figures: KbFigures) -> KbProgress:
    """Where a KB's documents stand (`figures`: the gateway's live counts, catalog.py)."""
    reindex = None
    if kb.status == KBStatus.pending_reindex:
        reindex = ReindexProgress(
            settings_version=kb.settings_version,
            done=figures.rebuild_done,
            total=figures.rebuild_total,
        )
    return KbProgress(
        total=figures.members,
        indexed=figures.indexed,
        pending=figures.members - figures.indexed - figures.failed,
        failed=figures.failed,
        reindex=reindex,
    )


Item = DocIndexed | DocFailed | KbChanged | str | None  # None: the KB record changed
CLOSED = "closed"  # the gateway is stopping


class ProgressFeed:
    """What the gateway hears on the bus, fanned out to the streams open on each KB.
    Listeners register before they read their first snapshot, so nothing that happens after
    it is missed."""

    def __init__(self) -> None:
        self._listeners: dict[str, set[asyncio.Queue[Item]]] = defaultdict(set)
        self._closed = False

    def close_streams(self) -> None:
        """End every open stream, and any opened from now on: the HTTP server waits for open
        responses before it stops, and a stream never ends by itself."""
        self._closed = True
        for queues in list(self._listeners.values()):
            for queue in queues:
                queue.put_nowait(CLOSED)

    def event(self, event: DocIndexed | DocFailed | KbChanged) -> None:
        if event.kb_id:
            self._send(event.kb_id, event)
        else:  # an upload that failed before KB membership: any KB may count it
            for kb_id in list(self._listeners):
                self._send(kb_id, event)

    def kb_record_changed(self, kb_id: str) -> None:
        self._send(kb_id, None)

    def _send(self, kb_id: str, item: Item) -> None:
        for queue in self._listeners.get(kb_id, ()):
            queue.put_nowait(item)

    # Plain functions, not a context manager: a stream left suspended when its client went
    # away is finalised by the event loop later, where only synchronous clean-up is safe.
    def subscribe(self, kb_id: str) -> asyncio.Queue[Item]:
        queue: asyncio.Queue[Item] = asyncio.Queue()
        if self._closed:
            queue.put_nowait(CLOSED)
        self._listeners[kb_id].add(queue)
        return queue

    def unsubscribe(self, kb_id: str, queue: asyncio.Queue[Item]) -> None:
        listeners = self._listeners.get(kb_id)
        if listeners is not None:
            listeners.discard(queue)
            if not listeners:
                del self._listeners[kb_id]


async def event_stream(
    feed: ProgressFeed,
    org_id: str,
    kb_id: str,
    snapshot: Callable[[], Awaitable[KbProgress | None]],
) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events for one KB: `progress` (a snapshot, whenever it changed) and
    `document` (one per status change); `deleted` ends the stream when the KB goes. The
    response (sse-starlette's) frames them and keeps an idle stream alive."""
    queue = feed.subscribe(kb_id)
    try:
        last = await snapshot()
        if last is None:
            yield _sse("deleted", {"kb_id": kb_id})
            return
        yield _sse("progress", {"kb_id": kb_id, **last.model_dump()})
        dirty, next_at = False, 0.0
        while True:
            wait = max(next_at - time.monotonic(), 0.0) if dirty else None
            try:
                item = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                dirty, next_at = False, time.monotonic() + SNAPSHOT_EVERY_SECONDS
                current = await snapshot()
                if current is None:
                    yield _sse("deleted", {"kb_id": kb_id})
                    return
                if current != last:
                    last = current
                    yield _sse("progress", {"kb_id": kb_id, **current.model_dump()})
                continue
            if item == CLOSED:
                return
            if isinstance(item, str) or (item is not None and item.org_id != org_id):
                continue
            document = _document_event(item)
            if document is not None and document["kb_id"] == kb_id:
                yield _sse("document", document)
            dirty = True
    finally:
        feed.unsubscribe(kb_id, queue)


def _document_event(item: Item) -> dict[str, Any] | None:
    if isinstance(item, DocIndexed):
        return {
            "kb_id": item.kb_id,
            "document_id": item.document_id,
            "status": "removed" if item.removed else "indexed",
            "revision": item.revision,
            "chunk_count": item.chunk_count,
            "error": None,
        }
    if isinstance(item, DocFailed) and item.document_id:
        return {
            "kb_id": item.kb_id,
            "document_id": item.document_id,
            "status": "failed",
            "revision": item.revision,
            "chunk_count": None,
            "error": item.error,
        }
    return None


def _sse(event: str, data: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(event=event, data=json.dumps(data, separators=(",", ":")))
