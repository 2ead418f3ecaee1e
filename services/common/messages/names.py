"""Names on the bus, in one place: subjects, streams, KV buckets, the object store and the
audit stream. Every module takes them from here (the event models, from events.py)."""

from __future__ import annotations

from enum import StrEnum

# The API-key bucket, written by the operator only.
KEYS_BUCKET = "keys"
# Sources: definitions, sync state and leases; their secrets apart (domain/sources.py).
SOURCES_BUCKET = "sources"
SOURCE_SECRETS_BUCKET = "source-secrets"
KV_BUCKETS = (
    "kbs",
    "documents",
    "index",
    KEYS_BUCKET,
    "prompts",
    SOURCES_BUCKET,
    SOURCE_SECRETS_BUCKET,
)
OBJECT_STORE = "texts"
AUDIT_STREAM = "KBMESH_AUDIT"
AUDIT_PREFIX = "audit."


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
    # A source's run asked for (manual, webhook) and a run's progress and end.
    SOURCE_SYNC = "source.sync"
    SOURCE_RUN = "source.run"
    # request/reply, not in the stream
    SEARCH_QUERY = "search.query"
    SEARCH_CHUNK = "search.chunk"
    SEARCH_ASK = "search.ask"
    # A page of a KB collection's points with their vectors, for `kbmesh backup` (the
    # operator's only: services/common/store/export.py).
    VECTORS_EXPORT = "vectors.export"


REQUEST_SUBJECTS = (Subject.SEARCH_QUERY, Subject.SEARCH_CHUNK, Subject.SEARCH_ASK)
EVENT_SUBJECTS = tuple(
    s for s in Subject if s not in REQUEST_SUBJECTS and s is not Subject.VECTORS_EXPORT
)

# kbmesh's own events, each subject named: upstream publishers' events arrive on longer
# subjects (`<subject>.upstream.<org>.<publisher>`, services/common/bus/auth.py) and are
# kept apart, in UPSTREAM_STREAM, where each publisher's backlog is bounded.
STREAM = "KBMESH"
STREAM_SUBJECTS = [str(s) for s in EVENT_SUBJECTS]
UPSTREAM_STREAM = "KBMESH_UPSTREAM"
# Dead letters: `dlq.<org>.<original subject>`, the org that may see them in the second
# token, so that one org's are read without touching another's (services/common/bus/
# deadletters.py). Messages that name no org are kept under NO_ORG, which no org id can be.
DLQ_STREAM = "KBMESH_DLQ"
DLQ_PREFIX = "dlq."
NO_ORG = "~"


def dlq_subject(org_id: str | None, subject: str) -> str:
    return f"{DLQ_PREFIX}{org_id or NO_ORG}.{subject}"
