"""Ingest: owns the document registry and the texts. Uploads, OCR results, tag changes and
deletes become document records (`records.py`, compare-and-set), and every change becomes
`kb.index` / `kb.remove` for the embed service by KB membership (`membership.py`)."""

from __future__ import annotations

import contextlib
import functools
import logging

from services.common.bus.audit import AuditAction, AuditEntry, AuditSink
from services.common.bus.auth import CURRENT_PUBLISHER
from services.common.bus.registry import Registries
from services.common.domain.content import (
    check_size,
    checksum,
    content_checksum,
    decode_content,
)
from services.common.domain.errors import InvalidInput, KbmeshError, NotFound
from services.common.domain.ids import check_id, new_id
from services.common.domain.layout import Layout, layout_object
from services.common.domain.limits import (
    check_document_fields,
    check_extracted_text,
    check_labels,
    check_metadata,
    check_text,
)
from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    KnowledgeBase,
    Writer,
    id_unavailable,
    join_tags,
    kb_tag,
    split_tags,
    utcnow,
)
from services.common.messages.events import (
    DocDeleted,
    DocFailed,
    DocUploaded,
    KbChanged,
    OcrDone,
    Publish,
    TagsChanged,
)
from services.common.messages.names import Subject
from services.common.ops import metrics
from services.common.settings import Settings
from services.ingest.extract import NeedsOcr
from services.ingest.membership import Membership
from services.ingest.records import Records
from services.ingest.sandbox import Extractor

log = logging.getLogger("kbmesh.ingest")
# A failure's reason as kept on the document and the audit trail: as much as a dead letter's.
REASON_LENGTH = 2000
# The longest media type RFC 6838 allows (127 characters each side of the slash).
MIME_LENGTH = 255


def writer_for_bus_event(ev: DocUploaded | TagsChanged | DocDeleted | OcrDone) -> Writer:
    """Who wrote the change an event carries. An upstream publisher's event (the bus names
    the publisher: `busauth.CURRENT_PUBLISHER`) is written by that publisher, whatever
    writer it states, so that it cannot pass itself off as an API key; an event from within
    kbmesh's own account (the gateway, the only service that publishes uploads) carries the
    writer the gateway stated for its caller, else kind `bus`."""
    publisher = CURRENT_PUBLISHER.get()
    if publisher is not None:
        return Writer(kind="bus", name=publisher.name)
    if not isinstance(ev, OcrDone) and ev.writer is not None:
        return ev.writer
    return Writer(kind="bus")


class IngestService:
    def __init__(
        self,
        registries: Registries,
        publish: Publish,
        settings: Settings,
        audit: AuditSink | None = None,
    ) -> None:
        self.reg = registries
        self.publish = publish
        self.settings = settings
        self.audit = audit
        self.extractor = Extractor(settings.limits)
        self.records = Records(registries.documents)
        self.membership = Membership(registries, self.records, publish)

    def close(self) -> None:
        self.extractor.close()

    async def _audit(
        self,
        ev: DocUploaded | TagsChanged | DocDeleted | OcrDone,
        record: DocumentRecord,
        action: AuditAction,
        error: str | None = None,
    ) -> None:
        if self.audit is None:
            return
        await self.audit(
            AuditEntry(
                # Derived from the change: a redelivery records nothing twice.
                event_id=f"{ev.event_id}.{record.document_id}",
                org_id=record.org_id,
                kind="document",
                action=action,
                writer=writer_for_bus_event(ev),
                document_id=record.document_id,
                kb_id=getattr(ev, "kb_id", None),
                kb_ids=record.kb_ids,
                revision=record.revision,
                name=record.name,
                error=error,
            )
        )

    # ---- documents ------------------------------------------------------------------------

    async def upload(self, ev: DocUploaded) -> DocumentRecord:
        document_id = ev.document_id or _derived_id(ev.event_id)
        key = f"{ev.org_id}.{document_id}"
        existing = await self.reg.documents.get(key)
        if existing is not None and _seen(existing, ev.event_id):
            # A redelivery of an upload we already applied: re-announce, change nothing.
            await self.membership.announce(existing, existing.kb_ids, [])
            return existing
        check_document_fields(
            name=ev.name,
            source_id=ev.source_id,
            uri=ev.uri,
            tags=ev.tags,
            collection=ev.collection,
            metadata=ev.metadata,
            limits=self.settings.limits,
        )

        data = await self._content(ev)
        tags = list(ev.tags)
        if ev.kb_id:
            kb = await self._kb(ev.org_id, ev.kb_id)
            tags.append(kb_tag(kb.kb_id))
        visible, collection = split_tags(tags)
        text: str | None = None
        layout: Layout | None = None
        try:
            # In a child process with memory and time limits (see sandbox.py).
            extracted = await self.extractor.extract(data, ev.mime_type, ev.name)
        except NeedsOcr as scanned:
            mime = str(scanned)
        else:
            text, layout, mime = extracted.text, extracted.layout, extracted.mime_type
            check_extracted_text(text, self.settings.max_content_bytes)
        if existing is not None and not existing.writable_in(ev.scope_kb_ids):
            raise id_unavailable(document_id)  # before its original bytes are replaced
        await self.reg.texts.put(f"{ev.org_id}/{document_id}/original", data)

        async def write() -> DocumentRecord:
            existing, last = await self.records.get(key)
            if existing is not None and _seen(existing, ev.event_id):
                return existing  # a concurrent redelivery applied it meanwhile
            if existing is not None and not existing.writable_in(ev.scope_kb_ids):
                raise id_unavailable(document_id)
            record = DocumentRecord(
                org_id=ev.org_id,
                document_id=document_id,
                name=ev.name,
                mime_type=mime,
                source_id=ev.source_id,
                uri=ev.uri,
                source_revision=ev.source_revision,
                tags=join_tags(visible, ev.collection or collection),
                metadata=ev.metadata,
                size_bytes=len(data),
                content_checksum=content_checksum(data),
                accepted_at=ev.occurred_at,
            )
            if existing is not None:
                record.revision = existing.revision + 1
                record.created_at = existing.created_at
                record.kb_ids = existing.kb_ids
                record.recent_events = dict(existing.recent_events)
                record.writers = list(existing.writers)
            record.applied(ev.event_id, writer_for_bus_event(ev))
            record.upload_event_id = ev.event_id
            if text is None:
                record.status = DocStatus.awaiting_ocr
                await self.records.save(record, last)
                log.info("awaiting_ocr org_id=%s document_id=%s", ev.org_id, document_id)
                return record
            return await self._store_text(record, text, existing, last, layout)

        record = await self.records.cas(write)
        if record.upload_event_id == ev.event_id:
            await self._audit(ev, record, "uploaded")
        return record

    async def upload_failed(self, ev: DocUploaded, err: Exception) -> None:
        """An upload given up on (refused, or still failing after its last delivery): the
        document says why, the audit trail records the attempt, and `doc.failed` tells
        whoever waits. The record that says why: this upload's own, when it wrote one before
        failing; else, for a document id the uploader named that holds no content yet (a
        new document, or one whose uploads all failed), a `failed` record with the upload's
        name, source, labels and KB, so that its uploader can read the reason. A document
        with content keeps it; an upload whose own fields are invalid stores nothing."""
        reason = (str(err) or repr(err))[:REASON_LENGTH]
        document_id = ev.document_id
        record = None
        if document_id:
            record = await self.records.cas(
                functools.partial(self._record_failure, ev, document_id, reason)
            )
        else:
            with contextlib.suppress(InvalidInput):
                document_id = _derived_id(ev.event_id)  # the id it would have had
        if self.audit is not None:
            await self.audit(
                AuditEntry(
                    event_id=f"{ev.event_id}.{document_id}.failed",
                    org_id=ev.org_id,
                    kind="document",
                    action="failed",
                    writer=writer_for_bus_event(ev),
                    document_id=document_id,
                    kb_id=ev.kb_id,
                    kb_ids=record.kb_ids if record is not None else [],
                    revision=record.revision if record is not None else None,
                    name=ev.name,
                    error=reason,
                )
            )
        metrics.DOCUMENTS_FAILED.labels(stage="ingest").inc()
        await self.publish(
            Subject.DOC_FAILED,
            DocFailed(
                org_id=ev.org_id,
                document_id=ev.document_id,
                stage="ingest",
                error=reason,
                error_type=err.error_type if isinstance(err, KbmeshError) else "InternalError",
                cause=ev.event_id,
            ),
        )

    async def _record_failure(
        self, ev: DocUploaded, document_id: str, reason: str
    ) -> DocumentRecord | None:
        key = f"{ev.org_id}.{document_id}"
        existing, last = await self.records.get(key)
        if existing is not None and existing.last_event_id == ev.event_id:
            # This upload wrote the record, then failed (e.g. announcing it to embed).
            existing.status = DocStatus.failed
            existing.error = reason
            existing.updated_at = utcnow()
            await self.records.save(existing, last)
            return existing
        if existing is not None and (
            existing.status != DocStatus.failed or existing.content_checksum is not None
        ):
            return None  # it holds content from an earlier upload, which stays
        record = await self._failed_record(ev, document_id, reason)
        if record is None:
            return None
        if existing is not None:
            record.revision = existing.revision + 1
            record.created_at = existing.created_at
            record.writers = list(existing.writers)
        record.written(writer_for_bus_event(ev))
        await self.records.save(record, last)
        return record

    async def _failed_record(
        self, ev: DocUploaded, document_id: str, reason: str
    ) -> DocumentRecord | None:
        """The record of a document whose upload failed before it held any content. Not
        marked as the upload's own (`applied`): a replay of the dead letter runs again."""
        try:
            check_document_fields(
                name=ev.name,
                source_id=ev.source_id,
                uri=ev.uri,
                tags=ev.tags,
                collection=ev.collection,
                metadata=ev.metadata,
                limits=self.settings.limits,
            )
        except InvalidInput:
            return None
        tags = list(ev.tags)
        if ev.kb_id:
            # The KB's tag shows the document where it was sent (and to keys scoped to it).
            with contextlib.suppress(InvalidInput):
                tags.append(kb_tag((await self._kb(ev.org_id, ev.kb_id)).kb_id))
        visible, collection = split_tags(tags)
        return DocumentRecord(
            org_id=ev.org_id,
            document_id=document_id,
            name=ev.name,
            mime_type=ev.mime_type[:MIME_LENGTH],
            source_id=ev.source_id,
            uri=ev.uri,
            tags=join_tags(visible, ev.collection or collection),
            metadata=ev.metadata,
            accepted_at=ev.occurred_at,
            status=DocStatus.failed,
            error=reason,
        )

    async def ocr_done(self, ev: OcrDone) -> DocumentRecord:
        key = f"{ev.org_id}.{ev.document_id}"

        async def write() -> DocumentRecord:
            record, last = await self.records.get(key)
            if record is None:
                raise NotFound(f"document {ev.document_id} not found")
            if record.status != DocStatus.awaiting_ocr:
                return record  # a duplicate, or OCR for a document that already has text
            if not ev.ok:
                record.status = DocStatus.failed
                record.error = f"OCR failed: {ev.error or 'no reason given'}"
                metrics.DOCUMENTS_FAILED.labels(stage="ocr").inc()
                record.updated_at = utcnow()
                await self.records.save(record, last)
                await self._audit(ev, record, "failed", record.error)
                await self.publish(
                    Subject.DOC_FAILED,
                    DocFailed(
                        org_id=ev.org_id,
                        document_id=ev.document_id,
                        stage="ocr",
                        revision=record.revision,
                        error=record.error,
                    ),
                )
                return record
            if ev.text is not None:
                text = ev.text
            elif ev.object_ref:
                found = await self.reg.texts.get_text(ev.object_ref)
                if found is None:
                    raise InvalidInput(f"object {ev.object_ref!r} not found", field="object_ref")
                text = found
            else:
                raise InvalidInput("ocr.done with ok=true needs text or object_ref", field="text")
            check_text(text, "text")
            check_extracted_text(text, self.settings.max_content_bytes)
            # The upload made this revision; OCR supplies its text, so the revision stays.
            return await self._store_text(record, text, record, last)

        return await self.records.cas(write)

    async def _store_text(
        self,
        record: DocumentRecord,
        text: str,
        previous: DocumentRecord | None,
        last: int | None,
        layout: Layout | None = None,
    ) -> DocumentRecord:
        record.checksum = checksum(text)
        if previous is not None and previous.checksum != record.checksum:
            record.text_revision = previous.text_revision + 1
        await self.reg.texts.put(record.text_object, text.encode("utf-8"))
        # Beside the text, naming its checksum: embed uses it only with the text it describes.
        layout = (layout or Layout(checksum="")).model_copy(update={"checksum": record.checksum})
        await self.reg.texts.put(
            layout_object(record.org_id, record.document_id), layout.model_dump_json().encode()
        )
        record.status = DocStatus.ready
        record.error = None
        return await self.membership.apply(record, last)

    async def change_tags(self, ev: TagsChanged) -> DocumentRecord | None:
        key = f"{ev.org_id}.{ev.document_id}"
        visible, collection = split_tags(ev.tags)
        check_labels(visible, collection)
        if ev.metadata is not None:
            check_metadata(ev.metadata, self.settings.limits)

        async def write() -> DocumentRecord | None:
            record, last = await self.records.get(key)
            if record is None:
                raise NotFound(f"document {ev.document_id} not found")
            if _seen(record, ev.event_id):
                # A redelivery of a change already applied (past JetStream's de-duplication
                # window, or after a crash before the ack): re-announce, change nothing.
                if record.status == DocStatus.ready:
                    await self.membership.announce(record, record.kb_ids, [])
                return record
            if not record.writable_in(ev.scope_kb_ids):
                raise NotFound(f"document {ev.document_id} not found", field="document_id")
            if ev.revision is not None and ev.revision <= record.revision:
                log.info(
                    "stale tags.changed org_id=%s document_id=%s revision=%d current=%d",
                    ev.org_id,
                    ev.document_id,
                    ev.revision,
                    record.revision,
                )
                return None
            visible, collection = split_tags(ev.tags)
            record.tags = join_tags(visible, collection)
            if ev.metadata is not None:
                record.metadata = ev.metadata
            record.revision = ev.revision or record.revision + 1
            record.applied(ev.event_id, writer_for_bus_event(ev))
            if record.status in (DocStatus.awaiting_ocr, DocStatus.failed):
                record.updated_at = utcnow()
                await self.records.save(record, last)
                return record
            return await self.membership.apply(record, last)

        changed = await self.records.cas(write)
        if changed is not None and changed.last_event_id == ev.event_id:
            await self._audit(ev, changed, "changed")
        return changed

    async def delete(self, ev: DocDeleted) -> list[DocumentRecord]:
        keys = [f"{ev.org_id}.{document_id}" for document_id in ev.document_ids]
        if ev.source_id:
            keys += [
                r.key
                for r in await self.reg.documents.list(f"{ev.org_id}.")
                if r.source_id == ev.source_id
            ]
        deleted: list[DocumentRecord] = []
        for key in dict.fromkeys(keys):

            async def clear(key: str = key) -> DocumentRecord | None:
                record, last = await self.records.get(key)
                if record is None:
                    return None
                # Remove vectors first: the record is what embed checks membership against.
                lost = record.kb_ids
                record.revision += 1
                record.kb_ids = []
                record.tags = []
                last = await self.records.save(record, last)
                await self.membership.announce(record, [], lost)
                # Only the record we cleared: a change that slipped in meanwhile (and may
                # have indexed the document again) is cleared and announced once more.
                await self.reg.documents.delete_unchanged(key, last)
                return record

            record = await self.records.cas(clear)
            if record is None:
                continue
            await self.reg.texts.delete(record.text_object)
            await self.reg.texts.delete(layout_object(record.org_id, record.document_id))
            await self.reg.texts.delete(f"{record.org_id}/{record.document_id}/original")
            deleted.append(record)
            await self._audit(ev, record, "deleted")
        return deleted

    # ---- knowledge bases ------------------------------------------------------------------

    async def kb_changed(self, ev: KbChanged) -> None:
        """Backfill or remove documents when a KB is created, retagged, reconfigured."""
        await self.membership.kb_changed(ev)

    async def indexing_failed(self, ev: DocFailed) -> None:
        """Record why embed gave up on a document in a KB, so its status says why."""
        if ev.stage != "embed" or not ev.document_id or not ev.kb_id:
            return
        kb_id = ev.kb_id

        async def record_error() -> None:
            record, last = await self.records.get(f"{ev.org_id}.{ev.document_id}")
            if record is None or (ev.revision is not None and ev.revision < record.revision):
                return  # gone, or a newer revision is already being indexed
            if record.kb_errors.get(kb_id) == ev.error:
                return
            record.kb_errors[kb_id] = ev.error
            await self.records.save(record, last)

        await self.records.cas(record_error)

    # ---- helpers --------------------------------------------------------------------------

    async def _kb(self, org_id: str, kb_ref: str) -> KnowledgeBase:
        kb = await self.reg.kbs.get(f"{org_id}.{kb_ref}")
        if kb is None:
            for candidate in await self.reg.kbs.list(f"{org_id}."):
                if candidate.name == kb_ref:
                    return candidate
            raise InvalidInput(f"knowledge base {kb_ref!r} not found", field="kb_id")
        return kb

    async def _content(self, ev: DocUploaded) -> bytes:
        limit = self.settings.max_content_bytes
        if ev.content is not None:
            return decode_content(ev.content, ev.content_encoding, limit)
        if ev.object_ref:
            data = await self.reg.texts.get(ev.object_ref)
            if data is None:
                raise InvalidInput(f"object {ev.object_ref!r} not found", field="object_ref")
            check_size(len(data), limit)
            return data
        raise InvalidInput("doc.uploaded needs content or object_ref", field="content")


def _seen(record: DocumentRecord, event_id: str) -> bool:
    return record.last_event_id == event_id or event_id in record.recent_events


def _derived_id(event_id: str) -> str:
    """Upstream uploads without an id get one derived from the event, so a redelivery
    names the same document."""
    return check_id(event_id[:32].replace(".", "-"), "document_id") if event_id else new_id()
