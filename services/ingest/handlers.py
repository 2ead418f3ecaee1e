"""Ingest's bus subscribers: decode → IngestService → ack (wiring in common.bus)."""

from __future__ import annotations

from faststream.nats import NatsRouter

from services.common.bus.client import Bus, consume
from services.common.domain.content import STAGING_PREFIX
from services.common.messages.events import (
    DocDeleted,
    DocFailed,
    DocUploaded,
    KbChanged,
    OcrDone,
    TagsChanged,
)
from services.common.messages.names import Subject
from services.ingest.service import IngestService


def create_router(bus: Bus, service: IngestService) -> NatsRouter:
    router = NatsRouter()

    async def on_upload(ev: DocUploaded) -> None:
        await service.upload(ev)
        if ev.object_ref and ev.object_ref.startswith(STAGING_PREFIX):
            # The gateway's staging copy of a large upload; the original is stored now, and a
            # redelivery of this event finds the applied record before it reads content.
            await service.reg.texts.delete(ev.object_ref)

    async def upload_failed(ev: DocUploaded, err: Exception) -> None:
        if ev.object_ref and ev.object_ref.startswith(STAGING_PREFIX):
            # Dead-lettered for good: nothing will read the staged copy again.
            await service.reg.texts.delete(ev.object_ref)
        await service.upload_failed(ev, err)

    async def on_ocr(ev: OcrDone) -> None:
        await service.ocr_done(ev)

    async def on_tags(ev: TagsChanged) -> None:
        await service.change_tags(ev)

    async def on_delete(ev: DocDeleted) -> None:
        await service.delete(ev)

    async def on_kb(ev: KbChanged) -> None:
        await service.kb_changed(ev)

    async def on_failed(ev: DocFailed) -> None:
        await service.indexing_failed(ev)

    consume(
        router,
        bus,
        Subject.DOC_UPLOADED,
        "ingest-doc-uploaded",
        on_upload,
        on_failure=upload_failed,
        upstream=True,
    )
    # Upstream systems publish these four too (services/common/bus/auth.py).
    consume(router, bus, Subject.OCR_DONE, "ingest-ocr-done", on_ocr, upstream=True)
    consume(router, bus, Subject.TAGS_CHANGED, "ingest-tags-changed", on_tags, upstream=True)
    consume(router, bus, Subject.DOC_DELETED, "ingest-doc-deleted", on_delete, upstream=True)
    consume(router, bus, Subject.KB_CHANGED, "ingest-kb-changed", on_kb)
    consume(router, bus, Subject.DOC_FAILED, "ingest-doc-failed", on_failed)
    return router
