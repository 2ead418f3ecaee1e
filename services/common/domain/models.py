"""Domain records kept in the registries: knowledge bases, documents and index entries."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from services.common.domain.errors import Conflict

DEFAULT_MODEL = "local/all-MiniLM-L6-v2"
# The models that ship inside the package (their specs: services/common/embedders/local.py).
BUNDLED_MODELS = (DEFAULT_MODEL, "local/all-MiniLM-L6-v2-int8")
# The KB every org gets on first reference, by name (and, in the default org, as its id): the
# name clients use when they name no KB, so it is the same in every deployment.
DEFAULT_KB = "default"

# KB settings the chunker and search accept (the request models publish the same bounds).
CHUNK_SIZE_RANGE = (50, 2000)
MAX_NEIGHBORS = 5
KB_TAG_PREFIX = "kb:"
COLLECTION_PREFIX = "collection:"
DEFAULT_SOURCE = "user-provided"
RECENT_EVENTS = 16
# Revisions whose writer a document record keeps; the audit trail keeps every one.
WRITER_HISTORY = 50


def utcnow() -> datetime:
    return datetime.now(UTC)


def id_unavailable(document_id: str) -> Conflict:
    """The one answer for a document id a caller may not use, whether another request just
    took it or it names a document outside the caller's scope: the two must look alike, or
    the answer would tell a scoped key which ids exist elsewhere."""
    return Conflict(
        f"document_id {document_id!r} is not available; choose another id", field="document_id"
    )


def kb_tag(kb_id: str) -> str:
    """The implicit tag every KB matches: uploading into a KB is tagging with it."""
    return f"{KB_TAG_PREFIX}{kb_id}"


def split_tags(tags: list[str]) -> tuple[list[str], str | None]:
    """Stored tags → (visible tags, collection). Implicit `kb:` tags stay visible; the
    collection tag never is."""
    visible = [t for t in tags if not t.startswith(COLLECTION_PREFIX)]
    collection = next(
        (t[len(COLLECTION_PREFIX) :] for t in tags if t.startswith(COLLECTION_PREFIX)), None
    )
    return visible, collection


def join_tags(tags: list[str], collection: str | None) -> list[str]:
    """Visible tags + collection → stored tags, with at most one collection tag."""
    out = sorted({t for t in tags if not t.startswith(COLLECTION_PREFIX)})
    if collection:
        out.append(f"{COLLECTION_PREFIX}{collection}")
    return out


class Chunker(StrEnum):
    recursive = "recursive"
    sentence = "sentence"
    token = "token"


class KBStatus(StrEnum):
    active = "active"
    indexing = "indexing"
    error = "error"
    pending_reindex = "pending_reindex"


class ServingIndex(BaseModel):
    """The previous generation, still answering searches while the next one is built, with
    the settings it was built with (a cancelled rebuild returns to them)."""

    generation: int
    embedding_model: str
    api_base: str | None = None
    settings_version: int | None = None
    chunker: Chunker | None = None
    chunk_size: int | None = None
    chunk_overlap: int | None = None


class KnowledgeBase(BaseModel):
    """A searchable index with its own chunking and embedding settings."""

    org_id: str
    kb_id: str
    name: str
    description: str = ""
    tag_ids: list[str] = Field(default_factory=list)
    chunker: Chunker = Chunker.recursive
    chunk_size: int = 200
    chunk_overlap: int = 0
    embedding_model: str = DEFAULT_MODEL
    api_base: str | None = None
    coalesce_neighbors: int = 0
    # Optional: search reranks its best candidates with this LiteLLM rerank model.
    rerank_model: str | None = None
    rerank_api_base: str | None = None
    # Bumped by every chunking or embedding change; index entries remember the version
    # they were built with, so unchanged (text, version) pairs are never re-embedded.
    settings_version: int = 1
    status: KBStatus = KBStatus.active
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)

    # A change of embedding model needs a new collection (other vectors, maybe another
    # dimension). Embed builds generation `index_generation`; until every member document is
    # in it, search keeps reading `serving` (the previous collection, with its model).
    index_generation: int = 1
    serving: ServingIndex | None = None
    # The highest generation ever started: a cancelled one's number is never used again
    # (a worker that was still writing to it may have left points behind).
    generations: int = 1

    def rebuild_from(self, current: KnowledgeBase) -> None:
        """Build these (changed) settings into a new generation while `current`'s serving
        collection keeps answering searches."""
        self.generations = max(current.generations, current.index_generation) + 1
        self.index_generation = self.generations
        self.serving = current.serving or ServingIndex(
            generation=current.index_generation,
            embedding_model=current.embedding_model,
            api_base=current.api_base,
            settings_version=current.settings_version,
            chunker=current.chunker,
            chunk_size=current.chunk_size,
            chunk_overlap=current.chunk_overlap,
        )

    def cancel_rebuild(self) -> str | None:
        """Back to the serving generation and its settings; returns the collection of the
        abandoned one (None when no rebuild is running)."""
        if self.serving is None:
            return None
        abandoned = self.collection_name
        serving = self.serving
        self.generations = max(self.generations, self.index_generation)
        self.index_generation = serving.generation
        self.embedding_model, self.api_base = serving.embedding_model, serving.api_base
        self.chunker = serving.chunker or self.chunker
        self.chunk_size = serving.chunk_size or self.chunk_size
        self.chunk_overlap = (
            serving.chunk_overlap if serving.chunk_overlap is not None else self.chunk_overlap
        )
        if serving.settings_version is not None:
            self.settings_version = serving.settings_version
        self.serving = None
        self.status = KBStatus.active
        return abandoned

    @property
    def abandoned_collections(self) -> list[str]:
        """Generations started after the serving one and replaced before they were built."""
        if self.serving is None:
            return []
        return [
            self.collection_for(g)
            for g in range(self.serving.generation + 1, self.index_generation)
        ]

    @field_validator("chunk_size")
    @classmethod
    def _chunk_size(cls, size: int) -> int:
        low, high = CHUNK_SIZE_RANGE
        if not low <= size <= high:
            raise ValueError(f"chunk_size must be between {low} and {high} tokens")
        return size

    @field_validator("chunk_overlap")
    @classmethod
    def _chunk_overlap(cls, overlap: int, info: ValidationInfo) -> int:
        size = info.data.get("chunk_size")
        if size is not None and not 0 <= overlap < size:
            raise ValueError(f"chunk_overlap must be >= 0 and smaller than chunk_size ({size})")
        return overlap

    @field_validator("coalesce_neighbors")
    @classmethod
    def _neighbors(cls, neighbors: int) -> int:
        if not 0 <= neighbors <= MAX_NEIGHBORS:
            raise ValueError(f"coalesce_neighbors must be between 0 and {MAX_NEIGHBORS}")
        return neighbors

    @field_validator("embedding_model")
    @classmethod
    def _local_model(cls, model: str) -> str:
        if model.startswith("local/") and model not in BUNDLED_MODELS:
            raise ValueError(
                f"embedding_model {model!r}: the bundled local models are "
                f"{', '.join(BUNDLED_MODELS)}; use a LiteLLM model id for others"
            )
        return model

    @field_validator("tag_ids")
    @classmethod
    def _tags(cls, tags: list[str]) -> list[str]:
        for tag in tags:
            if not tag or tag.startswith(COLLECTION_PREFIX):
                raise ValueError(f"tag_ids: invalid tag {tag!r}")
        return tags

    def matches(self, tags: list[str]) -> bool:
        return kb_tag(self.kb_id) in tags or bool(set(self.tag_ids) & set(tags))

    def collection_for(self, generation: int) -> str:
        return collection_for(self.kb_id, generation)

    @property
    def collection_name(self) -> str:
        """The collection embed writes: the generation being built."""
        return self.collection_for(self.index_generation)

    @property
    def serving_collection(self) -> str:
        """The collection search reads."""
        return self.collection_for(
            self.serving.generation if self.serving else self.index_generation
        )

    @property
    def serving_model(self) -> tuple[str, str | None]:
        """The embedding model (and api_base) of the collection search reads."""
        if self.serving is not None:
            return self.serving.embedding_model, self.serving.api_base
        return self.embedding_model, self.api_base


def collection_for(kb_id: str, generation: int) -> str:
    return f"kb_{kb_id}" if generation == 1 else f"kb_{kb_id}_g{generation}"


class Writer(BaseModel):
    """Who made a change: an API key (its id and name), a user signed in with the identity
    provider (`user`: the token's subject, with name and e-mail when the token has them), a
    keyless loopback client (`local`), an upstream publisher on the bus (`bus`, with its user
    when known), an operator's command (`operator`), a source kbmesh keeps in sync (`source`,
    named by its source id), or a caller of a source's webhook (`hook`, named by its
    address: it holds no key, only the source's secret)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["key", "user", "local", "bus", "operator", "source", "hook"]
    key_id: str | None = Field(
        None, max_length=64, description="the API key's id (the start of its hash)"
    )
    name: str | None = Field(
        None,
        max_length=200,
        description="the key's name; a user's name; for `bus`, the publisher's user; for "
        "`source`, the source's id",
    )
    subject: str | None = Field(
        None, max_length=255, description="a user's `sub` at the identity provider"
    )
    email: str | None = Field(None, max_length=320, description="a user's e-mail, when known")

    def matches(self, ref: str) -> bool:
        """Whether `ref` names this writer: a key id, a key, user or publisher name, a user's
        subject or e-mail, or a kind."""
        return ref in (self.key_id, self.name, self.kind, self.subject, self.email)


LOCAL_WRITER = Writer(kind="local")


class RevisionWriter(BaseModel):
    """Who wrote one revision of a document, and when."""

    revision: int
    writer: Writer
    at: datetime


class DocStatus(StrEnum):
    processing = "processing"
    awaiting_ocr = "awaiting_ocr"
    ready = "ready"  # text extracted; KB indexing follows per KB
    failed = "failed"


class DocumentRecord(BaseModel):
    """One uploaded item, once per org; indexed into every KB its tags match."""

    org_id: str
    document_id: str
    name: str
    mime_type: str = "text/plain"
    source_id: str = DEFAULT_SOURCE
    uri: str | None = None
    source_revision: str | None = Field(
        None, description="the source's version of this content: a commit id, an ETag"
    )
    tags: list[str] = Field(default_factory=list, description="stored form, collection included")
    metadata: dict[str, Any] = Field(default_factory=dict)
    revision: int = 1
    text_revision: int = 1
    checksum: str | None = Field(None, description="sha256 of the extracted text")
    content_checksum: str | None = Field(None, description="sha256 of the bytes as uploaded")
    accepted_at: datetime | None = Field(None, description="when this revision's upload was sent")
    size_bytes: int = 0
    status: DocStatus = DocStatus.processing
    error: str | None = None
    kb_ids: list[str] = Field(default_factory=list, description="KBs the document belongs to")
    last_event_id: str | None = None
    upload_event_id: str | None = Field(
        None, description="the upload whose content the document holds"
    )
    recent_events: dict[str, int] = Field(
        default_factory=dict,
        description="event id → revision it made, for the last few changes: a waiting caller "
        "finds its own change, and a late redelivery is recognised after newer changes",
    )
    kb_errors: dict[str, str] = Field(
        default_factory=dict, description="KB id → why indexing this revision there failed"
    )
    writers: list[RevisionWriter] = Field(
        default_factory=list,
        description=f"who wrote each revision, oldest first (the last {WRITER_HISTORY})",
    )
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)

    @property
    def key(self) -> str:
        return f"{self.org_id}.{self.document_id}"

    def applied(self, event_id: str, writer: Writer | None = None) -> None:
        """Record that `event_id`, sent by `writer`, made the current revision."""
        self.last_event_id = event_id
        self.recent_events[event_id] = self.revision
        while len(self.recent_events) > RECENT_EVENTS:
            del self.recent_events[next(iter(self.recent_events))]
        if writer is not None:
            self.written(writer)

    def written(self, writer: Writer) -> None:
        """Record `writer` as the writer of the current revision."""
        self.writers = [w for w in self.writers if w.revision != self.revision]
        self.writers.append(RevisionWriter(revision=self.revision, writer=writer, at=utcnow()))
        del self.writers[:-WRITER_HISTORY]

    @property
    def writer(self) -> Writer | None:
        """Who wrote the current revision (None for documents stored before writers were)."""
        last = self.writers[-1] if self.writers else None
        return last.writer if last is not None and last.revision == self.revision else None

    def written_by(self, ref: str) -> bool:
        """Whether any kept revision was written by the writer `ref` names."""
        return any(w.writer.matches(ref) for w in self.writers)

    def writable_in(self, scope: Collection[str] | None) -> bool:
        """Whether such a key may replace or change it: visible, and in no KB outside scope."""
        return document_writable_in(self.tags, self.kb_ids, scope)

    @property
    def text_object(self) -> str:
        return f"{self.org_id}/{self.document_id}/text"

    def in_scope(self, kb_ids: Collection[str] | None) -> bool:
        """Whether a caller limited to `kb_ids` (None: every KB) may see this document."""
        return document_in_scope(self.tags, self.kb_ids, kb_ids)


def document_in_scope(
    tags: Collection[str], kb_ids: Collection[str], scope: Collection[str] | None
) -> bool:
    """Whether a caller limited to the KBs `scope` (None: every KB) may see a document with
    these `tags` in these `kb_ids`: it is in one of them, or tagged into one."""
    return scope is None or bool(set(scope) & set(kb_ids)) or any(kb_tag(k) in tags for k in scope)


def document_writable_in(
    tags: Collection[str], kb_ids: Collection[str], scope: Collection[str] | None
) -> bool:
    """Whether a caller limited to `scope` may replace or change such a document: visible,
    and in no KB outside its scope."""
    if scope is None:
        return True
    outside = {t.removeprefix(KB_TAG_PREFIX) for t in tags if t.startswith(KB_TAG_PREFIX)}
    return document_in_scope(tags, kb_ids, scope) and (set(kb_ids) | outside) <= set(scope)


class IndexEntry(BaseModel):
    """That a document is indexed in a KB, and from which revision, text and settings."""

    org_id: str
    kb_id: str
    document_id: str
    revision: int
    checksum: str
    settings_version: int
    chunk_count: int
    indexed_at: datetime = Field(default_factory=utcnow)
    # The generation (collection) holding the points. A cancel returns a KB to an earlier
    # settings version, so a version alone may name two builds; generations are never
    # reused. None: written before entries recorded it.
    generation: int | None = None
    # While a rebuild runs: the document's entry in the collection searches read, so that a
    # cancel returns to it without reading, or embedding, anything again.
    serving: IndexEntry | None = None

    @property
    def key(self) -> str:
        return f"{self.kb_id}.{self.document_id}"

    def built_for(self, kb: KnowledgeBase) -> bool:
        """Whether the points this entry describes are in the collection `kb` builds, with
        its settings."""
        return self.settings_version == kb.settings_version and self.generation in (
            None,
            kb.index_generation,
        )

    def for_build(self, kb: KnowledgeBase) -> IndexEntry:
        """This entry, or, when it describes an abandoned build and the serving one it kept
        is `kb`'s (after a cancel) with the same text, that one: its labels were kept
        current during the rebuild, so it stands for this entry's revision. A text that
        changed during the rebuild is only in the abandoned collection: this entry then."""
        kept = self.serving
        if (
            self.built_for(kb)
            or kept is None
            or not kept.built_for(kb)
            or kept.checksum != self.checksum
        ):
            return self
        return kept.model_copy(update={"revision": max(kept.revision, self.revision)})

    def replacing(self, previous: IndexEntry | None, kb: KnowledgeBase) -> IndexEntry:
        """This new build's entry, keeping the entry of the collection searches read while
        `kb` is rebuilt (`previous` is the document's entry until now)."""
        serving = kb.serving
        kept = None
        if serving is not None and previous is not None:
            # An entry from before generations were recorded is the serving one by version.
            if (previous.generation or serving.generation) == serving.generation and (
                previous.settings_version == serving.settings_version
            ):
                kept = previous.model_copy(update={"serving": None})
            elif previous.serving is not None and previous.serving.generation == serving.generation:
                kept = previous.serving  # rebuilt before (a new text): still the serving one
        return self.model_copy(update={"serving": kept})
