"""Documents: uploads, reads, tag/collection/metadata changes and deletes. Documents change
only through events to ingest; with `wait`, a call returns once the index reflects it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.bus import Bus
from services.common.content import STAGING_PREFIX, decode_content, is_supported, normalise_mime
from services.common.errors import Conflict, InvalidInput, NotFound
from services.common.events import DocDeleted, DocFailed, DocUploaded, Subject, TagsChanged
from services.common.models import (
    COLLECTION_PREFIX,
    DocStatus,
    DocumentRecord,
    KnowledgeBase,
    join_tags,
    new_id,
    split_tags,
)
from services.common.registry import Registries
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.schemas import (
    DeleteResult,
    DocumentPatch,
    DocumentView,
    Page,
    UploadBody,
    UploadResult,
)
from services.gateway.service.access import (
    check_document_write,
    check_tag_scope,
    key_safe,
    visible,
)
from services.gateway.service.kbs import KnowledgeBases
from services.gateway.service.waiting import Events, Waiting

PATCH_ATTEMPTS = 10


class Documents:
    def __init__(
        self,
        bus: Bus,
        registries: Registries,
        settings: Settings,
        kbs: KnowledgeBases,
        waiting: Waiting,
    ) -> None:
        self.bus = bus
        self.reg = registries
        self.settings = settings
        self.kbs = kbs
        self.waiting = waiting

    async def upload(
        self, p: Principal, body: UploadBody, kb_ref: str | None = None, *, wait: bool = False
    ) -> UploadResult:
        kb_ref = kb_ref or body.kb_id
        kb = await self.kbs.resolve(p, kb_ref, write=True) if kb_ref else None
        if kb is None:
            p.check_org_wide_write()
        mime = normalise_mime(body.mime_type, body.name)
        if not is_supported(mime):
            raise InvalidInput(f"unsupported mime_type {mime!r}", field="mime_type")
        data = decode_content(body.content, body.content_encoding, self.settings.max_content_bytes)
        _check_labels(body.tags, body.collection)
        await self._check_tag_scope(p, body.tags)
        document_id = body.document_id or new_id()
        event = DocUploaded(
            org_id=p.org_id,
            document_id=document_id,
            name=body.name,
            mime_type=mime,
            source_id=body.source_id,
            uri=body.uri,
            tags=body.tags,
            collection=body.collection,
            metadata=body.metadata,
            kb_id=kb.kb_id if kb else None,
        )
        if len(data) <= self.settings.inline_content_bytes:
            event.content, event.content_encoding = body.content, body.content_encoding
        else:
            event.object_ref = f"{STAGING_PREFIX}{event.event_id}"
            await self.reg.texts.put(event.object_ref, data)
        result = UploadResult(document_id=document_id, name=body.name, status="processing")
        if not wait:
            await self.bus.publish(Subject.DOC_UPLOADED, event)
            return result
        async with self.waiting.watch([document_id]) as events:
            await self.bus.publish(Subject.DOC_UPLOADED, event)
            return await self._await_upload(event, events, kb, result)

    async def _await_upload(
        self,
        event: DocUploaded,
        events: Events,
        kb: KnowledgeBase | None,
        result: UploadResult,
    ) -> UploadResult:
        deadline = self.waiting.deadline()
        found = await self.waiting.record(
            f"{event.org_id}.{event.document_id}",
            lambda r: r.last_event_id == event.event_id,
            deadline,
            events,
            event.org_id,
        )
        if isinstance(found, DocFailed):
            return result.model_copy(update={"status": "failed", "error": found.error})
        if found is None:
            return result
        record = found
        result.revision = record.revision
        result.kb_ids = record.kb_ids
        if record.status == DocStatus.awaiting_ocr:
            return result.model_copy(update={"status": "awaiting_ocr"})
        if record.status == DocStatus.failed:
            return result.model_copy(update={"status": "failed", "error": record.error})
        if not record.kb_ids:
            return result.model_copy(update={"status": "stored", "chunk_count": 0})
        outcome = await self.waiting.indexed(
            events, event.org_id, set(record.kb_ids), set(), record.revision, deadline
        )
        if isinstance(outcome, DocFailed):
            return result.model_copy(update={"status": "failed", "error": outcome.error})
        if outcome is None:
            return result
        counts = outcome
        chunk_count = counts.get(kb.kb_id, 0) if kb else sum(counts.values())
        return result.model_copy(update={"status": "complete", "chunk_count": chunk_count})

    async def get(self, p: Principal, document_id: str) -> DocumentView:
        record = await self._record(p, document_id)
        return await self._view(record)

    async def page(
        self,
        p: Principal,
        *,
        kb: str | None = None,
        tag: str | None = None,
        collection: str | None = None,
        source_id: str | None = None,
        name_search: str | None = None,
        skip: int = 0,
        limit: int = 50,
    ) -> Page[DocumentView]:
        records = await self.reg.documents.list(f"{p.org_id}.")
        if kb:
            kb_obj = await self.kbs.resolve(p, kb)
            records = [r for r in records if kb_obj.matches(r.tags)]
        records = [r for r in records if visible(p, r)]
        if tag:
            records = [r for r in records if tag in r.tags]
        if collection:
            records = [r for r in records if split_tags(r.tags)[1] == collection]
        if source_id:
            records = [r for r in records if r.source_id == source_id]
        if name_search:
            records = [r for r in records if name_search.lower() in r.name.lower()]
        records.sort(key=lambda r: r.created_at)
        views = await asyncio.gather(*(self._view(r) for r in records[skip : skip + limit]))
        return Page[DocumentView](items=list(views), total=len(records), skip=skip, limit=limit)

    async def patch(
        self, p: Principal, document_id: str, patch: DocumentPatch, *, wait: bool = True
    ) -> DocumentView:
        """Set tags, collection and/or metadata. The change is sent as the next revision of
        the record read here; if another change took that revision first, ingest drops ours
        as stale, so with `wait` it is applied again on the newer record (what the caller
        asked to set is set, whatever happened meanwhile)."""
        record = await self._record(p, document_id)
        check_document_write(p, record)
        deadline = self.waiting.deadline()
        for _ in range(PATCH_ATTEMPTS):
            visible_tags, collection = split_tags(record.tags)
            if patch.tags is not None:
                # Implicit KB tags stay: they are membership, not labels the caller manages.
                visible_tags = [t for t in visible_tags if t.startswith("kb:")] + patch.tags
            if patch.clear_collection:
                collection = None
            elif patch.collection is not None:
                collection = patch.collection
            _check_labels(visible_tags, collection)
            tags = join_tags(visible_tags, collection)
            await self._check_tag_scope(p, tags)
            metadata = patch.metadata if patch.metadata is not None else record.metadata
            if tags == record.tags and metadata == record.metadata:
                return await self._view(record)
            revision = record.revision + 1
            event = TagsChanged(
                org_id=p.org_id,
                document_id=document_id,
                tags=tags,
                metadata=patch.metadata,
                revision=revision,
            )
            if not wait:
                await self.bus.publish(Subject.TAGS_CHANGED, event)
                return await self._view(record)
            async with self.waiting.watch([document_id]) as events:
                await self.bus.publish(Subject.TAGS_CHANGED, event)
                updated = await self.waiting.record(record.key, _at_least(revision), deadline)
                if not isinstance(updated, DocumentRecord):
                    break  # timed out, or deleted meanwhile
                if updated.last_event_id != event.event_id and not _patched(patch, updated):
                    record = updated  # ours was dropped as stale: again, on the newer record
                    check_document_write(p, record)
                    continue
                if updated.status == DocStatus.ready:
                    lost = set(record.kb_ids) - set(updated.kb_ids)
                    await self.waiting.indexed(
                        events, p.org_id, set(updated.kb_ids), lost, updated.revision, deadline
                    )
                break
        else:
            raise Conflict(
                f"document {document_id!r} keeps changing; try again", field="document_id"
            )
        return await self.get(p, document_id)

    async def delete(self, p: Principal, document_id: str, *, wait: bool = True) -> DeleteResult:
        if not document_id.strip():
            raise InvalidInput("document_id must not be empty", field="document_id")
        try:
            record = await self._record(p, document_id)
        except NotFound:
            return DeleteResult(status="not_found", deleted_count=0, document_id=document_id)
        check_document_write(p, record)
        await self._delete(
            [record], DocDeleted(org_id=p.org_id, document_ids=[document_id]), wait=wait
        )
        return DeleteResult(
            status="deleted",
            deleted_count=1,
            document_id=document_id,
            title=record.name,
            document_ids=[document_id],
        )

    async def delete_source(
        self, p: Principal, source_id: str, *, wait: bool = True
    ) -> DeleteResult:
        if not source_id.strip():
            raise InvalidInput("source_id must not be empty", field="source_id")
        # Only what the caller can see: a scoped key never learns of documents outside it.
        records = [
            r
            for r in await self.reg.documents.list(f"{p.org_id}.")
            if r.source_id == source_id and visible(p, r)
        ]
        for record in records:
            check_document_write(p, record)
        if records:
            await self._delete(
                records,
                DocDeleted(org_id=p.org_id, document_ids=[r.document_id for r in records]),
                wait=wait,
            )
        return DeleteResult(
            status="deleted" if records else "not_found",
            deleted_count=len(records),
            document_ids=[r.document_id for r in records],
        )

    async def find_by_uri(self, p: Principal, uri: str) -> DocumentRecord | None:
        for r in await self.reg.documents.list(f"{p.org_id}."):
            if r.uri == uri and visible(p, r):
                return r
        return None

    async def _delete(
        self, records: list[DocumentRecord], event: DocDeleted, *, wait: bool
    ) -> None:
        if not wait:
            await self.bus.publish(Subject.DOC_DELETED, event)
            return
        async with self.waiting.watch([r.document_id for r in records]) as events:
            await self.bus.publish(Subject.DOC_DELETED, event)
            await self.waiting.removed(events, event.org_id, records, self.waiting.deadline())

    async def _record(self, p: Principal, document_id: str) -> DocumentRecord:
        record = (
            await self.reg.documents.get(f"{p.org_id}.{document_id}")
            if key_safe(document_id)
            else None
        )
        if record is None or not visible(p, record):
            raise NotFound(f"document {document_id!r} not found", field="document_id")
        return record

    async def _check_tag_scope(self, p: Principal, tags: list[str]) -> None:
        if p.kb_ids is not None and tags:
            check_tag_scope(p, await self.reg.kbs.list(f"{p.org_id}."), tags)

    async def _view(self, record: DocumentRecord) -> DocumentView:
        tags, collection = split_tags(record.tags)
        status = record.status.value
        if record.status == DocStatus.ready:
            entries = await asyncio.gather(
                *(self.reg.index.get(f"{k}.{record.document_id}") for k in record.kb_ids)
            )
            done = all(e is not None and e.revision >= record.revision for e in entries)
            status = "complete" if done else "processing"
            if record.kb_errors:
                status = "failed"
        return DocumentView(
            document_id=record.document_id,
            name=record.name,
            mime_type=record.mime_type,
            source_id=record.source_id,
            uri=record.uri,
            tags=tags,
            collection=collection,
            metadata=record.metadata,
            revision=record.revision,
            status=status,
            error=record.error
            or "; ".join(f"KB {k}: {why}" for k, why in sorted(record.kb_errors.items()))
            or None,
            kb_ids=record.kb_ids,
            size_bytes=record.size_bytes,
            content_checksum=record.content_checksum,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )


def _at_least(revision: int) -> Callable[[DocumentRecord], bool]:
    return lambda record: record.revision >= revision


def _check_labels(tags: list[str], collection: str | None) -> None:
    for tag in tags:
        if not tag.strip() or len(tag) > 200:
            raise InvalidInput(f"invalid tag {tag!r}: 1-200 characters", field="tags")
        if tag.startswith(COLLECTION_PREFIX):
            raise InvalidInput(
                "set collections with `collection`, not a 'collection:' tag", field="tags"
            )
    if collection is not None and (not collection.strip() or len(collection) > 200):
        raise InvalidInput("collection must be 1-200 characters", field="collection")


def _patched(patch: DocumentPatch, record: DocumentRecord) -> bool:
    """Whether `record` already has what `patch` sets (by this or another change)."""
    visible_tags, collection = split_tags(record.tags)
    if patch.tags is not None:
        labels = {t for t in visible_tags if not t.startswith("kb:")}
        wanted = set(patch.tags)
        if labels != {t for t in wanted if not t.startswith("kb:")} or not wanted <= set(
            visible_tags
        ):
            return False
    if patch.clear_collection and collection is not None:
        return False
    if not patch.clear_collection and patch.collection not in (None, collection):
        return False
    return patch.metadata is None or record.metadata == patch.metadata
