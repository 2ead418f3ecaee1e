"""Ingest: owns the document registry and the texts; decides KB membership from tags and
turns every change into `kb.index` / `kb.remove` for the embed service."""

from __future__ import annotations

import logging

from services.common.content import (
    check_size,
    checksum,
    decode_content,
    is_supported,
    normalise_mime,
)
from services.common.errors import InvalidInput, NotFound
from services.common.events import (
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
from services.common.models import (
    DocStatus,
    DocumentRecord,
    KnowledgeBase,
    check_id,
    join_tags,
    kb_tag,
    new_id,
    split_tags,
    utcnow,
)
from services.common.registry import Registries
from services.common.settings import Settings
from services.ingest.extract import NeedsOcr, extract_text

log = logging.getLogger("kbmesh.ingest")


class IngestService:
    def __init__(self, registries: Registries, publish: Publish, settings: Settings) -> None:
        self.reg = registries
        self.publish = publish
        self.settings = settings

    # ---- documents ------------------------------------------------------------------------

    async def upload(self, ev: DocUploaded) -> DocumentRecord:
        document_id = ev.document_id or _derived_id(ev.event_id)
        key = f"{ev.org_id}.{document_id}"
        existing = await self.reg.documents.get(key)
        if existing is not None and existing.last_event_id == ev.event_id:
            # A redelivery of an upload we already applied: re-announce, change nothing.
            await self._announce(existing, existing.kb_ids, [])
            return existing

        data = await self._content(ev)
        mime = normalise_mime(ev.mime_type, ev.name)
        if not is_supported(mime):
            raise InvalidInput(f"unsupported mime_type {mime!r}", field="mime_type")
        tags = list(ev.tags)
        if ev.kb_id:
            kb = await self._kb(ev.org_id, ev.kb_id)
            tags.append(kb_tag(kb.kb_id))
        visible, collection = split_tags(tags)
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
            last_event_id=ev.event_id,
        )
        if existing is not None:
            record.revision = existing.revision + 1
            record.created_at = existing.created_at
            record.kb_ids = existing.kb_ids
        original = f"{ev.org_id}/{document_id}/original"
        await self.reg.texts.put(original, data)
        try:
            text = extract_text(data, mime)
        except NeedsOcr:
            record.status = DocStatus.awaiting_ocr
            await self.reg.documents.put(key, record)
            log.info("awaiting_ocr org_id=%s document_id=%s", ev.org_id, document_id)
            return record
        return await self._store_text(record, text, existing)

    async def ocr_done(self, ev: OcrDone) -> DocumentRecord:
        key = f"{ev.org_id}.{ev.document_id}"
        record = await self.reg.documents.get(key)
        if record is None:
            raise NotFound(f"document {ev.document_id} not found")
        if record.status != DocStatus.awaiting_ocr:
            return record  # a duplicate, or OCR for a document that already has text
        if not ev.ok:
            record.status = DocStatus.failed
            record.error = f"OCR failed: {ev.error or 'no reason given'}"
            record.updated_at = utcnow()
            await self.reg.documents.put(key, record)
            await self.publish(
                Subject.DOC_FAILED,
                DocFailed(org_id=ev.org_id, document_id=ev.document_id, stage="ocr",
                          revision=record.revision, error=record.error),
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
        return await self._store_text(record, text, record)

    async def _store_text(
        self, record: DocumentRecord, text: str, previous: DocumentRecord | None
    ) -> DocumentRecord:
        record.checksum = checksum(text)
        if previous is not None and previous.checksum != record.checksum:
            record.text_revision = previous.text_revision + 1
        await self.reg.texts.put(record.text_object, text.encode("utf-8"))
        record.status = DocStatus.ready
        record.error = None
        return await self._apply_membership(record)

    async def change_tags(self, ev: TagsChanged) -> DocumentRecord | None:
        key = f"{ev.org_id}.{ev.document_id}"
        found = await self.reg.documents.get_versioned(key)
        if found is None:
            raise NotFound(f"document {ev.document_id} not found")
        record, _ = found
        if ev.revision is not None and ev.revision <= record.revision:
            log.info(
                "stale tags.changed org_id=%s document_id=%s revision=%d current=%d",
                ev.org_id, ev.document_id, ev.revision, record.revision,
            )
            return None
        visible, collection = split_tags(ev.tags)
        record.tags = join_tags(visible, collection)
        if ev.metadata is not None:
            record.metadata = ev.metadata
        record.revision = ev.revision or record.revision + 1
        record.last_event_id = ev.event_id
        if record.status in (DocStatus.awaiting_ocr, DocStatus.failed):
            record.updated_at = utcnow()
            await self.reg.documents.put(key, record)
            return record
        return await self._apply_membership(record)

    async def delete(self, ev: DocDeleted) -> list[DocumentRecord]:
        records: list[DocumentRecord] = []
        for document_id in ev.document_ids:
            record = await self.reg.documents.get(f"{ev.org_id}.{document_id}")
            if record is not None:
                records.append(record)
        if ev.source_id:
            records += [
                r for r in await self.reg.documents.list(f"{ev.org_id}.")
                if r.source_id == ev.source_id
            ]
        for record in records:
            # Remove vectors first: the record is what embed checks membership against.
            record.revision += 1
            lost = record.kb_ids
            record.kb_ids = []
            record.tags = []
            await self.reg.documents.put(record.key, record)
            await self._announce(record, [], lost)
            await self.reg.documents.delete(record.key)
            await self.reg.texts.delete(record.text_object)
            await self.reg.texts.delete(f"{record.org_id}/{record.document_id}/original")
        return records

    # ---- knowledge bases ------------------------------------------------------------------

    async def kb_changed(self, ev: KbChanged) -> None:
        """Backfill or remove documents when a KB is created, retagged, reconfigured."""
        kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
        documents = await self.reg.documents.list(f"{ev.org_id}.")
        for record in documents:
            if record.status != DocStatus.ready:
                continue
            member = kb is not None and ev.change != "deleted" and kb.matches(record.tags)
            was = ev.kb_id in record.kb_ids
            if member == was and ev.change not in ("settings", "reindex", "retry_failed"):
                continue
            if member != was:
                record.kb_ids = sorted(
                    {*record.kb_ids, ev.kb_id} if member else set(record.kb_ids) - {ev.kb_id}
                )
                await self.reg.documents.put(record.key, record)
            # Fresh event ids: a KB change moves documents without bumping their revision, so
            # a document can leave, rejoin and leave a KB at one revision; ids derived from
            # the revision would make JetStream drop the second removal as a duplicate.
            if member:
                await self._index(record, ev.kb_id, dedupe=False)
            elif was:
                await self._remove(record, ev.kb_id, dedupe=False)

    # ---- helpers --------------------------------------------------------------------------

    async def _apply_membership(self, record: DocumentRecord) -> DocumentRecord:
        kbs = await self.reg.kbs.list(f"{record.org_id}.")
        members = sorted(kb.kb_id for kb in kbs if kb.matches(record.tags))
        lost = sorted(set(record.kb_ids) - set(members))
        record.kb_ids = members
        record.updated_at = utcnow()
        await self.reg.documents.put(record.key, record)
        await self._announce(record, members, lost)
        log.info(
            "document org_id=%s document_id=%s revision=%d kbs=%s removed=%s",
            record.org_id, record.document_id, record.revision, members, lost,
        )
        return record

    async def _announce(
        self, record: DocumentRecord, members: list[str], lost: list[str]
    ) -> None:
        for kb_id in members:
            await self._index(record, kb_id)
        for kb_id in lost:
            await self._remove(record, kb_id)

    async def _index(self, record: DocumentRecord, kb_id: str, *, dedupe: bool = True) -> None:
        event = KbIndex(
            org_id=record.org_id, kb_id=kb_id, document_id=record.document_id,
            revision=record.revision,
        )
        if dedupe:
            event.event_id = _event_id("i", record, kb_id)
        await self.publish(Subject.KB_INDEX, event)

    async def _remove(self, record: DocumentRecord, kb_id: str, *, dedupe: bool = True) -> None:
        event = KbRemove(
            org_id=record.org_id, kb_id=kb_id, document_id=record.document_id,
            revision=record.revision,
        )
        if dedupe:
            event.event_id = _event_id("r", record, kb_id)
        await self.publish(Subject.KB_REMOVE, event)

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


def _derived_id(event_id: str) -> str:
    """Upstream uploads without an id get one derived from the event, so a redelivery
    names the same document."""
    return check_id(event_id[:32].replace(".", "-"), "document_id") if event_id else new_id()


def _event_id(kind: str, record: DocumentRecord, kb_id: str) -> str:
    # Deterministic: a redelivered upload republishes the same ids, and JetStream drops them.
    return f"{kind}-{kb_id}-{record.document_id}-{record.revision}"
