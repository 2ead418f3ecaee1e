"""The gateway's live view of the `documents` and `index` buckets, fed by their watches
(`Registry.follow`): per document the few fields that listings, filters, scopes and KB
membership use; per KB its index entries' figures; and running counts from which a KB's
view, stats and progress are summed in time that grows with the number of distinct tag
sets, not with the number of documents. A change costs constant time (an entry's), or a
look into each of its org's KBs (a document's). Nothing here reads a bucket per request;
a decision that needs the server's truth first waits for the view to catch up
(`settled`).

Membership is by tags and a KB's tags may change at any time, so no count is kept per KB
for its members: documents are counted per (tag set, status), and the facts that belong to
one document in one KB (its index entry, an indexing error there) per (tag set, status,
error, entry state) of that KB; a KB's figures add up the groups whose tag set it matches."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

from services.common.bus.registry import Registries
from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KnowledgeBase,
    document_in_scope,
    document_writable_in,
    kb_tag,
)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class _Held(Generic[V]):
    value: V
    users: int = 0


class _Shared(Generic[K, V]):
    """One object per distinct value, shared by every document that has it, and forgotten
    with the last of them: most documents share their tag set and writers with thousands
    of others."""

    def __init__(self, make: Callable[[K], V]) -> None:
        self._make = make
        self._held: dict[K, _Held[V]] = {}

    def take(self, key: K) -> V:
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(self._make(key))
        held.users += 1
        return held.value

    def give_back(self, key: K) -> None:
        held = self._held.get(key)
        if held is not None:
            held.users -= 1
            if held.users == 0:
                del self._held[key]

    def __len__(self) -> int:
        return len(self._held)


@dataclass(slots=True, eq=False)
class TagSet:
    """A document's stored tags (in their stored order) and the same as a set; compared by
    identity, as there is one per distinct tuple (`_Shared`)."""

    tags: tuple[str, ...]
    members: frozenset[str]


@dataclass(slots=True, eq=False)
class DocumentSummary:
    """What the gateway keeps of a document record (the rest is read by key, for the page
    being shown)."""

    org_id: str
    document_id: str
    name: str
    mime_type: str
    source_id: str
    uri: str | None
    tag_set: TagSet
    status: DocStatus
    error: str | None
    kb_ids: tuple[str, ...]
    kb_errors: dict[str, str] | None
    revision: int
    created_at: datetime
    updated_at: datetime
    writers: frozenset[str]  # every name a kept revision's writer answers to (`written_by`)
    sequence: int | None  # the bucket's sequence of the record (None: not known)

    @property
    def key(self) -> str:
        return f"{self.org_id}.{self.document_id}"

    @property
    def tags(self) -> list[str]:
        return list(self.tag_set.tags)

    def in_scope(self, scope: Collection[str] | None) -> bool:
        return document_in_scope(self.tag_set.tags, self.kb_ids, scope)

    def writable_in(self, scope: Collection[str] | None) -> bool:
        return document_writable_in(self.tag_set.tags, self.kb_ids, scope)

    def written_by(self, ref: str) -> bool:
        return ref in self.writers


# An index entry's build: (settings version, generation).
Build = tuple[int, int | None]


def _built_for(build: Build, kb: KnowledgeBase) -> bool:
    settings_version, generation = build
    return settings_version == kb.settings_version and generation in (None, kb.index_generation)


@dataclass(slots=True, eq=False)
class EntrySummary:
    """What the gateway keeps of an index entry."""

    revision: int
    settings_version: int
    chunk_count: int
    indexed_at: datetime
    sequence: int | None
    generation: int | None = None  # the collection it was built into (None: before names)

    @property
    def build(self) -> Build:
        return (self.settings_version, self.generation)

    def built_for(self, kb: KnowledgeBase) -> bool:
        """As `IndexEntry.built_for`: in the collection `kb` builds, with its settings."""
        return _built_for(self.build, kb)


@dataclass(frozen=True)
class KbFigures:
    """A KB's numbers at one moment. `entries`/`chunks`: its index entries (whatever the
    documents' tags say now); `current`: the entries built with its settings version; the
    rest count the documents whose tags match it (`members`)."""

    entries: int
    chunks: int
    current: int
    members: int
    ready: int
    failed: int
    indexed: int
    rebuild_total: int
    rebuild_done: int
    pending: int


@dataclass(slots=True)
class _Totals:
    entries: int = 0
    chunks: int = 0
    by_build: Counter[Build] = field(default_factory=Counter)  # entries per build


# (tag set, document status, failed in this KB, entry state: None, or (entry at the
# document's revision or later, the entry's build)).
_PairKey = tuple[TagSet, DocStatus, bool, tuple[bool, Build] | None]


class Catalog:
    """The live view. `start` reads both buckets once and follows them; the registries'
    own writes (ingest and embed in the same process) show at once."""

    def __init__(self) -> None:
        self._docs: dict[str, dict[str, DocumentSummary]] = {}
        self._uris: dict[str, dict[str, str | tuple[str, ...]]] = {}
        self._classes: dict[str, Counter[tuple[TagSet, DocStatus]]] = {}
        self._entries: dict[str, dict[str, EntrySummary]] = {}
        self._totals: dict[str, _Totals] = {}
        self._pairs: dict[str, Counter[_PairKey]] = {}
        # The KBs with entries, per org: where a changed document may have some. (An org
        # has a few KBs, KBMESH_KB_LIMIT at most: looking in each costs less memory than
        # an index per document.)
        self._org_kbs: dict[str, set[str]] = {}
        self._kb_orgs: dict[str, str] = {}
        self._tag_sets: _Shared[tuple[str, ...], TagSet] = _Shared(
            lambda tags: TagSet(tags, frozenset(tags))
        )
        self._writers: _Shared[frozenset[str], frozenset[str]] = _Shared(lambda refs: refs)
        self._registries: Registries | None = None
        self._index_followed = False

    async def start(self, registries: Registries) -> None:
        """Read both buckets and follow them (a start step: tried again after a failure,
        it follows what it does not follow yet; values fed twice replace themselves)."""
        # One after the other: both at once take longer here, and a gateway that falls
        # behind two streams at once risks being cut off as a slow consumer.
        if self._registries is None:
            await registries.documents.follow(_DocumentFeed(self))
            self._registries = registries
        if not self._index_followed:
            await registries.index.follow(_IndexFeed(self))
            self._index_followed = True

    async def settled(self) -> None:
        """Wait until the view holds what both buckets hold now (bounded: `Registry.settled`)."""
        if self._registries is not None:
            await self._registries.documents.settled()
            await self._registries.index.settled()

    # ---- reads ----------------------------------------------------------------------------

    def documents(self, org_id: str) -> Collection[DocumentSummary]:
        return self._docs.get(org_id, {}).values()

    def document(self, org_id: str, document_id: str) -> DocumentSummary | None:
        return self._docs.get(org_id, {}).get(document_id)

    def members(self, kb: KnowledgeBase) -> list[DocumentSummary]:
        """The documents whose tags match `kb`."""
        match = _match(kb)
        return [d for d in self.documents(kb.org_id) if not d.tag_set.members.isdisjoint(match)]

    def with_uri(self, org_id: str, uri: str) -> list[DocumentSummary]:
        found = self._uris.get(org_id, {}).get(uri)
        ids = (found,) if isinstance(found, str) else found or ()
        docs = self._docs.get(org_id, {})
        return [docs[i] for i in ids if i in docs]

    def entry(self, kb_id: str, document_id: str) -> EntrySummary | None:
        return self._entries.get(kb_id, {}).get(document_id)

    def indexed(self, kb_id: str) -> int:
        """How many documents have an index entry in the KB."""
        totals = self._totals.get(kb_id)
        return totals.entries if totals else 0

    def figures(self, kb: KnowledgeBase) -> KbFigures:
        match = _match(kb)
        members = ready = failed = 0
        for (tag_set, status), n in self._classes.get(kb.org_id, {}).items():
            if tag_set.members.isdisjoint(match):
                continue
            members += n
            if status == DocStatus.ready:
                ready += n
            elif status == DocStatus.failed:
                failed += n
        indexed = ready_failed_here = done = settled = 0
        for (tag_set, status, failed_here, entry), n in self._pairs.get(kb.kb_id, {}).items():
            if tag_set.members.isdisjoint(match):
                continue
            if failed_here and status != DocStatus.failed:
                failed += n
            if not failed_here and status != DocStatus.failed and entry and entry[0]:
                indexed += n
            if status == DocStatus.ready:
                if failed_here:
                    ready_failed_here += n
                    settled += n
                elif entry is not None and _built_for(entry[1], kb):
                    done += n
                    settled += n
        totals = self._totals.get(kb.kb_id) or _Totals()
        return KbFigures(
            entries=totals.entries,
            chunks=totals.chunks,
            current=sum(n for build, n in totals.by_build.items() if _built_for(build, kb)),
            members=members,
            ready=ready,
            failed=failed,
            indexed=indexed,
            rebuild_total=ready - ready_failed_here,
            rebuild_done=done,
            pending=ready - settled,
        )

    def footprint(self) -> dict[str, int]:
        """How much the view holds (for tests and benchmarks)."""
        return {
            "documents": sum(len(d) for d in self._docs.values()),
            "entries": sum(len(e) for e in self._entries.values()),
            "tag_sets": len(self._tag_sets),
        }

    # ---- changes --------------------------------------------------------------------------

    def put_document(self, record: DocumentRecord, sequence: int | None) -> None:
        org_id, document_id = sys.intern(record.org_id), sys.intern(record.document_id)
        old = self.document(org_id, document_id)
        if _older(sequence, old.sequence if old else None):
            return  # a late delivery of what our own write already replaced
        self._replace_document(org_id, document_id, old, self._summary(record, sequence))

    def drop_document(self, key: str, sequence: int | None) -> None:
        org_id, _, document_id = key.partition(".")
        old = self.document(org_id, document_id)
        if old is not None and not _older(sequence, old.sequence):
            self._replace_document(old.org_id, old.document_id, old, None)

    def put_entry(self, entry: IndexEntry, sequence: int | None) -> None:
        kb_id, document_id = sys.intern(entry.kb_id), sys.intern(entry.document_id)
        old = self.entry(kb_id, document_id)
        if _older(sequence, old.sequence if old else None):
            return
        org_id = self._kb_orgs.setdefault(kb_id, sys.intern(entry.org_id))
        self._org_kbs.setdefault(org_id, set()).add(kb_id)
        new = EntrySummary(
            entry.revision,
            entry.settings_version,
            entry.chunk_count,
            entry.indexed_at,
            sequence,
            entry.generation,
        )
        self._replace_entry(kb_id, document_id, old, new)

    def drop_entry(self, key: str, sequence: int | None) -> None:
        kb_id, _, document_id = key.partition(".")
        old = self.entry(kb_id, document_id)
        if old is not None and not _older(sequence, old.sequence):
            self._replace_entry(sys.intern(kb_id), sys.intern(document_id), old, None)

    def _summary(self, record: DocumentRecord, sequence: int | None) -> DocumentSummary:
        refs = frozenset(
            ref
            for w in record.writers
            for ref in (
                w.writer.key_id,
                w.writer.name,
                w.writer.kind,
                w.writer.subject,
                w.writer.email,
            )
            if ref is not None
        )
        return DocumentSummary(
            org_id=sys.intern(record.org_id),
            document_id=sys.intern(record.document_id),
            name=record.name,
            mime_type=sys.intern(record.mime_type),
            source_id=sys.intern(record.source_id),
            uri=record.uri,
            tag_set=self._tag_sets.take(tuple(sys.intern(t) for t in record.tags)),
            status=record.status,
            error=record.error,
            kb_ids=tuple(sys.intern(k) for k in record.kb_ids),
            kb_errors=dict(record.kb_errors) or None,
            revision=record.revision,
            created_at=record.created_at,
            updated_at=record.updated_at,
            writers=self._writers.take(refs),
            sequence=sequence,
        )

    def _replace_document(
        self,
        org_id: str,
        document_id: str,
        old: DocumentSummary | None,
        new: DocumentSummary | None,
    ) -> None:
        kb_ids = set(self._org_kbs.get(org_id, ()))
        for doc in (old, new):
            if doc is not None and doc.kb_errors:
                kb_ids.update(doc.kb_errors)
        for kb_id in kb_ids:
            entry = self.entry(kb_id, document_id)
            self._count_pair(kb_id, _pair(old, kb_id, entry), _pair(new, kb_id, entry))
        classes = self._classes.setdefault(org_id, Counter())
        if old is not None:
            _less(classes, (old.tag_set, old.status))
            self._forget_uri(old)
        docs = self._docs.setdefault(org_id, {})
        if new is None:
            docs.pop(document_id, None)
        else:
            docs[document_id] = new
            classes[(new.tag_set, new.status)] += 1
            if new.uri:
                uris = self._uris.setdefault(org_id, {})
                found = uris.get(new.uri)
                if found is None:
                    uris[new.uri] = document_id
                elif found != document_id and document_id not in found:
                    held = (found,) if isinstance(found, str) else found
                    uris[new.uri] = (*held, document_id)
        if old is not None:  # given back last: `new` may hold the same ones
            self._tag_sets.give_back(old.tag_set.tags)
            self._writers.give_back(old.writers)
        if not docs:
            del self._docs[org_id]
        if not classes:
            del self._classes[org_id]

    def _forget_uri(self, old: DocumentSummary) -> None:
        uris = self._uris.get(old.org_id)
        if not old.uri or uris is None or (found := uris.get(old.uri)) is None:
            return
        rest = () if isinstance(found, str) else tuple(i for i in found if i != old.document_id)
        if found == old.document_id or not rest:
            del uris[old.uri]
        else:
            uris[old.uri] = rest[0] if len(rest) == 1 else rest
        if not uris:
            del self._uris[old.org_id]

    def _replace_entry(
        self, kb_id: str, document_id: str, old: EntrySummary | None, new: EntrySummary | None
    ) -> None:
        org_id = self._kb_orgs.get(kb_id, "")
        doc = self.document(org_id, document_id)
        self._count_pair(kb_id, _pair(doc, kb_id, old), _pair(doc, kb_id, new))
        totals = self._totals.setdefault(kb_id, _Totals())
        builds = totals.by_build
        entries = self._entries.setdefault(kb_id, {})
        if old is not None:
            totals.entries -= 1
            totals.chunks -= old.chunk_count
            _less(builds, old.build)
        if new is not None:
            totals.entries += 1
            totals.chunks += new.chunk_count
            builds[new.build] += 1
            entries[document_id] = new
        else:
            entries.pop(document_id, None)
        if not entries:
            del self._entries[kb_id]
            del self._totals[kb_id]
            del self._kb_orgs[kb_id]
            kbs = self._org_kbs[org_id]
            kbs.discard(kb_id)
            if not kbs:
                del self._org_kbs[org_id]

    def _count_pair(self, kb_id: str, old: _PairKey | None, new: _PairKey | None) -> None:
        if old == new:
            return
        pairs = self._pairs.setdefault(kb_id, Counter())
        if old is not None:
            _less(pairs, old)
        if new is not None:
            pairs[new] += 1
        if not pairs:
            del self._pairs[kb_id]


class _DocumentFeed:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def put(self, key: str, value: DocumentRecord, revision: int | None) -> None:
        self.catalog.put_document(value, revision)

    def drop(self, key: str, revision: int | None) -> None:
        self.catalog.drop_document(key, revision)


class _IndexFeed:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def put(self, key: str, value: IndexEntry, revision: int | None) -> None:
        self.catalog.put_entry(value, revision)

    def drop(self, key: str, revision: int | None) -> None:
        self.catalog.drop_entry(key, revision)


def _match(kb: KnowledgeBase) -> frozenset[str]:
    return frozenset((*kb.tag_ids, kb_tag(kb.kb_id)))


def _pair(doc: DocumentSummary | None, kb_id: str, entry: EntrySummary | None) -> _PairKey | None:
    """Where (document, KB) is counted in the KB's groups: None when the document is unknown
    or has neither an entry nor an error there (its document group alone counts it)."""
    if doc is None:
        return None
    failed_here = doc.kb_errors is not None and kb_id in doc.kb_errors
    if entry is None and not failed_here:
        return None
    state = None if entry is None else (entry.revision >= doc.revision, entry.build)
    return (doc.tag_set, doc.status, failed_here, state)


def _older(sequence: int | None, known: int | None) -> bool:
    """Whether a change at `sequence` is older than the value already held (at `known`)."""
    return sequence is not None and known is not None and sequence < known


def _less(counts: Counter[K], key: K) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
