"""Ingest: owns the document registry and the texts; decides KB membership from tags and
turns every change into `kb.index` / `kb.remove` for the embed service."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.bus.audit import AuditAction, AuditEntry, AuditSink
from services.common.bus.auth import CURRENT_PUBLISHER
from services.common.bus.registry import Registries, compare_and_set
from services.common.domain.content import (
    check_size,
    checksum,
    content_checksum,
    decode_content,
)
from services.common.domain.errors import InvalidInput, KbmeshError, NotFound, Transient
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
    KbIndex,
    KbRemove,
    OcrDone,
    Publish,
    Subject,
    TagsChanged,
)
from services.common.ops import metrics
from services.common.settings import Settings
from services.ingest.extract import NeedsOcr
from services.ingest.sandbox import Extractor

log = logging.getLogger("kbmesh.ingest")
T = TypeVar("T")
# Ingest's consumers (uploads, OCR, tags, deletes, KB changes) run side by side and all write
# document records: every write is compare-and-set, and a lost race re-runs the read-decide-
# write step. A race that keeps being lost is left to the bus's redelivery with backoff.
CAS_ATTEMPTS = 10
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
            await self._announce(existing, existing.kb_ids, [])
            return existing
        limits = self.settings.limits
        check_document_fields(
            name=ev.name,
            source_id=ev.source_id,
            uri=ev.uri,
            tags=ev.tags,
            collection=ev.collection,
            metadata=ev.metadata,
            limits=limits,
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
            check_extracted_text(text, limits)
        if existing is not None and not existing.writable_in(ev.scope_kb_ids):
            raise id_unavailable(document_id)  # before its original bytes are replaced
        await self.reg.texts.put(f"{ev.org_id}/{document_id}/original", data)

        async def write() -> DocumentRecord:
            existing, last = await self._get(key)
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
                await self._save(record, last)
                log.info("awaiting_ocr org_id=%s document_id=%s", ev.org_id, document_id)
                return record
            return await self._store_text(record, text, existing, last, layout)

        record = await self._cas(write)
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
            record = await self._cas(
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
        existing, last = await self._get(key)
        if existing is not None and existing.last_event_id == ev.event_id:
            # This upload wrote the record, then failed (e.g. announcing it to embed).
            existing.status = DocStatus.failed
            existing.error = reason
            existing.updated_at = utcnow()
            await self._save(existing, last)
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
        await self._save(record, last)
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
            record, last = await self._get(key)
            if record is None:
                raise NotFound(f"document {ev.document_id} not found")
            if record.status != DocStatus.awaiting_ocr:
                return record  # a duplicate, or OCR for a document that already has text
            if not ev.ok:
                record.status = DocStatus.failed
                record.error = f"OCR failed: {ev.error or 'no reason given'}"
                metrics.DOCUMENTS_FAILED.labels(stage="ocr").inc()
                record.updated_at = utcnow()
                await self._save(record, last)
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
            check_extracted_text(text, self.settings.limits)
            # The upload made this revision; OCR supplies its text, so the revision stays.
            return await self._store_text(record, text, record, last)

        return await self._cas(write)

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
        return await self._apply_membership(record, last)

    async def change_tags(self, ev: TagsChanged) -> DocumentRecord | None:
        key = f"{ev.org_id}.{ev.document_id}"
        visible, collection = split_tags(ev.tags)
        check_labels(visible, collection, self.settings.limits)
        if ev.metadata is not None:
            check_metadata(ev.metadata, self.settings.limits)

        async def write() -> DocumentRecord | None:
            record, last = await self._get(key)
            if record is None:
                raise NotFound(f"document {ev.document_id} not found")
            if _seen(record, ev.event_id):
                # A redelivery of a change already applied (past JetStream's de-duplication
                # window, or after a crash before the ack): re-announce, change nothing.
                if record.status == DocStatus.ready:
                    await self._announce(record, record.kb_ids, [])
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
                await self._save(record, last)
                return record
            return await self._apply_membership(record, last)

        changed = await self._cas(write)
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
                record, last = await self._get(key)
                if record is None:
                    return None
                # Remove vectors first: the record is what embed checks membership against.
                lost = record.kb_ids
                record.revision += 1
                record.kb_ids = []
                record.tags = []
                last = await self._save(record, last)
                await self._announce(record, [], lost)
                # Only the record we cleared: a change that slipped in meanwhile (and may
                # have indexed the document again) is cleared and announced once more.
                await self.reg.documents.delete_unchanged(key, last)
                return record

            record = await self._cas(clear)
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
        kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
        if ev.change == "deleted":
            kb = None
        rebuild = ev.change in ("settings", "reindex", "retry_failed")

        def member(record: DocumentRecord) -> bool:
            return kb is not None and kb.matches(record.tags)

        async def apply(key: str) -> None:
            record, last = await self._get(key)  # again: it may have changed since the listing
            if record is None or record.status != DocStatus.ready:
                return
            now, was = member(record), ev.kb_id in record.kb_ids
            retried = rebuild and ev.kb_id in record.kb_errors
            if now != was or retried:
                record.kb_ids = sorted(
                    {*record.kb_ids, ev.kb_id} if now else set(record.kb_ids) - {ev.kb_id}
                )
                record.kb_errors.pop(ev.kb_id, None)
                await self._save(record, last)
            # Fresh event ids: a KB change moves documents without bumping their revision, so
            # a document can leave, rejoin and leave a KB at one revision; ids derived from
            # the revision would make JetStream drop the second removal as a duplicate.
            if now and (rebuild or not was):
                await self._index(record, ev.kb_id, dedupe=False)
            elif was and not now:
                await self._remove(record, ev.kb_id, dedupe=False)

        for listed in await self.reg.documents.list(f"{ev.org_id}."):
            # A document written after the listing checks the KBs again itself (see
            # `_apply_membership`), so deciding from the listing here loses nothing.
            if listed.status != DocStatus.ready:
                continue
            if not rebuild and member(listed) == (ev.kb_id in listed.kb_ids):
                continue
            await self._cas(functools.partial(apply, listed.key))

    async def indexing_failed(self, ev: DocFailed) -> None:
        """Record why embed gave up on a document in a KB, so its status says why."""
        if ev.stage != "embed" or not ev.document_id or not ev.kb_id:
            return
        kb_id = ev.kb_id

        async def record_error() -> None:
            record, last = await self._get(f"{ev.org_id}.{ev.document_id}")
            if record is None or (ev.revision is not None and ev.revision < record.revision):
                return  # gone, or a newer revision is already being indexed
            if record.kb_errors.get(kb_id) == ev.error:
                return
            record.kb_errors[kb_id] = ev.error
            await self._save(record, last)

        await self._cas(record_error)

    # ---- helpers --------------------------------------------------------------------------

    async def _apply_membership(self, record: DocumentRecord, last: int | None) -> DocumentRecord:
        """Write `record` with its KB membership (compare-and-set on `last`) and announce it.

        The KB list is read before the write; a KB changed after that read is handled by
        ingest's `kb.changed` consumer only if it sees this write. When it may have read the
        record before it, the KB list read again after the write shows the change, and the
        membership is corrected here."""
        kbs = await self.reg.kbs.list(f"{record.org_id}.")
        members = sorted(kb.kb_id for kb in kbs if kb.matches(record.tags))
        lost = sorted(set(record.kb_ids) - set(members))
        record.kb_ids = members
        record.kb_errors = {}  # a new revision is a new attempt everywhere
        record.updated_at = utcnow()
        last = await self._save(record, last)
        await self._announce(record, members, lost)
        log.info(
            "document org_id=%s document_id=%s revision=%d kbs=%s removed=%s",
            record.org_id,
            record.document_id,
            record.revision,
            members,
            lost,
        )
        # Until the KB list read after our last write agrees with it: each correction is a
        # write, after which a KB may have changed again.
        for _ in range(CAS_ATTEMPTS):
            kbs = await self.reg.kbs.list(f"{record.org_id}.")
            now = sorted(kb.kb_id for kb in kbs if kb.matches(record.tags))
            if now == record.kb_ids:
                return record
            corrected = await self._cas(functools.partial(self._set_members, record, now))
            if corrected is None:
                return record  # deleted or changed again: that change announces itself
            record, was = corrected
            gained = sorted(set(now) - set(was))
            lost = sorted(set(was) - set(now))
            log.info(
                "membership corrected org_id=%s document_id=%s kbs=%s removed=%s",
                record.org_id,
                record.document_id,
                gained,
                lost,
            )
            for kb_id in gained:
                await self._index(record, kb_id, dedupe=False)
            for kb_id in lost:
                await self._remove(record, kb_id, dedupe=False)
        raise Transient(f"knowledge bases of {record.org_id} keep changing; retrying later")

    async def _set_members(
        self, record: DocumentRecord, members: list[str]
    ) -> tuple[DocumentRecord, list[str]] | None:
        """Write `members` as the KBs of `record`'s revision as stored; that record and the
        KBs it had (a `kb.changed` may have moved it meanwhile), or None when it was deleted
        or changed again."""
        current, last = await self._get(record.key)
        if current is None or current.revision != record.revision:
            return None
        was = current.kb_ids
        current.kb_ids = members
        await self._save(current, last)
        return current, was

    async def _announce(self, record: DocumentRecord, members: list[str], lost: list[str]) -> None:
        for kb_id in members:
            await self._index(record, kb_id)
        for kb_id in lost:
            await self._remove(record, kb_id)

    async def _index(self, record: DocumentRecord, kb_id: str, *, dedupe: bool = True) -> None:
        event = KbIndex(
            org_id=record.org_id,
            kb_id=kb_id,
            document_id=record.document_id,
            revision=record.revision,
        )
        if dedupe:
            event.event_id = _event_id("i", record, kb_id)
        await self.publish(Subject.KB_INDEX, event)

    async def _remove(self, record: DocumentRecord, kb_id: str, *, dedupe: bool = True) -> None:
        event = KbRemove(
            org_id=record.org_id,
            kb_id=kb_id,
            document_id=record.document_id,
            revision=record.revision,
        )
        if dedupe:
            event.event_id = _event_id("r", record, kb_id)
        await self.publish(Subject.KB_REMOVE, event)

    async def _get(self, key: str) -> tuple[DocumentRecord | None, int | None]:
        found = await self.reg.documents.get_versioned(key)
        return found if found is not None else (None, None)

    async def _save(self, record: DocumentRecord, last: int | None) -> int:
        """Compare-and-set: create when `last` is None, else update only from `last`
        (`Raced` otherwise, which `_cas` answers by running its step again)."""
        if last is None:
            return await self.reg.documents.create(record.key, record)
        return await self.reg.documents.update(record.key, record, last)

    async def _cas(self, step: Callable[[], Awaitable[T]]) -> T:
        return await compare_and_set(step, what="the document", attempts=CAS_ATTEMPTS)

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


def _event_id(kind: str, record: DocumentRecord, kb_id: str) -> str:
    # Deterministic: a redelivered upload republishes the same ids, and JetStream drops them.
    # The change's own event id is part of it because a revision alone is not unique over
    # time: a document deleted and uploaded again starts over at revision 1.
    return f"{kind}-{kb_id}-{record.document_id}-{record.revision}-{record.last_event_id}"
