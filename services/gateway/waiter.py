"""Read-your-writes: lets a request wait until embed reports a document (un)indexed."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.common.events import DocFailed, DocIndexed, Subject


class IndexWaiter:
    """One core-NATS subscription per gateway, fanned out to per-document queues.

    Register (`watch`) before publishing, so no notification can slip past."""

    def __init__(self) -> None:
        self._queues: dict[str, list[asyncio.Queue[DocIndexed | DocFailed]]] = defaultdict(list)
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
    async def watch(
        self, document_ids: list[str]
    ) -> AsyncIterator[asyncio.Queue[DocIndexed | DocFailed]]:
        queue: asyncio.Queue[DocIndexed | DocFailed] = asyncio.Queue()
        for document_id in document_ids:
            self._queues[document_id].append(queue)
        try:
            yield queue
        finally:
            for document_id in document_ids:
                self._queues[document_id].remove(queue)
                if not self._queues[document_id]:
                    del self._queues[document_id]
