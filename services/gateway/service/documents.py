"""Documents: uploads, reads, tag/collection/metadata changes and deletes. Documents change
only through events to ingest; with `wait`, a call returns once the index reflects it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from services.common.bus.client import Bus
from services.common.bus.registry import Registries, compare_and_set
from services.common.domain.content import (
    HTML_TYPES,
    TEXT_TYPES,
    check_size,
    declared_mime,
    decode_content,
    is_supported,
    normalise_mime,
    staging_name,
)
from services.common.domain.errors import Conflict, InvalidInput, NotFound, Raced, error_class
from services.common.domain.ids import new_id
from services.common.domain.limits import check_document_fields, check_labels, check_metadata
from services.common.domain.models import (
    COLLECTION_PREFIX,
    DocStatus,
    DocumentRecord,
    KnowledgeBase,
    id_unavailable,
    join_tags,
    split_tags,
)
from services.common.messages.events import DocDeleted, DocFailed, DocUploaded, TagsChanged
from services.common.messages.names import Subject
from services.common.outbound.fetch import fetch_url
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.catalog import DocumentSummary
from services.gateway.fetch import read_path
from services.gateway.schemas import (
    MIME_TYPES,
    DeleteResult,
    DocumentPatch,
    DocumentView,
    FileFields,
    Page,
    UploadBody,
    UploadResult,
)
from services.gateway.service.access import (
    check_document_write,
    check_tag_scope,
    visible,
    visible_kb_ids,
    visible_tags,
)
from services.gateway.service.incoming import Incoming
from services.gateway.service.kbs import KnowledgeBases
from services.gateway.service.waiting import Events, Waiting

# A PATCH whose change is dropped as stale this many times in a row (the document keeps
# changing under it) answers 503: try again.
PATCH_ATTEMPTS = 10
# Uploads up to this size travel inside their event, larger ones through the `texts` object
# store; on a NATS server with a small message limit, up to a quarter of that limit (base64
# adds a third, and the event's other fields take their share).
INLINE_CONTENT_BYTES = 256 * 1024
# How long a PATCH without `wait` waits for ingest to apply (or drop) its change.
VERDICT_SECONDS = 10.0


# The type an event names when nobody said one: ingest reads it from the bytes and the name.
UNDECLARED = "application/octet-stream"


@dataclass(frozen=True)
class Content:
    """An upload's content as it came in, and what came with it. `body` is text (a JSON
    body's text content), bytes (base64 decoded at the entrance, a fetched URL, a server
    file) or a file that streamed in (`Incoming`); it keeps that form up to the event, which
    carries text inline and references everything else staged in the object store. `name`,
    `mime_type` and `uri` are the file's own (a form's filename and part type, the URL's);
    the upload's fields, when given, win over them. `field` names the content in errors."""

    body: str | bytes | Incoming
    name: str | None = None
    mime_type: str | None = None
    uri: str | None = None
    field: str = "content"


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
        self.catalog = kbs.catalog
        self.waiting = waiting

    async def upload(
        self, p: Principal, body: UploadBody, kb_ref: str | None = None, *, wait: bool = False
    ) -> UploadResult:
        """Add or replace a document. Its content comes in the body, or is fetched from
        `url` or read from `path`; with `replace_same_uri` a document with the same uri is
        replaced. With `wait`, returns once the index reflects it; content that cannot be
        read (e.g. a broken PDF) is then refused like any other invalid input."""
        # Resolved (and write access checked) first: a key that cannot write fetches nothing.
        kb = await self.target(p, kb_ref or body.kb_id)
        content = await self._content(body)
        return await self._upload(p, body, content, kb, wait=wait)

    async def upload_content(
        self,
        p: Principal,
        fields: FileFields,
        content: Content,
        kb_ref: str | None = None,
        *,
        wait: bool = False,
    ) -> UploadResult:
        """Add or replace a document whose content the caller already holds (a file that
        streamed in, content a tool decoded), as `upload` does."""
        kb = await self.target(p, kb_ref or fields.kb_id)
        return await self._upload(p, fields, content, kb, wait=wait)

    async def target(self, p: Principal, kb_ref: str | None) -> KnowledgeBase | None:
        """The KB an upload goes into (None: by its tags alone), once `p` may write there."""
        kb = await self.kbs.resolve(p, kb_ref, write=True) if kb_ref else None
        if kb is None:
            p.check_org_wide_write()
        return kb

    async def _upload(
        self,
        p: Principal,
        fields: UploadBody | FileFields,
        content: Content,
        kb: KnowledgeBase | None,
        *,
        wait: bool,
    ) -> UploadResult:
        name = fields.name or content.name
        if not name:
            raise InvalidInput("name is required: the document's title or file name", field="name")
        uri = fields.uri or content.uri
        mime = self._declared_type(fields.mime_type or content.mime_type, name, content.body)
        if mime is not None and not is_supported(mime):
            raise InvalidInput(
                f"unsupported mime_type {mime!r}; supported: {MIME_TYPES}", field="mime_type"
            )
        limit = self.settings.max_content_bytes
        body = content.body
        payload: bytes | BinaryIO
        if isinstance(body, Incoming):  # counted against the limit as it came in
            payload, size, blank = body.reader(), body.size, body.blank
        else:
            data = decode_content(body, "text", limit) if isinstance(body, str) else body
            check_size(len(data), limit)
            payload, size, blank = data, len(data), not data.strip()
        if blank:
            raise InvalidInput(
                "content has no text (it is empty or only whitespace)", field=content.field
            )
        check_document_fields(
            name=name,
            source_id=fields.source_id,
            uri=uri,
            tags=fields.tags,
            collection=fields.collection,
            metadata=fields.metadata,
            limits=self.settings.limits,
        )
        _check_label_prefixes(fields.tags)
        await self._check_tag_scope(p, fields.tags)
        document_id = fields.document_id
        if document_id is None and fields.replace_same_uri and uri:
            document_id = await self._same_uri(p, uri, kb)
        document_id = document_id or new_id()
        if fields.document_id:
            # Checked here for a quick answer; ingest checks again when it writes (the event
            # carries the scope), so a document moved meanwhile is safe too.
            existing = await self.reg.documents.get(f"{p.org_id}.{document_id}")
            if existing is not None and not existing.writable_in(p.scope):
                raise id_unavailable(document_id)
        event = DocUploaded(
            org_id=p.org_id,
            document_id=document_id,
            name=name,
            mime_type=mime or UNDECLARED,
            source_id=fields.source_id,
            uri=uri,
            tags=fields.tags,
            collection=fields.collection,
            metadata=fields.metadata,
            kb_id=kb.kb_id if kb else None,
            scope_kb_ids=p.scope,
            writer=p.writer,
        )
        if isinstance(body, str) and size <= self._inline_limit():
            event.content = body
        else:
            # Bytes, and text too large for one message, travel as one staged object.
            event.object_ref = staging_name(p.org_id, event.event_id)
            await self.reg.texts.put(event.object_ref, payload)
        result = UploadResult(
            document_id=document_id, name=name, status="processing", mime_type=mime
        )
        if not wait:
            await self._publish_upload(event)
            return result
        async with self.waiting.watch([document_id]) as events:
            await self._publish_upload(event)
            return await self._await_upload(event, events, kb, result)

    def _inline_limit(self) -> int:
        limit = self.bus.nc.max_payload // 4 if self.bus.nc is not None else INLINE_CONTENT_BYTES
        return min(INLINE_CONTENT_BYTES, limit)

    @staticmethod
    def _declared_type(declared: str | None, name: str, body: str | bytes | Incoming) -> str | None:
        """The type the caller states, for an early refusal of what kbmesh cannot read. Text
        content is recorded as what the name says when nothing is declared (and as plain text
        under the name of a binary format); bytes leave an undeclared type to ingest, which
        reads it from the bytes and the name."""
        if not isinstance(body, str):
            return declared_mime(declared)
        mime = normalise_mime(declared, name)
        if declared_mime(declared) is None and mime not in TEXT_TYPES | HTML_TYPES:
            mime = "text/plain"  # text content under, e.g., a .pdf name
        return mime

    async def _content(self, body: UploadBody) -> Content:
        if body.content is not None:
            if body.content_encoding == "base64":
                # The one decode: bytes from here on, up to ingest.
                data = decode_content(body.content, "base64", self.settings.max_content_bytes)
                return Content(data)
            return Content(body.content)
        if body.url is not None:
            fetched = await fetch_url(body.url, self.settings)
        else:
            fetched = await read_path(body.path or "", self.settings)
        return Content(fetched.data, fetched.name, fetched.mime_type, fetched.uri)

    async def _same_uri(self, p: Principal, uri: str, kb: KnowledgeBase | None) -> str | None:
        """The document to replace: the one with this uri in `kb` (else among all the
        caller sees). Several are ambiguous: the caller must say which (document_id).
        Looked up once the view holds what the bucket holds: a document uploaded a moment
        ago, through another gateway too, is replaced rather than doubled."""
        await self.catalog.settled()
        found = [
            r
            for r in self.catalog.with_uri(p.org_id, uri)
            if visible(p, r) and (kb is None or kb.matches(r.tags))
        ]
        if len(found) > 1:
            ids = ", ".join(sorted(r.document_id for r in found))
            raise Conflict(
                f"{len(found)} documents have the uri {uri!r} ({ids}); pass the document_id "
                "of the one to replace",
                field="uri",
            )
        return found[0].document_id if found else None

    async def find(self, p: Principal, ref: str) -> DocumentRecord | None:
        """A document by id, else by uri (or path), else by name — None when nothing matches.
        A uri or name that several documents share is ambiguous: Conflict, listing them."""
        with contextlib.suppress(NotFound):
            return await self._record(p, ref)
        for what, matches in (
            ("uri", [r for r in self.catalog.with_uri(p.org_id, ref) if visible(p, r)]),
            (
                "name",
                [r for r in self.catalog.documents(p.org_id) if r.name == ref and visible(p, r)],
            ),
        ):
            if len(matches) > 1:
                ids = ", ".join(sorted(r.document_id for r in matches))
                raise Conflict(
                    f"{len(matches)} documents have the {what} {ref!r} ({ids}); pass the "
                    "document id of the one you mean",
                    field="document_id",
                )
            if matches:
                return await self.reg.documents.get(matches[0].key)
        return None

    async def _publish_upload(self, event: DocUploaded) -> None:
        try:
            await self.bus.publish(Subject.DOC_UPLOADED, event)
        except BaseException:
            if event.object_ref:  # staged for an event that was never sent
                await self.reg.texts.delete(event.object_ref)
            raise

    async def _await_upload(
        self,
        event: DocUploaded,
        events: Events,
        kb: KnowledgeBase | None,
        result: UploadResult,
    ) -> UploadResult:
        deadline = self.waiting.deadline()
        found = await self.waiting.record(
            self.reg.documents.key(event.org_id, result.document_id),
            lambda r: (
                _revision_of(r, event.event_id) is not None or r.upload_event_id == event.event_id
            ),
            deadline,
            events,
            event,
        )
        if isinstance(found, DocFailed):
            # Refused by ingest: the upload itself is at fault, and nothing was stored.
            raise error_class(found.error_type)(found.error, field="content")
        if found is None:
            return result
        record = found
        revision = _revision_of(record, event.event_id) or record.revision
        if record.upload_event_id != event.event_id:
            # Another upload replaced ours before it was indexed: ours will never be
            # searchable. Said plainly, not waited for until the timeout.
            raise _overtaken(record.document_id, revision, record.revision)
        result.revision = record.revision
        result.kb_ids = record.kb_ids
        result.mime_type = record.mime_type  # the type ingest read it as
        if record.status == DocStatus.awaiting_ocr:
            return result.model_copy(update={"status": "awaiting_ocr"})
        if record.status == DocStatus.failed:
            raise InvalidInput(record.error or "the upload failed", field="content")
        if not record.kb_ids:
            return result.model_copy(update={"status": "stored", "chunk_count": 0})
        outcome = await self.waiting.indexed(
            events,
            event.org_id,
            record.document_id,
            set(record.kb_ids),
            set(),
            revision,
            deadline,
        )
        current = await self.reg.documents.get(record.key)
        if current is not None and current.upload_event_id != event.event_id:
            raise _overtaken(record.document_id, revision, current.revision)
        if isinstance(outcome, DocFailed):
            return result.model_copy(update={"status": "failed", "error": outcome.error})
        if outcome is None:
            return result
        counts = outcome
        chunk_count = counts.get(kb.kb_id, 0) if kb else sum(counts.values())
        return result.model_copy(update={"status": "complete", "chunk_count": chunk_count})

    async def get(self, p: Principal, document_id: str) -> DocumentView:
        record = await self._record(p, document_id)
        return await self._view(record, p)

    async def text(self, p: Principal, document_id: str) -> tuple[DocumentRecord, str]:
        """A document the caller may see, with its extracted text."""
        record = await self._record(p, document_id)
        if record.status != DocStatus.ready:
            raise Conflict(
                f"document {document_id!r} has no text yet (status {record.status.value})",
                field="document_id",
            )
        text = await self.reg.texts.get_text(record.text_object)
        if text is None:
            raise Conflict(f"document {document_id!r} has no stored text", field="document_id")
        return record, text

    async def page(
        self,
        p: Principal,
        *,
        kb: str | None = None,
        tag: str | None = None,
        collection: str | None = None,
        source_id: str | None = None,
        name_search: str | None = None,
        writer: str | None = None,
        skip: int = 0,
        limit: int = 50,
    ) -> Page[DocumentView]:
        """`writer` (a key id, a key or publisher name, or local / bus / operator) keeps the
        documents any of whose kept revisions that writer wrote: how a planted document is
        found, and then removed."""
        # Filtered and ordered in the live view; only the page's records are read.
        if kb:
            records = self.catalog.members(await self.kbs.resolve(p, kb))
        else:
            records = list(self.catalog.documents(p.org_id))
        records = [r for r in records if visible(p, r)]
        if tag:
            records = [r for r in records if tag in r.tags]
        if collection:
            records = [r for r in records if split_tags(r.tags)[1] == collection]
        if source_id:
            records = [r for r in records if r.source_id == source_id]
        if name_search:
            records = [r for r in records if name_search.lower() in r.name.lower()]
        if writer:
            records = [r for r in records if r.written_by(writer)]
        records.sort(key=lambda r: r.created_at)
        shown = await self._records(records[skip : skip + limit])
        views = await asyncio.gather(*(self._view(r, p) for r in shown))
        return Page[DocumentView](items=list(views), total=len(records), skip=skip, limit=limit)

    async def _records(self, summaries: list[DocumentSummary]) -> list[DocumentRecord]:
        """The whole records of these documents, read by key (those deleted meanwhile left
        out)."""
        found = await asyncio.gather(*(self.reg.documents.get(d.key) for d in summaries))
        return [r for r in found if r is not None]

    async def patch(
        self, p: Principal, document_id: str, patch: DocumentPatch, *, wait: bool = True
    ) -> DocumentView:
        """Set tags, collection and/or metadata. The change is sent as the next revision of
        the record read here, and ingest applies changes in revision order: one that another
        change overtook is dropped as stale. So every call waits for ingest's verdict (not
        for indexing, unless `wait`): a dropped change is applied again on the newer record
        (what the caller asked to set is set); one applied and then overwritten by a later
        change of the same field answers 409. Nothing is lost silently."""
        deadline = self.waiting.deadline()
        if not wait:
            deadline = min(deadline, time.monotonic() + VERDICT_SECONDS)

        async def attempt() -> DocumentView:
            record = await self._record(p, document_id)
            check_document_write(p, record)
            return await self._patch_once(p, record, patch, wait=wait, deadline=deadline)

        return await compare_and_set(
            attempt, what=f"document {document_id!r}", attempts=PATCH_ATTEMPTS, exhausted=Conflict
        )

    async def _patch_once(
        self,
        p: Principal,
        record: DocumentRecord,
        patch: DocumentPatch,
        *,
        wait: bool,
        deadline: float,
    ) -> DocumentView:
        """`patch` sent as the revision after `record`'s; `Raced` when ingest dropped it as
        stale (another change came first) and the document does not hold it."""
        document_id = record.document_id
        if patch.metadata is not None:
            check_metadata(patch.metadata, self.settings.limits)
        labels, collection = split_tags(record.tags)
        if patch.tags is not None:
            # Implicit KB tags stay: they are membership, not labels the caller manages.
            labels = [t for t in labels if t.startswith("kb:")] + patch.tags
        if patch.clear_collection:
            collection = None
        elif patch.collection is not None:
            collection = patch.collection
        check_labels(labels, collection)
        _check_label_prefixes(patch.tags or [])
        tags = join_tags(labels, collection)
        await self._check_tag_scope(p, tags)
        metadata = patch.metadata if patch.metadata is not None else record.metadata
        if tags == record.tags and metadata == record.metadata:
            return await self._view(record, p)
        revision = record.revision + 1
        event = TagsChanged(
            org_id=p.org_id,
            document_id=document_id,
            tags=tags,
            metadata=patch.metadata,
            revision=revision,
            scope_kb_ids=p.scope,
            writer=p.writer,
        )
        async with self.waiting.watch([document_id]) as events:
            await self.bus.publish(Subject.TAGS_CHANGED, event)
            updated = await self.waiting.record(record.key, _at_least(revision), deadline)
            if not isinstance(updated, DocumentRecord):
                if wait:
                    return await self.get(p, document_id)  # timed out, or deleted meanwhile
                return await self._view(record, p)  # accepted, not applied yet
            mine = _revision_of(updated, event.event_id)
            if mine is None:
                if _patched(patch, updated):
                    # Another change set the same: nothing of ours is lost.
                    return await self.get(p, document_id)
                raise Raced(f"document {document_id!r}: the change was dropped as stale")
            if wait and updated.status == DocStatus.ready:
                lost = set(record.kb_ids) - set(updated.kb_ids)
                await self.waiting.indexed(
                    events, p.org_id, document_id, set(updated.kb_ids), lost, mine, deadline
                )
            # Applied in order; later changes build on it. The answer is the document now,
            # as long as it still holds what this call set: a later change of the same
            # field won (last writer wins), and this call says so instead of showing
            # another request's value as its own.
            current = await self.reg.documents.get(record.key) or updated
            if not _patched(patch, current):
                raise _overtaken(document_id, mine, current.revision)
            return await self._view(current, p)

    async def delete(self, p: Principal, document_id: str, *, wait: bool = True) -> DeleteResult:
        if not document_id.strip():
            raise InvalidInput("document_id must not be empty", field="document_id")
        try:
            record = await self._record(p, document_id)
        except NotFound:
            return DeleteResult(status="not_found", deleted_count=0, document_id=document_id)
        check_document_write(p, record)
        await self._delete(
            [record],
            DocDeleted(org_id=p.org_id, document_ids=[document_id], writer=p.writer),
            wait=wait,
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
        await self.catalog.settled()
        records = await self._records(
            [
                r
                for r in self.catalog.documents(p.org_id)
                if r.source_id == source_id and visible(p, r)
            ]
        )
        for record in records:
            check_document_write(p, record)
        if records:
            await self._delete(
                records,
                DocDeleted(
                    org_id=p.org_id,
                    document_ids=[r.document_id for r in records],
                    writer=p.writer,
                ),
                wait=wait,
            )
        return DeleteResult(
            status="deleted" if records else "not_found",
            deleted_count=len(records),
            document_ids=[r.document_id for r in records],
        )

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
        record = await self.reg.documents.find(p.org_id, document_id)
        if record is None or not visible(p, record):
            raise NotFound(f"document {document_id!r} not found", field="document_id")
        return record

    async def _check_tag_scope(self, p: Principal, tags: list[str]) -> None:
        if p.kb_ids is not None and tags:
            check_tag_scope(p, await self.reg.kbs.of_org(p.org_id), tags)

    async def _view(self, record: DocumentRecord, p: Principal) -> DocumentView:
        tags, collection = split_tags(record.tags)
        status = record.status.value
        if record.status == DocStatus.ready:
            entries = await asyncio.gather(
                *(self.reg.index.find(k, record.document_id) for k in record.kb_ids)
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
            source_revision=record.source_revision,
            tags=visible_tags(p, tags),
            collection=collection,
            metadata=record.metadata,
            revision=record.revision,
            status=status,
            error=record.error
            or "; ".join(f"KB {k}: {why}" for k, why in sorted(record.kb_errors.items()))
            or None,
            kb_ids=visible_kb_ids(p, record.kb_ids),
            size_bytes=record.size_bytes,
            content_checksum=record.content_checksum,
            writer=record.writer,
            revisions=record.writers,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )


def _at_least(revision: int) -> Callable[[DocumentRecord], bool]:
    return lambda record: record.revision >= revision


def _check_label_prefixes(tags: list[str]) -> None:
    for tag in tags:
        if tag.startswith(COLLECTION_PREFIX):
            raise InvalidInput(
                "set collections with `collection`, not a 'collection:' tag", field="tags"
            )


def _revision_of(record: DocumentRecord, event_id: str) -> int | None:
    """The revision that `event_id` made, if it is one of the record's recent changes."""
    if record.last_event_id == event_id:
        return record.recent_events.get(event_id, record.revision)
    return record.recent_events.get(event_id)


def _overtaken(document_id: str, mine: int, newer: int) -> Conflict:
    return Conflict(
        f"document {document_id!r}: this change (revision {mine}) was overwritten by another "
        f"request's (revision {newer}) before it could be confirmed; read the document for "
        "its state",
        field="document_id",
    )


def _patched(patch: DocumentPatch, record: DocumentRecord) -> bool:
    """Whether `record` already has what `patch` sets (by this or another change)."""
    shown, collection = split_tags(record.tags)
    if patch.tags is not None:
        labels = {t for t in shown if not t.startswith("kb:")}
        wanted = set(patch.tags)
        if labels != {t for t in wanted if not t.startswith("kb:")} or not wanted <= set(shown):
            return False
    if patch.clear_collection and collection is not None:
        return False
    if not patch.clear_collection and patch.collection not in (None, collection):
        return False
    return patch.metadata is None or record.metadata == patch.metadata
