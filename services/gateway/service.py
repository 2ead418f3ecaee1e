"""Gateway logic shared by REST and MCP: validation, publishing, registry reads, waiting.

It never writes vectors: documents change through events to ingest; KB definitions are
written here (the gateway owns the KB API) and announced with `kb.changed`."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from services.common.bus import Bus
from services.common.content import STAGING_PREFIX, decode_content, is_supported, normalise_mime
from services.common.embedders import model_limits
from services.common.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    Transient,
    error_class,
)
from services.common.events import (
    DocDeleted,
    DocFailed,
    DocIndexed,
    DocUploaded,
    KbChanged,
    Subject,
    TagsChanged,
)
from services.common.models import (
    COLLECTION_PREFIX,
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KBStatus,
    KnowledgeBase,
    check_id,
    join_tags,
    new_id,
    split_tags,
    utcnow,
)
from services.common.queries import (
    ChunkRequest,
    ChunkResponse,
    RemoteError,
    SearchQuery,
    SearchRequest,
    SearchResponse,
)
from services.common.registry import Registries
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.progress import kb_progress
from services.gateway.schemas import (
    Ack,
    DeleteResult,
    DocumentPatch,
    DocumentView,
    KbCreate,
    KbDocumentView,
    KbList,
    KbProgress,
    KbStats,
    KbUpdate,
    KbView,
    Page,
    UploadBody,
    UploadResult,
)
from services.gateway.waiter import IndexWaiter

# Derives other orgs' default KB ids (see `GatewayService.default_kb_id`).
DEFAULT_KB_NAMESPACE = uuid.UUID("0b3f6c52-2d7e-4f0a-9a43-5c1e8d7b6a29")
KB_CAS_ATTEMPTS = 20
PATCH_ATTEMPTS = 10
REINDEX_FIELDS = ("chunker", "chunk_size", "chunk_overlap", "embedding_model", "api_base")
POLL_SECONDS = 0.05


class GatewayService:
    def __init__(
        self, bus: Bus, registries: Registries, settings: Settings, waiter: IndexWaiter
    ) -> None:
        self.bus = bus
        self.reg = registries
        self.settings = settings
        self.waiter = waiter

    # ---- knowledge bases ------------------------------------------------------------------

    def default_kb_id(self, org_id: str) -> str:
        """The id of an org's default KB. KB ids must be unique across orgs: collections,
        index entries and point ids are keyed by KB id alone, so a default KB shared by id
        would let one org overwrite, count or drop another's vectors. The configured
        default org keeps the plain name as id; every other org gets one derived from it."""
        if org_id == self.settings.default_org:
            return self.settings.default_kb
        return uuid.uuid5(DEFAULT_KB_NAMESPACE, f"{org_id}/{self.settings.default_kb}").hex

    async def ensure_default_kb(self, org_id: str) -> KnowledgeBase:
        key = f"{org_id}.{self.default_kb_id(org_id)}"
        kb = await self.reg.kbs.get(key)
        if kb is not None:
            return kb
        kb = KnowledgeBase(
            org_id=org_id,
            kb_id=self.default_kb_id(org_id),
            name=self.settings.default_kb,
            description="Created on first start.",
            embedding_model=self.settings.default_model,
        )
        try:
            await self.reg.kbs.create(key, kb)
        except Conflict:
            return await self.reg.kbs.get(key) or kb
        await self.bus.publish(
            Subject.KB_CHANGED, KbChanged(org_id=org_id, kb_id=kb.kb_id, change="created")
        )
        return kb

    async def resolve_kb(self, p: Principal, ref: str, *, write: bool = False) -> KnowledgeBase:
        """A KB id or name, within the caller's org and scope (else 404)."""
        kb = await self.reg.kbs.get(f"{p.org_id}.{ref}") if _key_safe(ref) else None
        if kb is None:
            kb = next((k for k in await self.reg.kbs.list(f"{p.org_id}.") if k.name == ref), None)
        if kb is None and ref == self.settings.default_kb:
            kb = await self.ensure_default_kb(p.org_id)
        if kb is None or not p.can_see(kb.kb_id):
            raise NotFound(f"knowledge base {ref!r} not found", field="kb_id")
        p.check_kb(kb.kb_id, write=write)
        return kb

    async def create_kb(self, p: Principal, body: KbCreate) -> KbView:
        p.check_org_wide_write()
        existing = await self.reg.kbs.list(f"{p.org_id}.")
        if len(existing) >= self.settings.kb_limit:
            raise Conflict(
                f"this org already has {self.settings.kb_limit} knowledge bases (KBMESH_KB_LIMIT)"
            )
        if any(k.name == body.name for k in existing):
            raise Conflict(f"a knowledge base named {body.name!r} exists", field="name")
        fields = body.model_dump(exclude_none=True)
        fields.setdefault("embedding_model", self.settings.default_model)
        kb = KnowledgeBase(org_id=p.org_id, kb_id=new_id(), **fields)
        await asyncio.to_thread(validate_kb, kb)
        await self.reg.kbs.create(f"{p.org_id}.{kb.kb_id}", kb)
        await self.bus.publish(
            Subject.KB_CHANGED, KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="created")
        )
        return await self.kb_view(kb)

    async def list_kbs(
        self, p: Principal, skip: int = 0, limit: int = 50, name_search: str | None = None
    ) -> KbList:
        kbs = [k for k in await self.reg.kbs.list(f"{p.org_id}.") if p.can_see(k.kb_id)]
        if name_search:
            kbs = [k for k in kbs if name_search.lower() in k.name.lower()]
        kbs.sort(key=lambda k: k.created_at)
        page = kbs[skip : skip + limit]
        views = await asyncio.gather(*(self.kb_view(k) for k in page))
        return KbList(items=list(views), total=len(kbs), skip=skip, limit=limit)

    async def get_kb(self, p: Principal, ref: str) -> KbView:
        return await self.kb_view(await self.resolve_kb(p, ref))

    async def update_kb(self, p: Principal, ref: str, body: KbUpdate) -> KbView:
        kb = await self.resolve_kb(p, ref, write=True)
        changes = body.model_dump(exclude_unset=True)
        if "name" in changes and changes["name"] is None:
            raise InvalidInput("name cannot be null", field="name")
        if changes.get("name") and changes["name"] != kb.name:
            others = await self.reg.kbs.list(f"{p.org_id}.")
            if any(k.name == changes["name"] for k in others):
                raise Conflict(f"a knowledge base named {changes['name']!r} exists", field="name")
        update = {k: v for k, v in changes.items() if v is not None or k == "api_base"}
        indexed = bool(await self.reg.index.list(f"{kb.kb_id}."))

        def apply(current: KnowledgeBase) -> KnowledgeBase:
            updated = current.model_copy(update=update)
            validate_kb(updated)
            if any(getattr(updated, f) != getattr(current, f) for f in REINDEX_FIELDS):
                updated.settings_version = current.settings_version + 1
                updated.status = KBStatus.pending_reindex
                if indexed:
                    # Built into a new collection: the current one keeps answering searches,
                    # with its own model and chunks, until embed has built the new one (or
                    # the rebuild is cancelled).
                    updated.rebuild_from(current)
                elif (updated.embedding_model, updated.api_base) != (
                    current.embedding_model,
                    current.api_base,
                ):
                    # Other vectors (maybe another dimension) need another collection.
                    updated.generations = max(current.generations, current.index_generation) + 1
                    updated.index_generation = updated.generations
            updated.updated_at = utcnow()
            return updated

        # Off the loop: the first remote model lookup imports litellm (seconds).
        await asyncio.to_thread(apply, kb)
        old, updated = await self._change_kb(p.org_id, kb.kb_id, apply)
        if set(updated.tag_ids) != set(old.tag_ids):
            await self.bus.publish(
                Subject.KB_CHANGED,
                KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="tags", old_tag_ids=old.tag_ids),
            )
        if updated.settings_version != old.settings_version:
            await self.bus.publish(
                Subject.KB_CHANGED, KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="settings")
            )
        return await self.kb_view(updated)

    async def _change_kb(
        self, org_id: str, kb_id: str, apply: Any
    ) -> tuple[KnowledgeBase, KnowledgeBase]:
        """Compare-and-set a KB definition: `apply(current) -> updated` runs again on the
        newest version when another request changed the KB meanwhile, so concurrent updates
        each count (every settings change gets its own settings version)."""
        key = f"{org_id}.{kb_id}"
        for _ in range(KB_CAS_ATTEMPTS):
            found = await self.reg.kbs.get_versioned(key)
            if found is None:
                raise NotFound(f"knowledge base {kb_id!r} not found", field="kb_id")
            current, last = found
            updated = apply(current.model_copy(deep=True))
            try:
                await self.reg.kbs.update(key, updated, last)
            except Conflict:
                continue
            return current, updated
        raise Transient("the knowledge base is being changed concurrently; try again")

    async def delete_kb(self, p: Principal, ref: str) -> Ack:
        kb = await self.resolve_kb(p, ref, write=True)
        await self.reg.kbs.delete(f"{p.org_id}.{kb.kb_id}")
        last = max(kb.generations, kb.index_generation)
        collections = [kb.collection_for(g) for g in range(1, last + 1)]
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="deleted", collections=collections),
        )
        return Ack(status="deleted", kb_id=kb.kb_id)

    async def reindex_kb(self, p: Principal, ref: str, *, failed_only: bool = False) -> Ack:
        kb = await self.resolve_kb(p, ref, write=True)
        if not failed_only:
            indexed = bool(await self.reg.index.list(f"{kb.kb_id}."))

            def bump(current: KnowledgeBase) -> KnowledgeBase:
                updated = current.model_copy(deep=True)
                updated.settings_version += 1
                updated.status = KBStatus.pending_reindex
                updated.updated_at = utcnow()
                if indexed:
                    updated.rebuild_from(current)
                return updated

            _, kb = await self._change_kb(p.org_id, kb.kb_id, bump)
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(
                org_id=p.org_id, kb_id=kb.kb_id, change="retry_failed" if failed_only else "reindex"
            ),
        )
        members = [d for d in await self.reg.documents.list(f"{p.org_id}.") if kb.matches(d.tags)]
        return Ack(status="reindexing", kb_id=kb.kb_id, documents=len(members))

    async def cancel_reindex(self, p: Principal, ref: str) -> Ack:
        """Abandon the rebuild in progress: searches keep reading the collection they read,
        the half-built one is dropped, and the KB's settings return to that collection's."""
        kb = await self.resolve_kb(p, ref, write=True)
        abandoned: list[str] = []

        def cancel(current: KnowledgeBase) -> KnowledgeBase:
            abandoned.clear()
            if current.serving is None:
                raise Conflict(f"knowledge base {ref!r} has no reindex running", field="kb_id")
            abandoned.extend([*current.abandoned_collections, current.collection_name])
            current.cancel_rebuild()
            current.updated_at = utcnow()
            return current

        _, kb = await self._change_kb(p.org_id, kb.kb_id, cancel)
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="cancelled", collections=abandoned),
        )
        return Ack(status="cancelled", kb_id=kb.kb_id)

    async def kb_progress(self, kb: KnowledgeBase) -> KbProgress:
        return kb_progress(kb, *await self._kb_state(kb))

    async def kb_stats(self, p: Principal, ref: str) -> KbStats:
        kb = await self.resolve_kb(p, ref)
        entries, members = await self._kb_state(kb)
        failed = [d for d in members if d.status == DocStatus.failed or kb.kb_id in d.kb_errors]
        current = {e.document_id for e in entries if e.settings_version == kb.settings_version}
        pending = [
            d
            for d in members
            if d.status == DocStatus.ready
            and d.document_id not in current
            and kb.kb_id not in d.kb_errors
        ]
        return KbStats(
            kb_id=kb.kb_id,
            document_count=len(entries),
            chunk_count=sum(e.chunk_count for e in entries),
            total_documents_with_tags=len(members),
            failed_count=len(failed),
            pending_count=len(pending),
            progress=kb_progress(kb, entries, members),
        )

    async def kb_documents(
        self,
        p: Principal,
        ref: str,
        skip: int = 0,
        limit: int = 50,
        name_search: str | None = None,
    ) -> Page[KbDocumentView]:
        kb = await self.resolve_kb(p, ref)
        entries, members = await self._kb_state(kb)
        by_doc = {e.document_id: e for e in entries}
        if name_search:
            members = [d for d in members if name_search.lower() in d.name.lower()]
        members.sort(key=lambda d: d.created_at)
        items = [
            KbDocumentView(
                document_id=d.document_id,
                name=d.name,
                source_id=d.source_id,
                status=_kb_doc_status(d, by_doc.get(d.document_id), kb),
                chunk_count=by_doc[d.document_id].chunk_count if d.document_id in by_doc else 0,
                indexed_at=by_doc[d.document_id].indexed_at if d.document_id in by_doc else None,
                revision=d.revision,
            )
            for d in members[skip : skip + limit]
        ]
        return Page[KbDocumentView](items=items, total=len(members), skip=skip, limit=limit)

    async def kb_view(self, kb: KnowledgeBase) -> KbView:
        entries, members = await self._kb_state(kb)
        status = kb.status
        behind = [e for e in entries if e.settings_version != kb.settings_version]
        ready = [d for d in members if d.status == DocStatus.ready]
        # The stored status only records that a reindex was asked for; what is left to do
        # is read from the index entries.
        if status == KBStatus.pending_reindex and not behind:
            status = KBStatus.active
        if status == KBStatus.active and len(entries) < len(ready):
            status = KBStatus.indexing
        return KbView(
            **kb.model_dump(exclude={"org_id", "status"}),
            status=status,
            document_count=len(entries),
            chunk_count=sum(e.chunk_count for e in entries),
        )

    async def _kb_state(self, kb: KnowledgeBase) -> tuple[list[IndexEntry], list[DocumentRecord]]:
        entries, documents = await asyncio.gather(
            self.reg.index.list(f"{kb.kb_id}."), self.reg.documents.list(f"{kb.org_id}.")
        )
        return entries, [d for d in documents if kb.matches(d.tags)]

    # ---- documents ------------------------------------------------------------------------

    async def upload(
        self, p: Principal, body: UploadBody, kb_ref: str | None = None, *, wait: bool = False
    ) -> UploadResult:
        kb_ref = kb_ref or body.kb_id
        kb = await self.resolve_kb(p, kb_ref, write=True) if kb_ref else None
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
        async with self.waiter.watch([document_id]) as events:
            await self.bus.publish(Subject.DOC_UPLOADED, event)
            return await self._await_upload(event, events, kb, result)

    async def _await_upload(
        self,
        event: DocUploaded,
        events: asyncio.Queue[Any],
        kb: KnowledgeBase | None,
        result: UploadResult,
    ) -> UploadResult:
        deadline = time.monotonic() + self.settings.wait_timeout_seconds
        key = f"{event.org_id}.{event.document_id}"
        record: DocumentRecord | None = None
        while time.monotonic() < deadline:
            failed = _drain_failure(events, event.org_id, stage="ingest")
            if failed is not None:
                return result.model_copy(update={"status": "failed", "error": failed.error})
            record = await self.reg.documents.get(key)
            if record is not None and record.last_event_id == event.event_id:
                break
            await asyncio.sleep(POLL_SECONDS)
        else:
            return result
        if record is None:  # pragma: no cover - the loop breaks only with a record
            return result
        result.revision = record.revision
        result.kb_ids = record.kb_ids
        if record.status == DocStatus.awaiting_ocr:
            return result.model_copy(update={"status": "awaiting_ocr"})
        if record.status == DocStatus.failed:
            return result.model_copy(update={"status": "failed", "error": record.error})
        if not record.kb_ids:
            return result.model_copy(update={"status": "stored", "chunk_count": 0})
        outcome = await self._await_kbs(
            events, event.org_id, set(record.kb_ids), set(), record.revision, deadline
        )
        if isinstance(outcome, DocFailed):
            return result.model_copy(update={"status": "failed", "error": outcome.error})
        if outcome is None:
            return result
        counts = outcome
        chunk_count = counts.get(kb.kb_id, 0) if kb else sum(counts.values())
        return result.model_copy(update={"status": "complete", "chunk_count": chunk_count})

    async def _await_kbs(
        self,
        events: asyncio.Queue[Any],
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

    async def get_document(self, p: Principal, document_id: str) -> DocumentView:
        record = await self._document(p, document_id)
        return await self._document_view(record)

    async def list_documents(
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
            kb_obj = await self.resolve_kb(p, kb)
            records = [r for r in records if kb_obj.matches(r.tags)]
        records = [r for r in records if self._visible(p, r)]
        if tag:
            records = [r for r in records if tag in r.tags]
        if collection:
            records = [r for r in records if split_tags(r.tags)[1] == collection]
        if source_id:
            records = [r for r in records if r.source_id == source_id]
        if name_search:
            records = [r for r in records if name_search.lower() in r.name.lower()]
        records.sort(key=lambda r: r.created_at)
        views = await asyncio.gather(
            *(self._document_view(r) for r in records[skip : skip + limit])
        )
        return Page[DocumentView](items=list(views), total=len(records), skip=skip, limit=limit)

    async def patch_document(
        self, p: Principal, document_id: str, patch: DocumentPatch, *, wait: bool = True
    ) -> DocumentView:
        """Set tags, collection and/or metadata. The change is sent as the next revision of
        the record read here; if another change took that revision first, ingest drops ours
        as stale, so with `wait` it is applied again on the newer record (what the caller
        asked to set is set, whatever happened meanwhile)."""
        record = await self._document(p, document_id)
        self._check_doc_write(p, record)
        deadline = time.monotonic() + self.settings.wait_timeout_seconds
        for _ in range(PATCH_ATTEMPTS):
            visible, collection = split_tags(record.tags)
            if patch.tags is not None:
                # Implicit KB tags stay: they are membership, not labels the caller manages.
                visible = [t for t in visible if t.startswith("kb:")] + patch.tags
            if patch.clear_collection:
                collection = None
            elif patch.collection is not None:
                collection = patch.collection
            _check_labels(visible, collection)
            tags = join_tags(visible, collection)
            await self._check_tag_scope(p, tags)
            metadata = patch.metadata if patch.metadata is not None else record.metadata
            if tags == record.tags and metadata == record.metadata:
                return await self._document_view(record)
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
                return await self._document_view(record)
            async with self.waiter.watch([document_id]) as events:
                await self.bus.publish(Subject.TAGS_CHANGED, event)
                updated = await self._await_record(
                    record.key, lambda r, rev=revision: r.revision >= rev, deadline
                )
                if updated is None:
                    break  # timed out, or deleted meanwhile
                if updated.last_event_id != event.event_id and not _patched(patch, updated):
                    record = updated  # ours was dropped as stale: again, on the newer record
                    self._check_doc_write(p, record)
                    continue
                if updated.status == DocStatus.ready:
                    lost = set(record.kb_ids) - set(updated.kb_ids)
                    await self._await_kbs(
                        events, p.org_id, set(updated.kb_ids), lost, updated.revision, deadline
                    )
                break
        else:
            raise Conflict(
                f"document {document_id!r} keeps changing; try again", field="document_id"
            )
        return await self.get_document(p, document_id)

    async def delete_document(
        self, p: Principal, document_id: str, *, wait: bool = True
    ) -> DeleteResult:
        if not document_id.strip():
            raise InvalidInput("document_id must not be empty", field="document_id")
        try:
            record = await self._document(p, document_id)
        except NotFound:
            return DeleteResult(status="not_found", deleted_count=0, document_id=document_id)
        self._check_doc_write(p, record)
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
            if r.source_id == source_id and self._visible(p, r)
        ]
        for record in records:
            self._check_doc_write(p, record)
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
            if r.uri == uri and self._visible(p, r):
                return r
        return None

    async def _delete(
        self, records: list[DocumentRecord], event: DocDeleted, *, wait: bool
    ) -> None:
        if not wait:
            await self.bus.publish(Subject.DOC_DELETED, event)
            return
        ids = [r.document_id for r in records]
        async with self.waiter.watch(ids) as events:
            await self.bus.publish(Subject.DOC_DELETED, event)
            deadline = time.monotonic() + self.settings.wait_timeout_seconds
            # Each document reports one removal per KB it was in.
            expected = sum(len(r.kb_ids) for r in records)
            seen: set[tuple[str, str]] = set()
            while len(seen) < expected and time.monotonic() < deadline:
                try:
                    ev = await asyncio.wait_for(events.get(), deadline - time.monotonic())
                except TimeoutError:
                    break
                if isinstance(ev, DocIndexed) and ev.removed and ev.org_id == event.org_id:
                    seen.add((ev.document_id, ev.kb_id))
            for r in records:
                await self._await_record(r.key, None, deadline)

    async def _await_record(
        self, key: str, predicate: Any, deadline: float
    ) -> DocumentRecord | None:
        """Poll the registry until the record satisfies predicate (None: until it is gone)."""
        while time.monotonic() < deadline:
            record = await self.reg.documents.get(key)
            if predicate is None and record is None:
                return None
            if predicate is not None and record is not None and predicate(record):
                return record
            await asyncio.sleep(POLL_SECONDS)
        return None

    async def _document(self, p: Principal, document_id: str) -> DocumentRecord:
        record = (
            await self.reg.documents.get(f"{p.org_id}.{document_id}")
            if _key_safe(document_id)
            else None
        )
        if record is None or not self._visible(p, record):
            raise NotFound(f"document {document_id!r} not found", field="document_id")
        return record

    async def _check_tag_scope(self, p: Principal, tags: list[str]) -> None:
        """Tags are membership: a KB-scoped key cannot tag a document into a KB outside its
        scope (and is not told which one)."""
        if p.kb_ids is None or not tags:
            return
        for kb in await self.reg.kbs.list(f"{p.org_id}."):
            if not p.can_see(kb.kb_id) and kb.matches(tags):
                raise Forbidden(
                    "these tags would add the document to a knowledge base outside "
                    "this API key's scope",
                    field="tags",
                )

    def _visible(self, p: Principal, record: DocumentRecord) -> bool:
        return (
            p.kb_ids is None
            or bool(set(p.kb_ids) & set(record.kb_ids))
            or any(f"kb:{k}" in record.tags for k in p.kb_ids)
        )

    def _check_doc_write(self, p: Principal, record: DocumentRecord) -> None:
        p.check_write()
        if p.kb_ids is not None and not set(record.kb_ids) <= set(p.kb_ids):
            raise NotFound(f"document {record.document_id!r} not found", field="document_id")

    async def _document_view(self, record: DocumentRecord) -> DocumentView:
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

    # ---- search ---------------------------------------------------------------------------

    async def search(self, p: Principal, query: SearchQuery) -> SearchResponse:
        if query.kb_ids:
            # Names and ids, checked against scope here so errors name what was asked for.
            kbs = [await self.resolve_kb(p, ref) for ref in query.kb_ids]
            query = query.model_copy(update={"kb_ids": [k.kb_id for k in kbs]})
        request = SearchRequest(**query.model_dump(), org_id=p.org_id, scope_kb_ids=p.scope)
        body = await self._request(Subject.SEARCH_QUERY, request)
        return SearchResponse.model_validate(body)

    async def get_chunk(
        self, p: Principal, chunk_id: str, kb: str | None = None, neighbors: int = 0
    ) -> ChunkResponse:
        kb_id = (await self.resolve_kb(p, kb)).kb_id if kb else None
        request = ChunkRequest(
            org_id=p.org_id,
            chunk_id=chunk_id,
            kb_id=kb_id,
            neighbors=neighbors,
            scope_kb_ids=p.scope,
        )
        return ChunkResponse.model_validate(await self._request(Subject.SEARCH_CHUNK, request))

    async def _request(self, subject: str, request: Any) -> dict[str, Any]:
        try:
            reply = await self.bus.request(
                subject, request, timeout=self.settings.search.timeout_seconds
            )
        except TimeoutError as err:
            raise Transient("search service did not answer in time") from err
        except Exception as err:
            if "no responders" in str(err).lower() or type(err).__name__ == "NoRespondersError":
                raise Transient("no search service is running") from err
            raise
        if "error" in reply:
            error = RemoteError.model_validate(reply["error"])
            raise error_class(error.error_type)(error.message, field=error.field)
        result: dict[str, Any] = reply["result"]
        return result


def validate_kb(kb: KnowledgeBase) -> None:
    """Cross-field KB rules (single-field ranges are on the request model)."""
    if kb.embedding_model.startswith("local/") and kb.embedding_model != ("local/all-MiniLM-L6-v2"):
        raise InvalidInput(
            f"embedding_model {kb.embedding_model!r}: the only bundled local model is "
            "local/all-MiniLM-L6-v2; use a LiteLLM model id for others",
            field="embedding_model",
        )
    limit = model_limits(kb.embedding_model)
    if limit is not None and kb.chunk_size > limit:
        raise InvalidInput(
            f"chunk_size {kb.chunk_size} exceeds the input limit of {kb.embedding_model} "
            f"({limit} tokens)",
            field="chunk_size",
        )
    if not 50 <= kb.chunk_size <= 2000:
        raise InvalidInput("chunk_size must be between 50 and 2000 tokens", field="chunk_size")
    if not 0 <= kb.chunk_overlap < kb.chunk_size:
        raise InvalidInput(
            f"chunk_overlap must be >= 0 and smaller than chunk_size ({kb.chunk_size})",
            field="chunk_overlap",
        )
    if not 0 <= kb.coalesce_neighbors <= 5:
        raise InvalidInput("coalesce_neighbors must be between 0 and 5", field="coalesce_neighbors")
    for tag in kb.tag_ids:
        if not tag or tag.startswith(COLLECTION_PREFIX):
            raise InvalidInput(f"tag_ids: invalid tag {tag!r}", field="tag_ids")


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
    visible, collection = split_tags(record.tags)
    if patch.tags is not None:
        labels = {t for t in visible if not t.startswith("kb:")}
        wanted = set(patch.tags)
        if labels != {t for t in wanted if not t.startswith("kb:")} or not wanted <= set(visible):
            return False
    if patch.clear_collection and collection is not None:
        return False
    if not patch.clear_collection and patch.collection not in (None, collection):
        return False
    return patch.metadata is None or record.metadata == patch.metadata


def _drain_failure(events: asyncio.Queue[Any], org_id: str, stage: str) -> DocFailed | None:
    pending: list[Any] = []
    failure = None
    while not events.empty():
        ev = events.get_nowait()
        if (
            isinstance(ev, DocFailed)
            and ev.stage == stage
            and ev.org_id == org_id
            and failure is None
        ):
            failure = ev
        else:
            pending.append(ev)
    for ev in pending:
        events.put_nowait(ev)
    return failure


def _kb_doc_status(record: DocumentRecord, entry: IndexEntry | None, kb: KnowledgeBase) -> str:
    if record.status != DocStatus.ready:
        return record.status.value
    if kb.kb_id in record.kb_errors:
        return "failed"
    if entry is None or entry.revision < record.revision:
        return "processing"
    return "complete" if entry.settings_version == kb.settings_version else "pending_reindex"


def _key_safe(value: str) -> bool:
    try:
        check_id(value, "id")
    except InvalidInput:
        return False
    return True
