"""Embed's bus subscribers, and its one responder: the export of a KB's vectors."""

from __future__ import annotations

from collections.abc import Callable

from faststream.nats import NatsRouter

from services.common.bus.client import Bus, consume
from services.common.bus.replies import Responder
from services.common.messages.events import DocFailed, KbChanged, KbIndex, KbRemove
from services.common.messages.names import Subject
from services.common.ops import metrics
from services.common.store import VectorStore
from services.common.store.export import answer_export
from services.embed.service import EmbedService

QUEUE = "embed"


def create_router(bus: Bus, service: EmbedService, *, concurrency: int = 1) -> NatsRouter:
    router = NatsRouter()

    async def on_index(ev: KbIndex) -> None:
        await service.index(ev)

    async def index_failed(ev: KbIndex, err: Exception) -> None:
        metrics.DOCUMENTS_FAILED.labels(stage="embed").inc()
        await bus.publish(
            Subject.DOC_FAILED,
            DocFailed(
                org_id=ev.org_id,
                document_id=ev.document_id,
                kb_id=ev.kb_id,
                revision=ev.revision,
                stage="embed",
                error=str(err) or repr(err),
            ),
        )

    async def on_remove(ev: KbRemove) -> None:
        await service.remove(ev)

    async def on_kb(ev: KbChanged) -> None:
        await service.kb_changed(ev)

    consume(
        router,
        bus,
        Subject.KB_INDEX,
        "embed-kb-index",
        on_index,
        on_failure=index_failed,
        max_workers=concurrency,
    )
    consume(router, bus, Subject.KB_REMOVE, "embed-kb-remove", on_remove)
    consume(router, bus, Subject.KB_CHANGED, "embed-kb-changed", on_kb)
    return router


def create_responders(store: VectorStore, *, max_payload: Callable[[], int]) -> list[Responder]:
    """`vectors.export` for `kbmesh backup`: one page at a time, each fitting in one message
    of the connected server (`max_payload`)."""

    async def on_export(body: bytes) -> bytes:
        return await answer_export(store, body, max_payload())

    return [Responder(Subject.VECTORS_EXPORT, on_export, queue=QUEUE, concurrency=1)]
