"""The vectors of a backup: each KB's points and the index entries that say which document
revision they were built from, so that a restore loads them instead of embedding every chunk.

Backup asks the running embed service for each KB's points (`vectors.export`, a page per
request); with no embed service answering (the stack is stopped) it reads the store itself.
It writes them to the archive's `vectors/` parts as they come, through a private folder
beside the archive, so it never holds more than one page of them.

One rule decides which points a restore may use (`KbPoints`), applied when the backup is
taken and again when it is restored (the archive is not trusted): a document's points count
only when its index entry describes exactly the revision and text of the document's record
in the same archive, built with the KB's settings as the archive restores them, and the KB's
collection holds every chunk of that entry, each labelled with that revision, text and
settings. Anything else (an upload or a change that landed while the backup ran, a KB
reconfigured meanwhile) leaves the document's entry out, its points unused: the restore
embeds that document again from the text the archive holds. A KB whose vectors were built
with other settings than its record's, or whose model now gives vectors of another
dimension, is embedded again whole.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import nats.errors
from pydantic import BaseModel, ConfigDict, Field

from services.common.bus.client import Bus
from services.common.bus.registry import Registry
from services.common.domain.ids import point_id
from services.common.domain.models import DocStatus, DocumentRecord, IndexEntry, KnowledgeBase
from services.common.embedders import EmbedderPool, LocalEmbedder, is_local
from services.common.messages.names import Subject
from services.common.store import VectorStore
from services.common.store.export import (
    ExportFailed,
    ExportPage,
    ExportRequest,
    PointRow,
    answer_export,
    read_reply,
)

log = logging.getLogger("kbmesh.backup")

# How long one page of points may take to arrive (the engine reads a few hundred points).
PAGE_SECONDS = 60.0
# Why a restore embeds a KB again rather than loading its vectors.
REEMBED_ASKED = "--reembed"
NO_VECTORS = "no vectors in the archive"
OTHER_SETTINGS = "built with other settings"
OTHER_DIMENSION = "the model gives vectors of another dimension"


def as_restored(kb: KnowledgeBase) -> KnowledgeBase:
    """The KB as a restore writes it: a rebuild under way is dropped (the collections it was
    reading from are not in the archive), so it serves its previous generation's settings."""
    restored = kb.model_copy(deep=True)
    restored.cancel_rebuild()
    return restored


class VectorSet(BaseModel):
    """One KB's vectors in an archive: the collection they came from and what built them."""

    model_config = ConfigDict(extra="forbid")

    org_id: str
    kb_id: str
    collection: str
    embedding_model: str
    api_base: str | None = None
    settings_version: int
    chunker: str
    chunk_size: int
    chunk_overlap: int
    dim: int | None = Field(None, ge=1, description="of every dense vector; None: no points")
    points: int = Field(0, ge=0, description="in the archive's parts")

    @classmethod
    def of(cls, kb: KnowledgeBase) -> VectorSet:
        return cls(org_id=kb.org_id, kb_id=kb.kb_id, collection=kb.collection_name, **_build(kb))

    def fits(self, kb: KnowledgeBase) -> bool:
        """Whether these vectors are what `kb` (as restored) would build."""
        return _build(kb) == {key: getattr(self, key) for key in _build(kb)}


def _build(kb: KnowledgeBase) -> dict[str, object]:
    return {
        "embedding_model": kb.embedding_model,
        "api_base": kb.api_base,
        "settings_version": kb.settings_version,
        "chunker": str(kb.chunker),
        "chunk_size": kb.chunk_size,
        "chunk_overlap": kb.chunk_overlap,
    }


@dataclass(frozen=True)
class Current:
    """What the archive holds of a document that can be indexed: its revision and text."""

    revision: int
    checksum: str
    kb_ids: frozenset[str]  # the archive's KBs whose tags it matches


def current(record: DocumentRecord, kbs: Iterable[KnowledgeBase]) -> Current | None:
    if record.status != DocStatus.ready or record.checksum is None:
        return None
    members = frozenset(
        kb.kb_id for kb in kbs if kb.org_id == record.org_id and kb.matches(record.tags)
    )
    return Current(record.revision, record.checksum, members)


@dataclass
class _Document:
    entry: IndexEntry
    seen: set[int] = field(default_factory=set)
    spoiled: bool = False

    @property
    def whole(self) -> bool:
        return not self.spoiled and len(self.seen) == self.entry.chunk_count


class KbPoints:
    """The rule for one KB: which documents' points are whole and current."""

    def __init__(self, kb: KnowledgeBase) -> None:
        self.kb = kb
        self.documents: dict[str, _Document] = {}

    def expect(self, entry: IndexEntry, found: Current | None) -> bool:
        """Whether `entry` describes the archive's record of its document, in this KB, with
        the KB's settings; its points are then looked for."""
        fits = (
            found is not None
            and entry.org_id == self.kb.org_id
            and entry.kb_id == self.kb.kb_id
            and self.kb.kb_id in found.kb_ids
            and entry.revision == found.revision
            and entry.checksum == found.checksum
            and entry.settings_version == self.kb.settings_version
            and entry.document_id not in self.documents
        )
        if fits:
            self.documents[entry.document_id] = _Document(entry)
        return fits

    def take(self, row: PointRow) -> bool:
        """Whether the point is one of an expected document's chunks, labelled as its entry
        says; one that is not spoils its document (none of its points are then used)."""
        payload = row.payload
        document = self.documents.get(str(payload.get("document_id")))
        if document is None:
            return False
        entry, index = document.entry, payload.get("chunk_index")
        if (
            type(index) is not int
            or not 0 <= index < entry.chunk_count
            or index in document.seen
            or row.id != point_id(self.kb.kb_id, entry.document_id, index)
            or payload.get("org_id") != self.kb.org_id
            or payload.get("kb_id") != self.kb.kb_id
            or payload.get("revision") != entry.revision
            or payload.get("text_checksum") != entry.checksum
            or payload.get("settings_version") != entry.settings_version
            or payload.get("total_chunks") != entry.chunk_count
        ):
            document.spoiled = True
            return False
        document.seen.add(index)
        return True

    def whole(self) -> list[IndexEntry]:
        return [d.entry for d in self.documents.values() if d.whole]

    def broken(self) -> list[_Document]:
        return [d for d in self.documents.values() if not d.whole]


# --- backup -------------------------------------------------------------------------------


@dataclass
class Spooled:
    """An archive member written to a file beside the archive before the archive itself."""

    name: str
    path: Path
    size: int
    sha256: str


class _Parts:
    """Rows written straight to part files of about `part_bytes`, each 0600 in a private
    folder, with their sizes and SHA-256 taken as they are written."""

    def __init__(self, folder: Path, section: str, part_bytes: int) -> None:
        self.folder = folder
        self.section = section
        self.part_bytes = part_bytes
        self.written: list[Spooled] = []
        self._out: BinaryIO | None = None
        self._sha = hashlib.sha256()

    def add(self, row: bytes) -> None:
        size = self.written[-1].size if self._out is not None else 0
        if self._out is None or (size and size + len(row) > self.part_bytes):
            self._finish()
            self._open()
        self._write(b"\n" + row if size else row)

    def close(self) -> list[Spooled]:
        self._finish()
        return self.written

    def _open(self) -> None:
        name = f"{len(self.written):06d}.jsonl"
        path = self.folder / name
        # A new file (O_EXCL) in a folder of our own: nothing planted is written through.
        self._out = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
        self._sha = hashlib.sha256()
        self.written.append(Spooled(f"{self.section}/{name}", path, 0, ""))

    def _write(self, data: bytes) -> None:
        assert self._out is not None
        self._out.write(data)
        self._sha.update(data)
        self.written[-1].size += len(data)

    def _finish(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
            self.written[-1].sha256 = self._sha.hexdigest()


class PointSource:
    """Pages of points: asked of the embed service over the bus; when none answers (the
    stack is stopped), read from the store `open_store` opens in this process."""

    def __init__(self, bus: Bus, open_store: Callable[[], VectorStore] | None) -> None:
        self.bus = bus
        self.open_store = open_store
        self.store: VectorStore | None = None

    async def page(self, request: ExportRequest) -> ExportPage:
        if self.store is None:
            try:
                reply = await self.bus.ask(Subject.VECTORS_EXPORT, request, PAGE_SECONDS)
                return read_reply(reply)
            except nats.errors.NoRespondersError:
                if self.open_store is None:
                    raise ExportFailed("no embed service answers on the bus") from None
                log.info("no embed service answers: reading the vector store directly")
                self.store = self.open_store()
        body = request.model_dump_json().encode()
        try:
            reply = await answer_export(self.store, body, self.bus.max_payload())
        except Exception as err:  # the engine's own errors (a shard another process holds)
            raise ExportFailed(f"the vector store cannot be read here: {err}") from err
        return read_reply(reply)

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


@dataclass
class Taken:
    """A backup's vectors: the parts written, the entries whose points are whole in them,
    what built each KB's, and the KBs left without (and why)."""

    parts: list[Spooled]
    entries: list[IndexEntry]
    sets: list[VectorSet]
    left_out: dict[str, str]


async def take(
    source: PointSource,
    kbs: list[KnowledgeBase],
    documents: Iterable[DocumentRecord],
    index: Registry[IndexEntry],
    folder: Path,
    part_bytes: int,
) -> Taken:
    """Every KB's points into parts under `folder`, read after the records and the entries
    (`documents`: the records the archive holds)."""
    restored = [as_restored(kb) for kb in kbs]
    found = {(d.org_id, d.document_id): current(d, restored) for d in documents}
    parts = _Parts(folder, "vectors", part_bytes)
    taken = Taken([], [], [], {})
    try:
        for kb in restored:
            rule = KbPoints(kb)
            for entry in await index.list(f"{kb.kb_id}."):
                rule.expect(entry, found.get((kb.org_id, entry.document_id)))
            vector_set = VectorSet.of(kb)
            try:
                await _points(source, rule, vector_set, parts)
            except (ExportFailed, nats.errors.Error, OSError) as err:
                # Not a failed backup: this KB is embedded again on restore, as before.
                reason = str(err) or type(err).__name__
                log.warning("vectors left out kb_id=%s reason=%s", kb.kb_id, reason)
                taken.left_out[kb.kb_id] = reason
                continue
            taken.sets.append(vector_set)
            taken.entries += rule.whole()
    finally:
        taken.parts = parts.close()
    return taken


async def _points(
    source: PointSource, rule: KbPoints, vector_set: VectorSet, parts: _Parts
) -> None:
    """The KB's points of expected documents into `parts`. Rows of a document found spoiled
    later stay there: its entry is left out, so a restore does not use them."""
    offset: str | None = None
    while True:
        page = await source.page(ExportRequest(collection=vector_set.collection, offset=offset))
        for raw in page.rows:
            row = PointRow.model_validate_json(raw)
            if rule.take(row):
                # One collection, one dimension: the engine holds it to that.
                vector_set.dim = vector_set.dim or row.dim
                parts.add(raw)
                vector_set.points += 1
        if page.next is None:
            return
        offset = page.next


# --- restore ------------------------------------------------------------------------------


@dataclass
class Loader:
    """Restore's side: loads the points of the documents whose entries fit, writes those
    entries, and says which KBs are embedded again and why."""

    store: VectorStore
    index: Registry[IndexEntry]
    embedders: EmbedderPool
    sets: dict[str, VectorSet]
    reembed: bool
    reembedded: dict[str, str] = field(default_factory=dict)
    loaded: int = 0
    stale_documents: int = 0
    finished: bool = False
    _kbs: dict[str, KbPoints] = field(default_factory=dict)
    _restored: list[KnowledgeBase] = field(default_factory=list)
    _found: dict[tuple[str, str], Current] = field(default_factory=dict)
    _collections: set[str] = field(default_factory=set)

    def kb(self, kb: KnowledgeBase) -> None:
        """A KB as restored: its vectors are used, or it is embedded again, for this reason."""
        self._restored.append(kb)
        vector_set = self.sets.get(kb.kb_id)
        if self.reembed:
            reason = REEMBED_ASKED
        elif vector_set is None or vector_set.org_id != kb.org_id:
            reason = NO_VECTORS
        elif not vector_set.fits(kb):
            reason = OTHER_SETTINGS
        elif vector_set.dim is not None and vector_set.dim != self._dim(kb, vector_set.dim):
            reason = OTHER_DIMENSION
        else:
            self._kbs[kb.kb_id] = KbPoints(kb)
            return
        self.reembedded[kb.kb_id] = reason

    def _dim(self, kb: KnowledgeBase, recorded: int) -> int:
        """The dimension the KB's model gives: known for a bundled model; a hosted model's
        is only learnt by calling it, and its name already matched."""
        if not is_local(kb.embedding_model):
            return recorded
        embedder = self.embedders.get(kb.embedding_model)
        return embedder.dim if isinstance(embedder, LocalEmbedder) else recorded

    def document(self, record: DocumentRecord) -> None:
        found = current(record, self._restored)
        if found is not None:
            self._found[(record.org_id, record.document_id)] = found

    async def entry(self, entry: IndexEntry) -> bool:
        rule = self._kbs.get(entry.kb_id)
        if rule is None or not rule.expect(
            entry, self._found.get((entry.org_id, entry.document_id))
        ):
            return False
        await self.index.put(entry.key, entry)
        return True

    async def points(self, rows: list[PointRow]) -> None:
        """One part's rows: those of expected documents upserted, per KB."""
        by_kb: dict[str, list[PointRow]] = {}
        for row in rows:
            by_kb.setdefault(str(row.payload.get("kb_id")), []).append(row)
        for kb_id, kb_rows in by_kb.items():
            rule = self._kbs.get(kb_id)
            if rule is None:
                continue
            points = [row.point() for row in kb_rows if rule.take(row)]
            if not points:
                continue
            collection = rule.kb.collection_name
            if collection not in self._collections:
                await self.store.ensure_collection(collection, len(points[0].dense))
                self._collections.add(collection)
            await self.store.upsert(collection, points)
            self.loaded += len(points)

    async def finish(self) -> None:
        """Documents whose points are not all there, or not all of their revision: entry
        and points removed, so that the restore embeds them again. Then the index of each
        loaded collection is built, as after any bulk load."""
        self.finished = True
        for rule in self._kbs.values():
            for document in rule.broken():
                entry = document.entry
                await self.index.delete(entry.key)
                if document.seen:
                    await self.store.delete_document(rule.kb.collection_name, entry.document_id)
                self.loaded -= len(document.seen)
                self.stale_documents += 1
        for collection in self._collections:
            await self.store.optimize(collection)
