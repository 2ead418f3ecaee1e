"""Event contracts on the bus: subjects, streams and one pydantic model per subject.

These models are the single source of the JSON Schemas in `contracts/events/`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.domain.content import STAGING_PREFIX
from services.common.domain.ids import new_id
from services.common.domain.models import DEFAULT_SOURCE, Writer, utcnow


class Subject(StrEnum):
    DOC_UPLOADED = "doc.uploaded"
    DOC_DELETED = "doc.deleted"
    OCR_DONE = "ocr.done"
    TAGS_CHANGED = "tags.changed"
    KB_INDEX = "kb.index"
    KB_REMOVE = "kb.remove"
    KB_CHANGED = "kb.changed"
    DOC_INDEXED = "doc.indexed"
    DOC_FAILED = "doc.failed"
    # request/reply, not in the stream
    SEARCH_QUERY = "search.query"
    SEARCH_CHUNK = "search.chunk"
    SEARCH_ASK = "search.ask"
    # A page of a KB collection's points with their vectors, for `kbmesh backup` (the
    # operator's only: services/common/store/export.py).
    VECTORS_EXPORT = "vectors.export"


STREAM = "KBMESH"
STREAM_SUBJECTS = ["doc.>", "ocr.>", "tags.>", "kb.>"]
DLQ_STREAM = "KBMESH_DLQ"
DLQ_PREFIX = "dlq."


def dlq_subject(subject: str) -> str:
    return f"{DLQ_PREFIX}{subject}"


class Event(BaseModel):
    # Strict reader: a misspelt field is a producer's bug and must not pass silently (an
    # ignored `colection` would store the document without its collection). Rolling upgrades
    # update consumers first (docs/operations.md).
    model_config = ConfigDict(extra="forbid")

    event_id: str = Field(default_factory=new_id, description="unique; also the Nats-Msg-Id")
    org_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    occurred_at: datetime = Field(default_factory=utcnow)


_ID = r"^[A-Za-z0-9_-]{1,64}$"
DocumentId = Annotated[str, Field(pattern=_ID)]
WRITER_DESCRIPTION = (
    "who made the change, as the gateway saw the caller (API key, or keyless loopback); "
    "absent on events from upstream publishers, whose writer is their bus identity"
)
SCOPE_DESCRIPTION = (
    "the KB scope of the key that made the change, if limited: an existing document outside "
    "it is neither replaced nor changed (Conflict)"
)


def _own_object(org_id: str, object_ref: str | None) -> None:
    """Objects are read only from the event's own org: `<org_id>/...` (upstream) or
    `uploads/<org_id>/...` (the gateway's staging area)."""
    if object_ref is None:
        return
    if not object_ref.startswith((f"{org_id}/", f"{STAGING_PREFIX}{org_id}/")) or (
        ".." in object_ref.split("/")
    ):
        raise ValueError(
            f"object_ref must name an object of org {org_id!r}: '{org_id}/...' "
            f"(or '{STAGING_PREFIX}{org_id}/...')"
        )


class DocUploaded(Event):
    """A document to store and index. Content travels inline or as an object-store name."""

    document_id: str | None = Field(None, pattern=_ID, description="assigned when absent")
    name: str = Field(min_length=1, max_length=512)
    mime_type: str = "text/plain"
    source_id: str = DEFAULT_SOURCE
    uri: str | None = None
    tags: list[str] = Field(default_factory=list)
    collection: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    kb_id: str | None = Field(None, description="direct upload: adds the KB's implicit tag")
    content: str | None = Field(None, description="inline content, text or base64")
    content_encoding: Literal["text", "base64"] = "text"
    object_ref: str | None = Field(
        None, description="name in the `texts` object store, under '<org_id>/'"
    )
    needs_ocr: bool = False
    scope_kb_ids: list[str] | None = Field(None, description=SCOPE_DESCRIPTION)
    writer: Writer | None = Field(None, description=WRITER_DESCRIPTION)

    @model_validator(mode="after")
    def _object_of_own_org(self) -> DocUploaded:
        _own_object(self.org_id, self.object_ref)
        return self


class DocDeleted(Event):
    """Delete documents by id, or every document of a source."""

    document_ids: list[DocumentId] = Field(default_factory=list)
    source_id: str | None = Field(None, min_length=1)
    writer: Writer | None = Field(None, description=WRITER_DESCRIPTION)


class OcrDone(Event):
    document_id: str = Field(pattern=_ID)
    ok: bool = True
    text: str | None = None
    object_ref: str | None = Field(
        None, description="name in the `texts` object store, under '<org_id>/'"
    )
    error: str | None = None

    @model_validator(mode="after")
    def _object_of_own_org(self) -> OcrDone:
        _own_object(self.org_id, self.object_ref)
        return self


class TagsChanged(Event):
    """A document's full new tag set (collection tag included) and, optionally, metadata."""

    document_id: str = Field(pattern=_ID)
    tags: list[str]
    metadata: dict[str, Any] | None = None
    revision: int | None = Field(
        None, ge=1, description="the revision this change creates; older ones are dropped"
    )
    scope_kb_ids: list[str] | None = Field(None, description=SCOPE_DESCRIPTION)
    writer: Writer | None = Field(None, description=WRITER_DESCRIPTION)


class KbIndex(Event):
    kb_id: str = Field(pattern=_ID)
    document_id: str = Field(pattern=_ID)
    revision: int = Field(ge=1)


class KbRemove(Event):
    kb_id: str = Field(pattern=_ID)
    document_id: str = Field(pattern=_ID)
    revision: int = Field(ge=1)


class KbChanged(Event):
    kb_id: str = Field(pattern=_ID)
    change: Literal[
        "created", "tags", "settings", "reindex", "retry_failed", "cancelled", "deleted"
    ]
    old_tag_ids: list[str] = Field(default_factory=list)
    collections: list[str] = Field(
        default_factory=list,
        description="on deletion: the KB's collections to drop; on cancel: the abandoned ones",
    )


class DocIndexed(Event):
    kb_id: str
    document_id: str
    revision: int
    chunk_count: int
    embedded: bool = Field(True, description="false when only the payload changed")
    removed: bool = Field(False, description="true when the document left the KB")


class DocFailed(Event):
    document_id: str | None = None
    kb_id: str | None = None
    revision: int | None = None
    stage: Literal["ingest", "ocr", "embed"] = "ingest"
    error: str
    error_type: str = Field(
        "ValidationError", description="the error's class: ValidationError, Conflict, ..."
    )
    cause: str | None = Field(None, description="event_id of the event whose handling failed")


EVENT_MODELS: dict[str, type[Event]] = {
    Subject.DOC_UPLOADED: DocUploaded,
    Subject.DOC_DELETED: DocDeleted,
    Subject.OCR_DONE: OcrDone,
    Subject.TAGS_CHANGED: TagsChanged,
    Subject.KB_INDEX: KbIndex,
    Subject.KB_REMOVE: KbRemove,
    Subject.KB_CHANGED: KbChanged,
    Subject.DOC_INDEXED: DocIndexed,
    Subject.DOC_FAILED: DocFailed,
}


Publish = Callable[[str, Event], Awaitable[None]]
