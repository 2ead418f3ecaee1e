"""Embed: owns chunking, embedding and the vectors. Every decision is checked against the
registries, so stale, duplicated or reordered messages converge to the registry's truth."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from services.common.bus.registry import Registries
from services.common.domain.errors import Conflict, NotFound, Transient
from services.common.domain.ids import point_id
from services.common.domain.layout import Layout, layout_object
from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KnowledgeBase,
    collection_for,
    split_tags,
    utcnow,
)
from services.common.embedders import EmbedderPool
from services.common.messages.events import DocIndexed, KbChanged, KbIndex, KbRemove, Publish
from services.common.messages.names import Subject
from services.common.ops import metrics
from services.common.ops.telemetry import tracer
from services.common.store import ChunkPoint, Match, SparseVector, VectorStore, bm25
from services.common.store.base import Filter
from services.embed.chunking import Chunk, chunk_document

log = logging.getLogger("kbmesh.embed")
_tracer = tracer("kbmesh.embed")
# Titles ride along in every chunk's embedded text; cap what they may take of the model's input.
TITLE_TOKEN_BUDGET = 24
# The same for a title with the headings above a chunk ("title › section › subsection").
PATH_TOKEN_BUDGET = 48
PATH_SEPARATOR = " › "
# How often one kb.index catches up with a document that changed while it was being indexed.
CATCH_UP_ROUNDS = 5
SWITCH_GRACE_SECONDS = 2.0
# A rebuild's completion check reads every document of the org and every index entry of the
# KB. After each indexed document that made a rebuild of N documents read N x N records; it
# runs at most this often per KB instead (and at most a quarter of the time), and a document
# indexed while a check is due is seen by that check.
SWITCH_CHECK_SECONDS = 2.0


def document_payload(record: DocumentRecord) -> dict[str, Any]:
    """The payload fields that change without re-embedding (tags, collection, metadata...)."""
    tags, collection = split_tags(record.tags)
    return {
        "org_id": record.org_id,
        "document_id": record.document_id,
        "document_name": record.name,
        "document_name_exact": record.name,
        "document_name_folded": record.name.casefold(),
        "source_id": record.source_id,
        "uri": record.uri,
        "tags": tags,
        "collection": collection,
        "metadata": record.metadata,
        "uploaded_at": record.created_at.isoformat(),
        "revision": record.revision,
    }


class EmbedService:
    def __init__(
        self,
        registries: Registries,
        store: VectorStore,
        embedders: EmbedderPool,
        publish: Publish,
    ) -> None:
        self.reg = registries
        self.store = store
        self.embedders = embedders
        self.publish = publish
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._waiters: dict[tuple[str, str], int] = {}
        # Per KB being rebuilt: one completion check at a time, the next not before `_next`.
        self._checks: dict[str, asyncio.Lock] = {}
        self._check_due: set[str] = set()  # a check is waiting to run: it sees what is done
        self._next_check: dict[str, float] = {}

    async def index(self, ev: KbIndex) -> IndexEntry | None:
        entry = await self._index_serialized(ev)
        if entry is not None:
            await self._switch_when_built(ev.org_id, ev.kb_id)
        return entry

    async def _switch_when_built(self, org_id: str, kb_id: str) -> None:
        """Check whether the KB's rebuild (if any) is complete, as `_switch_if_built`, at
        most every SWITCH_CHECK_SECONDS: a document indexed while a check waits to run
        leaves it to that check, one indexed while a check runs waits for the next."""
        kb = await self.reg.kbs.get(f"{org_id}.{kb_id}")
        if kb is None or kb.serving is None or kb_id in self._check_due:
            return
        self._check_due.add(kb_id)
        try:
            async with self._checks.setdefault(kb_id, asyncio.Lock()):
                wait = self._next_check.get(kb_id, 0.0) - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._check_due.discard(kb_id)
                started = time.monotonic()
                await self._switch_if_built(org_id, kb_id)
                took = time.monotonic() - started
                self._next_check[kb_id] = time.monotonic() + max(SWITCH_CHECK_SECONDS, 3 * took)
        finally:
            self._check_due.discard(kb_id)

    async def _switch_if_built(self, org_id: str, kb_id: str) -> None:
        """Once every member document is in the generation being built, searches move to
        it and the previous collection is dropped."""
        key = f"{org_id}.{kb_id}"
        found = await self.reg.kbs.get_versioned(key)
        if found is None or found[0].serving is None:
            return
        kb, last = found
        documents = await self.reg.documents.list(f"{org_id}.")
        entries = {e.document_id: e for e in await self.reg.index.list(f"{kb_id}.")}
        for d in documents:
            if kb.matches(d.tags) and d.status == DocStatus.ready and kb_id not in d.kb_errors:
                entry = entries.get(d.document_id)
                if entry is None or not entry.built_for(kb):
                    return
        assert kb.serving is not None
        previous = kb.collection_for(kb.serving.generation)
        # The rebuild wrote without waiting for the disk (nobody searched its collection):
        # flushed before searches move there, and checked to hold what its entries count.
        await self.store.flush(kb.collection_name)
        if not await self._holds(kb, list(entries.values())):
            return
        kb.serving = None
        try:
            await self.reg.kbs.update(key, kb, last)
        except Conflict:
            return  # the KB changed meanwhile; the next indexed document checks again
        # Searches read KB records from a live mirror and may have started just before the
        # switch: give them a moment on the previous collection before it goes.
        await asyncio.sleep(SWITCH_GRACE_SECONDS)
        await self.store.flush(kb.collection_name)  # a rebuild's write that raced the switch
        await self.store.drop_collection(previous)
        log.info(
            "kb switched kb_id=%s collection=%s dropped=%s", kb_id, kb.collection_name, previous
        )

    async def _holds(self, kb: KnowledgeBase, entries: list[IndexEntry]) -> bool:
        """Whether the collection being built holds the points its index entries count. It
        may not after the machine went down (the rebuild's last writes were not on disk
        yet): the documents that lost points lose their entries and are indexed again."""
        built = [e for e in entries if e.built_for(kb)]
        if await self.store.count(kb.collection_name) == sum(e.chunk_count for e in built):
            return True
        for entry in built:
            document = Filter(must=(Match("document_id", entry.document_id),))
            if await self.store.count(kb.collection_name, document) == entry.chunk_count:
                continue
            log.warning(
                "points missing, indexing again kb_id=%s document_id=%s",
                kb.kb_id,
                entry.document_id,
            )
            await self.reg.index.delete(entry.key)
            record = await self.reg.documents.get(f"{kb.org_id}.{entry.document_id}")
            if record is not None:
                await self.publish(
                    Subject.KB_INDEX,
                    KbIndex(
                        org_id=kb.org_id,
                        kb_id=kb.kb_id,
                        document_id=entry.document_id,
                        revision=record.revision,
                    ),
                )
        return False

    async def _index_serialized(self, ev: KbIndex) -> IndexEntry | None:
        async with self._serial(ev.kb_id, ev.document_id):
            done = await self._index_once(ev)
            embedded = bool(done and done[1])
            # The document or the KB may have changed while this ran (on another worker or
            # replica, or a kb.remove ran before our write): look again, so that the last
            # writer always leaves the registry's current state in the index.
            for _ in range(CATCH_UP_ROUNDS):
                if done is None:
                    return None
                entry = done[0]  # None: built into a collection abandoned meanwhile
                kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
                record = await self.reg.documents.get(f"{ev.org_id}.{ev.document_id}")
                if kb is None or record is None or not kb.matches(record.tags):
                    log.info(
                        "document left the kb while indexing kb_id=%s document_id=%s",
                        ev.kb_id,
                        ev.document_id,
                    )
                    await self._drop(ev.kb_id, ev.document_id, kb)
                    return None
                if entry is not None and record.revision <= entry.revision and entry.built_for(kb):
                    await self._announce(kb, record, entry, embedded=embedded)
                    return entry
                done = await self._index_once(ev.model_copy(update={"revision": record.revision}))
                embedded = embedded or bool(done and done[1])
            raise Transient(f"document {ev.document_id} keeps changing; indexing again later")

    async def _index_once(self, ev: KbIndex) -> tuple[IndexEntry | None, bool] | None:
        """Bring the document's points in the KB to the registry's state; returns the index
        entry and whether anything was embedded, or None for stale work. The entry is None
        when the work went into a rebuild's collection that was abandoned meanwhile (it is
        then neither recorded nor announced: the caller looks again)."""
        kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
        record = await self.reg.documents.get(f"{ev.org_id}.{ev.document_id}")
        if kb is None or record is None or record.checksum is None:
            log.info(
                "drop kb.index: kb or document gone kb_id=%s document_id=%s",
                ev.kb_id,
                ev.document_id,
            )
            return None
        if ev.revision < record.revision or not kb.matches(record.tags):
            log.info(
                "drop stale kb.index kb_id=%s document_id=%s revision=%d current=%d",
                ev.kb_id,
                ev.document_id,
                ev.revision,
                record.revision,
            )
            return None
        entry_key = f"{kb.kb_id}.{record.document_id}"
        stored = await self.reg.index.get(entry_key)
        # After a cancel: the entry of the serving build, which the abandoned one kept.
        entry = stored.for_build(kb) if stored is not None else None
        same_build = entry is not None and entry.checksum == record.checksum and entry.built_for(kb)
        if entry is not None and same_build and entry.revision >= record.revision:
            if entry is not stored:
                await self.reg.index.put(entry_key, entry)
            return entry, False
        if kb.serving is not None and (entry is None or entry.revision < record.revision):
            # Searches read the previous generation until the rebuild is done: its labels
            # follow the document's at once (its text and chunks stay as they were built).
            await self._relabel(kb.serving_collection, record)
        if entry is not None and same_build:
            # Same text, same settings: only labels changed. Rewrite payloads, no embedding
            # (an empty text has no points, and its KB may have no collection at all).
            if entry.chunk_count:
                await self._relabel(kb.collection_name, record)
            entry.revision = record.revision
            entry.indexed_at = utcnow()
            await self.reg.index.put(entry_key, entry)
            return entry, False
        new_text = entry is None or entry.checksum != record.checksum
        try:
            built = await self._build(kb, record)
        except NotFound:
            # A cancel or a newer change dropped the rebuild's collection under our write.
            if await self._abandoned(kb):
                return None, False
            raise
        if await self._drop_if_abandoned(kb):
            # Recording this build would make a collection that is gone look built (and,
            # after a cancel, a later change may reuse its settings version).
            return None, True
        entry = built.replacing(stored, kb)
        await self.reg.index.put(entry_key, entry)
        if new_text:  # not a rebuild for new settings: the upload's own wait
            metrics.index_latency(record.accepted_at)
        return entry, True

    async def _relabel(self, collection: str, record: DocumentRecord) -> None:
        with _tracer.start_as_current_span("kbmesh.embed.set_payload"):
            await self.store.set_payload(
                collection,
                Filter(must=(Match("document_id", record.document_id),)),
                document_payload(record),
            )

    async def _abandoned(self, kb: KnowledgeBase) -> bool:
        """Whether the collection this work wrote to belongs to a rebuild since cancelled."""
        current = await self.reg.kbs.get(f"{kb.org_id}.{kb.kb_id}")
        return current is not None and kb.collection_name not in (
            current.collection_name,
            current.serving_collection,
        )

    async def _drop_if_abandoned(self, kb: KnowledgeBase) -> bool:
        """A rebuild cancelled or replaced while we wrote to its collection: our write
        re-created what was dropped, so drop it again (the catch-up then indexes where it
        belongs); whether it was."""
        if not await self._abandoned(kb):
            return False
        log.info(
            "built into an abandoned collection kb_id=%s collection=%s",
            kb.kb_id,
            kb.collection_name,
        )
        await self.store.drop_collection(kb.collection_name)
        return True

    async def _build(self, kb: KnowledgeBase, record: DocumentRecord) -> IndexEntry:
        text = await self.reg.texts.get_text(record.text_object)
        if text is None:
            raise FileNotFoundError(f"text of {record.document_id} missing")  # transient
        embedder = self.embedders.get(kb.embedding_model, kb.api_base)
        title = record.name.strip()
        layout = await self._layout(record)

        def prefix(headings: tuple[str, ...]) -> str:
            """What goes before a chunk for embedding and BM25: the title and the headings
            above it, outer headings dropped first when the path is too long."""
            parts = [p for p in (title, *headings) if p]
            while len(parts) > 2 and embedder.count_tokens(_path(parts)) >= PATH_TOKEN_BUDGET:
                del parts[1]
            return _path(parts)

        def prefix_tokens(headings: tuple[str, ...]) -> int:
            if not headings:
                # As for every document before headings were read: plain text chunks alike.
                return min(embedder.count_tokens(title) + 1, TITLE_TOKEN_BUDGET) if title else 0
            return min(embedder.count_tokens(prefix(headings)) + 1, PATH_TOKEN_BUDGET)

        def prepare() -> tuple[list[Chunk], list[str], list[SparseVector]]:
            # CPU-bound (tokenising, chunking, BM25): kept off the event loop.
            with _tracer.start_as_current_span("kbmesh.embed.chunk") as span:
                chunks = chunk_document(
                    text,
                    layout,
                    kb,
                    embedder.tokenizer(),
                    max_tokens=embedder.max_tokens,
                    prefix_tokens=prefix_tokens,
                )
                span.set_attribute("kbmesh.chunk_count", len(chunks))
            # The heading path goes into what is embedded and keyword-indexed, not the content.
            indexed = []
            for c in chunks:
                head = prefix(c.headings)
                indexed.append(f"{head}\n{c.text}" if head else c.text)
            return chunks, indexed, [bm25.encode_document(t) for t in indexed]

        chunks, indexed, sparse = await asyncio.to_thread(prepare)
        with _tracer.start_as_current_span("kbmesh.embed.embed") as span:
            span.set_attribute("kbmesh.model", kb.embedding_model)
            dense = await embedder.embed(indexed) if indexed else []
            metrics.CHUNKS_EMBEDDED.inc(len(indexed))
        base = document_payload(record)
        points = [
            ChunkPoint(
                id=point_id(kb.kb_id, record.document_id, c.index),
                dense=vector,
                sparse=sparse_vector,
                payload={
                    **base,
                    "kb_id": kb.kb_id,
                    "chunk_index": c.index,
                    "total_chunks": len(chunks),
                    "content": c.text,
                    "start": c.start,
                    "end": c.end,
                    "settings_version": kb.settings_version,
                    "text_checksum": record.checksum,
                    **_place(c, layout),
                },
            )
            for c, vector, sparse_vector in zip(chunks, dense, sparse, strict=True)
        ]
        with _tracer.start_as_current_span("kbmesh.embed.upsert") as span:
            span.set_attribute("kbmesh.points", len(points))
            if points:
                await self.store.ensure_collection(kb.collection_name, embedder.dim)
                # A rebuild's collection is searched by nobody until it is complete: its
                # writes skip the flush, which would hold up every search of the process
                # (see EdgeStore); the switch flushes it.
                await self.store.replace_document(
                    kb.collection_name, record.document_id, points, durable=kb.serving is None
                )
            else:  # an empty text indexes as nothing, and leaves nothing behind
                await self.store.delete_document(kb.collection_name, record.document_id)
        log.info(
            "indexed org_id=%s kb_id=%s document_id=%s revision=%d chunks=%d",
            record.org_id,
            kb.kb_id,
            record.document_id,
            record.revision,
            len(points),
        )
        return IndexEntry(
            org_id=record.org_id,
            kb_id=kb.kb_id,
            document_id=record.document_id,
            revision=record.revision,
            checksum=record.checksum or "",
            settings_version=kb.settings_version,
            chunk_count=len(points),
            generation=kb.index_generation,
        )

    async def _layout(self, record: DocumentRecord) -> Layout | None:
        """The layout ingest stored beside this text; None for a document stored before
        layouts were (read as plain text), or beside another version of the text."""
        data = await self.reg.texts.get(layout_object(record.org_id, record.document_id))
        if not data:
            return None
        try:
            layout = Layout.model_validate_json(data)
        except ValidationError:
            log.warning("unreadable layout document_id=%s", record.document_id)
            return None
        return layout if layout.checksum == record.checksum else None

    async def remove(self, ev: KbRemove) -> None:
        async with self._serial(ev.kb_id, ev.document_id):
            kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
            record = await self.reg.documents.get(f"{ev.org_id}.{ev.document_id}")
            if kb is not None and record is not None and kb.matches(record.tags):
                log.info("drop stale kb.remove kb_id=%s document_id=%s", ev.kb_id, ev.document_id)
                return
            await self._drop(ev.kb_id, ev.document_id, kb)
        await self.publish(
            Subject.DOC_INDEXED,
            DocIndexed(
                org_id=ev.org_id,
                kb_id=ev.kb_id,
                document_id=ev.document_id,
                revision=ev.revision,
                chunk_count=0,
                embedded=False,
                removed=True,
            ),
        )

    async def _drop(self, kb_id: str, document_id: str, kb: KnowledgeBase | None) -> None:
        """Delete the document's points (in every collection the KB reads or writes) and its
        index entry; all of the KB's points when the KB itself is gone (an index that raced
        its deletion may have re-created the collection)."""
        with _tracer.start_as_current_span("kbmesh.embed.delete"):
            if kb is None:
                await self.store.drop_collection(collection_for(kb_id, 1))
            else:
                for collection in {kb.collection_name, kb.serving_collection}:
                    await self.store.delete_document(collection, document_id)
        await self.reg.index.delete(f"{kb_id}.{document_id}")

    @contextlib.asynccontextmanager
    async def _serial(self, kb_id: str, document_id: str) -> AsyncIterator[None]:
        """One piece of work per (KB, document) at a time in this process: concurrent
        workers would otherwise race their reads and writes of the same points."""
        key = (kb_id, document_id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key], self._locks[key]

    async def kb_changed(self, ev: KbChanged) -> None:
        if ev.change == "cancelled":
            await self._cancelled(ev)
            return
        if ev.change in ("settings", "reindex"):
            # A rebuild replaced before it was built leaves its collection behind.
            kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
            for collection in kb.abandoned_collections if kb else []:
                await self.store.drop_collection(collection)
            return
        if ev.change != "deleted":
            return
        for collection in ev.collections or [collection_for(ev.kb_id, 1)]:
            await self.store.drop_collection(collection)
        for entry in await self.reg.index.list(f"{ev.kb_id}."):
            await self.reg.index.delete(f"{entry.kb_id}.{entry.document_id}")

    async def _cancelled(self, ev: KbChanged) -> None:
        """A cancelled rebuild: drop what it built, and bring back the index entries of the
        serving collection that the gateway's cancel did not (one written meanwhile; nothing
        is read from the store or embedded again). A document whose text changed while the
        rebuild ran has its new text only in the abandoned collection: indexed again here."""
        for collection in ev.collections:
            await self.store.drop_collection(collection)
        kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
        if kb is None or kb.serving is not None:
            return  # deleted, or another rebuild started meanwhile: that one settles it
        for entry in await self.reg.index.list(f"{kb.kb_id}."):
            if entry.built_for(kb):
                continue
            record = await self.reg.documents.get(f"{kb.org_id}.{entry.document_id}")
            if record is None:
                continue  # its kb.remove clears the entry
            await self.index(
                KbIndex(
                    org_id=kb.org_id,
                    kb_id=kb.kb_id,
                    document_id=record.document_id,
                    revision=record.revision,
                )
            )
        log.info("reindex cancelled kb_id=%s dropped=%s", kb.kb_id, ev.collections)

    async def _announce(
        self, kb: KnowledgeBase, record: DocumentRecord, entry: IndexEntry, *, embedded: bool
    ) -> None:
        metrics.DOCUMENTS_INDEXED.inc()
        await self.publish(
            Subject.DOC_INDEXED,
            DocIndexed(
                org_id=record.org_id,
                kb_id=kb.kb_id,
                document_id=record.document_id,
                revision=entry.revision,
                chunk_count=entry.chunk_count,
                embedded=embedded,
            ),
        )


def _path(parts: list[str]) -> str:
    return PATH_SEPARATOR.join(parts)


def _place(chunk: Chunk, layout: Layout | None) -> dict[str, Any]:
    """Where a chunk lies in its document, for hits and citations: its heading path, and
    its pages (or slides)."""
    place: dict[str, Any] = {}
    if chunk.headings:
        place["heading_path"] = list(chunk.headings)
    if chunk.pages and layout is not None:
        place["slides" if layout.unit == "slide" else "pages"] = list(chunk.pages)
    return place
