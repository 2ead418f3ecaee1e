"""The contract examples: one realistic, typed instance per event, per tool call and per REST
operation, all telling one story (an HR handbook knowledge base at the org `acme`).

`kbmesh contracts export` writes them next to their schemas in `contracts/`, `kbmesh mock`
answers with them, and tests/contracts checks that each validates against its schema. They are
pydantic instances so a changed model breaks them here, at import, rather than in a JSON file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel

from services.common.bus.audit import AuditEntry
from services.common.domain.ids import point_id
from services.common.domain.models import DEFAULT_MODEL, Chunker, KBStatus, RevisionWriter, Writer
from services.common.domain.sources import SourceRun
from services.common.messages.answers import (
    AskQuery,
    AskResponse,
    AskTask,
    Citation,
    SearchMade,
    Usage,
)
from services.common.messages.events import (
    DocDeleted,
    DocFailed,
    DocIndexed,
    DocUploaded,
    Event,
    KbChanged,
    KbIndex,
    KbRemove,
    OcrDone,
    SourceRunEvent,
    SourceSync,
    TagsChanged,
)
from services.common.messages.names import Subject
from services.common.messages.queries import (
    ChunkResponse,
    Mode,
    SearchFilters,
    SearchHit,
    SearchQuery,
    SearchResponse,
)
from services.gateway.oauth import SignIn
from services.gateway.schemas import (
    Ack,
    AuditList,
    DeadLetterBody,
    DeadLetterList,
    DeadLetterView,
    DefaultsView,
    DeleteResult,
    DocumentPatch,
    DocumentView,
    KbCreate,
    KbDefaults,
    KbDocumentView,
    KbList,
    KbProgress,
    KbStats,
    KbUpdate,
    KbView,
    LimitsView,
    ModelDefaults,
    Page,
    PromptCreate,
    PromptDeleted,
    PromptList,
    PromptUpdate,
    PromptView,
    SourceAck,
    SourceCreate,
    SourceList,
    SourceStatus,
    SourceUpdate,
    SourceView,
    UploadBody,
    UploadResult,
    types_view,
)
from services.gateway.tools.answers import KbAskInput
from services.gateway.tools.compat import (
    DeleteDocumentInput,
    DocResult,
    KnowledgeChunk,
    KnowledgeResult,
    ManageKnowledgeInput,
    ManageKnowledgeOutput,
    MetadataFilter,
    SearchDocsInput,
    SearchDocsOutput,
    SearchKnowledgeBaseInput,
    SearchKnowledgeBaseOutput,
    UploadDocumentInput,
    UploadDocumentOutput,
)
from services.gateway.tools.core import (
    DeleteOutput,
    DeleteSourceOutput,
    DocumentRef,
    KbGetChunkInput,
    KbRef,
    KbSearchInput,
    KbUpdateInput,
    KbUploadInput,
    KbUploadOutput,
    ListDocumentsInput,
    ListKbsInput,
    ReindexInput,
    SetCollectionInput,
    SetCollectionOutput,
    SourceRef,
    UpdateDocumentInput,
)
from services.gateway.tools.sources import (
    KbSourceRef,
    SourceListInput,
    SourceRemoveInput,
    SourceUpdateInput,
)


@dataclass(frozen=True)
class ToolExample:
    """One call of a tool: its arguments and its structured result."""

    input: BaseModel
    output: BaseModel


@dataclass(frozen=True)
class RestExample:
    """One exchange with a REST operation, named by its method and path template."""

    method: str
    path: str
    status: int
    response: BaseModel | dict[str, Any]
    path_params: Mapping[str, str | int] = field(default_factory=dict)
    query: dict[str, Any] = field(default_factory=dict)
    body: BaseModel | None = None


# ---- the story ------------------------------------------------------------------------------

ORG_ID = "acme"
KB_ID = "5f2b8c1e9a4d4e7b8c3f1a6d2e9b7c40"
KB_NAME = "handbook"
DEFAULT_KB_ID = "0c7d3e9f1a2b4c5d8e6f7a9b1c2d3e4f"
DOC_ID = "a3c91e5f7b2d4f6e9c8b1d0e2f4a6c8e"
DOC_NAME = "vacation-policy.md"
DOC_URI = "https://github.com/acme/handbook/blob/main/hr/vacation-policy.md"
TRAVEL_ID = "e71f0a9c3b5d4e2f8a1c6b7d9e0f2a3b"
EXPENSE_ID = "4d8a2c6e0f1b4a3c9e5d7f8b2a1c0e9d"
RUNBOOK_ID = "b5e3f1d7c9a24b6e8f0a1d3c5e7b9f2a"
SCAN_ID = "7c1e9b3d5f0a4c2e8b6d4f1a3c5e7d9b"
SOURCE_ID = "github.com/acme/handbook"
TAGS = ["hr", "policies"]
COLLECTION = "people-ops"
METADATA: dict[str, Any] = {"department": "hr", "effective_date": "2025-01-01", "version": 3}
CREATED = datetime(2025, 3, 14, 9, 30, tzinfo=UTC)
INDEXED = CREATED + timedelta(seconds=2)
UPDATED = CREATED + timedelta(days=6, hours=4)

CHUNKS = [
    "# Vacation policy\n\nThis policy applies to every permanent employee of Acme. Part-time "
    "employees accrue vacation in proportion to their contracted hours.",
    "## Accrual\n\nEmployees accrue 2.5 vacation days per month of service, 30 days a year. "
    "New employees can take vacation from their first month; up to 5 unused days carry over "
    "into the next year.",
    "## Requesting leave\n\nRequest leave in the HR portal at least two weeks ahead for "
    "absences longer than three days. Your manager approves or declines within five working "
    "days.",
]
DOC_TEXT = "\n\n".join(CHUNKS)
QUERY = "How many vacation days do new employees get?"


def chunk_id(index: int, kb_id: str = KB_ID, document_id: str = DOC_ID) -> str:
    return point_id(kb_id, document_id, index)


def hit(
    index: int,
    *,
    score: float | None = None,
    rank: int | None = None,
    similarity: float | None = None,
) -> SearchHit:
    matched = score is not None
    return SearchHit(
        chunk_id=chunk_id(index),
        kb_id=KB_ID,
        document_id=DOC_ID,
        document_name=DOC_NAME,
        source_id=SOURCE_ID,
        uri=DOC_URI,
        chunk_index=index,
        total_chunks=len(CHUNKS),
        content=CHUNKS[index],
        score=score,
        similarity=similarity,
        rank=rank,
        match_type="hybrid" if matched else None,
        tags=[*TAGS, f"kb:{KB_ID}"],
        collection=COLLECTION,
        metadata=METADATA,
        is_matched=matched,
    )


KB_VIEW = KbView(
    kb_id=KB_ID,
    name=KB_NAME,
    description="Company handbook: HR policies, benefits and onboarding",
    tag_ids=TAGS,
    chunker=Chunker.recursive,
    chunk_size=200,
    chunk_overlap=0,
    embedding_model=DEFAULT_MODEL,
    api_base=None,
    coalesce_neighbors=0,
    settings_version=1,
    status=KBStatus.active,
    document_count=12,
    chunk_count=57,
    created_at=CREATED - timedelta(days=30),
    updated_at=CREATED - timedelta(days=30),
)
NEW_KB_VIEW = KB_VIEW.model_copy(
    update={"document_count": 0, "chunk_count": 0, "created_at": CREATED, "updated_at": CREATED}
)
UPDATED_KB_VIEW = KB_VIEW.model_copy(update={"tag_ids": [*TAGS, "benefits"], "updated_at": UPDATED})
DEFAULTS_VIEW = DefaultsView(
    kb=KbDefaults(
        chunker=Chunker.recursive,
        chunk_size=200,
        chunk_overlap=0,
        embedding_model=DEFAULT_MODEL,
        coalesce_neighbors=0,
    ),
    models=[ModelDefaults(embedding_model=DEFAULT_MODEL, max_chunk_size=254, chunk_size=200)],
    limits=LimitsView(
        chunk_size_min=50,
        chunk_size_max=2000,
        coalesce_neighbors_max=5,
        top_k_max=50,
        knowledge_bases_per_org=20,
        tags_per_document=100,
        tag_length=200,
        metadata_bytes=65536,
        uri_length=2048,
        text_bytes=10485760,
    ),
)
HR_KEY = Writer(kind="key", key_id="3f9a1c0b7d2e", name="hr-sync")
DOC_REVISIONS = [
    RevisionWriter(revision=1, writer=HR_KEY, at=CREATED),
    RevisionWriter(revision=2, writer=Writer(kind="local"), at=CREATED + timedelta(days=1)),
]
DOC_VIEW = DocumentView(
    document_id=DOC_ID,
    name=DOC_NAME,
    mime_type="text/markdown",
    source_id=SOURCE_ID,
    uri=DOC_URI,
    tags=["hr", f"kb:{KB_ID}", "policies"],
    collection=COLLECTION,
    metadata=METADATA,
    revision=2,
    status="complete",
    error=None,
    kb_ids=[KB_ID],
    size_bytes=len(DOC_TEXT.encode()),
    writer=DOC_REVISIONS[-1].writer,
    revisions=DOC_REVISIONS,
    created_at=CREATED,
    updated_at=CREATED + timedelta(days=1),
)
SEARCH_ANSWER = SearchResponse(
    query=QUERY,
    mode=Mode.hybrid,
    score_kind="fused",
    kb_ids=[KB_ID],
    coalesced=1,
    hits=[
        hit(0),
        hit(1, score=0.942, rank=1, similarity=0.712),
        hit(2, score=0.611, rank=2, similarity=0.538),
    ],
)
CHUNK_ANSWER = ChunkResponse(
    chunk=hit(1).model_copy(update={"is_matched": True}), neighbors=[hit(0), hit(2)]
)
UPLOAD_BODY = UploadBody(
    name=DOC_NAME,
    content=DOC_TEXT,
    mime_type="text/markdown",
    tags=TAGS,
    collection=COLLECTION,
    metadata=METADATA,
    source_id=SOURCE_ID,
    uri=DOC_URI,
)
PROCESSING = UploadResult(document_id=DOC_ID, name=DOC_NAME, status="processing")

# Answers: a stored extraction prompt over the handbook, and the answer of one run.
PROMPT_ID = "9d2e4f6a8b0c4d1ea3f5b7c9d1e3f5a7"
CHAT_MODEL = "openai/gpt-4o-mini"
VACATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "days_per_year": {"type": "integer"},
        "carry_over_days": {"type": "integer"},
        "sources": {"type": "array", "items": {"type": "string"}, "description": "chunk ids"},
    },
    "required": ["days_per_year", "carry_over_days", "sources"],
}
PROMPT_INSTRUCTIONS = "Extract the vacation allowance. Cite the chunk ids you used in sources."
ASK_ANSWER = AskResponse(
    answer={"days_per_year": 30, "carry_over_days": 5, "sources": [chunk_id(1)]},
    citations=[
        Citation(
            chunk_id=chunk_id(1),
            document_id=DOC_ID,
            document_name=DOC_NAME,
            kb_id=KB_ID,
            chunk_index=1,
        )
    ],
    retrieved=[hit(1, score=0.712, rank=1), hit(2, score=0.538, rank=2)],
    iterations=2,
    searches=[SearchMade(query="vacation days per year carry over", hit_count=2)],
    stopped="answered",
    model=CHAT_MODEL,
    usage=Usage(prompt_tokens=1184, completion_tokens=61),
)
PROMPT_VIEW = PromptView(
    prompt_id=PROMPT_ID,
    name="vacation-allowance",
    instructions=PROMPT_INSTRUCTIONS,
    kb_ids=[KB_ID],
    model=CHAT_MODEL,
    response_schema=VACATION_SCHEMA,
    max_iterations=3,
    created_at=CREATED,
    updated_at=CREATED,
)


# ---- events (contracts/events) --------------------------------------------------------------

EVENT_EXAMPLES: dict[str, Event] = {
    Subject.DOC_UPLOADED: DocUploaded(
        event_id="0f5e2d4c6b8a4e1f9d3c7b5a2e4f6d8c",
        org_id=ORG_ID,
        occurred_at=CREATED,
        document_id=DOC_ID,
        name=DOC_NAME,
        mime_type="text/markdown",
        source_id=SOURCE_ID,
        uri=DOC_URI,
        tags=TAGS,
        collection=COLLECTION,
        metadata=METADATA,
        kb_id=KB_ID,
        content=DOC_TEXT,
    ),
    Subject.DOC_DELETED: DocDeleted(
        event_id="1a6f3e5d7c9b4f2a8e4d6c8b3a5f7e9d",
        org_id=ORG_ID,
        occurred_at=UPDATED,
        document_ids=[DOC_ID],
    ),
    Subject.OCR_DONE: OcrDone(
        event_id="2b7a4f6e8d0c4a3b9f5e7d9c4b6a8f0e",
        org_id=ORG_ID,
        occurred_at=CREATED + timedelta(minutes=3),
        document_id=SCAN_ID,
        ok=True,
        text="Signed employment contract, page 1: annual leave entitlement 30 days.",
    ),
    Subject.TAGS_CHANGED: TagsChanged(
        event_id="3c8b5a7f9e1d4b4c0a6f8e0d5c7b9a1f",
        org_id=ORG_ID,
        occurred_at=UPDATED,
        document_id=DOC_ID,
        tags=["hr", f"kb:{KB_ID}", "policies", f"collection:{COLLECTION}"],
        metadata={**METADATA, "version": 4},
        revision=3,
    ),
    Subject.KB_INDEX: KbIndex(
        event_id="4d9c6b8a0f2e4c5d1b7a9f1e6d8c0b2a",
        org_id=ORG_ID,
        occurred_at=CREATED + timedelta(seconds=1),
        kb_id=KB_ID,
        document_id=DOC_ID,
        revision=1,
    ),
    Subject.KB_REMOVE: KbRemove(
        event_id="5e0d7c9b1a3f4d6e2c8b0a2f7e9d1c3b",
        org_id=ORG_ID,
        occurred_at=UPDATED,
        kb_id=KB_ID,
        document_id=DOC_ID,
        revision=3,
    ),
    Subject.KB_CHANGED: KbChanged(
        event_id="6f1e8d0c2b4a4e7f3d9c1b3a8f0e2d4c",
        org_id=ORG_ID,
        occurred_at=UPDATED,
        kb_id=KB_ID,
        change="tags",
        old_tag_ids=TAGS,
    ),
    Subject.DOC_INDEXED: DocIndexed(
        event_id="7a2f9e1d3c5b4f8a4e0d2c4b9a1f3e5d",
        org_id=ORG_ID,
        occurred_at=INDEXED,
        kb_id=KB_ID,
        document_id=DOC_ID,
        revision=1,
        chunk_count=len(CHUNKS),
    ),
    Subject.DOC_FAILED: DocFailed(
        event_id="8b3a0f2e4d6c4a9b5f1e3d5c0b2a4f6e",
        org_id=ORG_ID,
        occurred_at=CREATED,
        document_id="c2d4e6f8a0b14c3d5e7f9a1b3c5d7e9f",
        revision=1,
        stage="ingest",
        error="unsupported mime_type 'application/zip'",
    ),
    Subject.SOURCE_SYNC: SourceSync(
        event_id="9c4b1a3f5e7d4b0c6a2f4e6d1c3b5a7f",
        org_id=ORG_ID,
        occurred_at=UPDATED,
        source_id="handbook-repo",
        trigger="hook",
    ),
    Subject.SOURCE_RUN: SourceRunEvent(
        event_id="0d5c2b4a6f8e4c1d7b3a5f7e2d4c6b8a",
        org_id=ORG_ID,
        occurred_at=UPDATED + timedelta(seconds=4),
        source_id="handbook-repo",
        kb_id=KB_ID,
        run=SourceRun(
            run_id="1e6d3c5b7a9f4d2e8c4b6a8f3e5d7c9b",
            trigger="hook",
            status="succeeded",
            started_at=UPDATED,
            finished_at=UPDATED + timedelta(seconds=4),
            revision="3f786850e387550fdab836ed7e6dc881de23001b",
            changed=1,
            unchanged=41,
            requests=1,
            bytes_read=2048,
        ),
    ),
}


# ---- tools (contracts/tools) ----------------------------------------------------------------

TRAVEL_URL = "https://intranet.acme.example/policies/travel.html"
EXPENSE_TEXT = (
    "# Expense policy\n\nSubmit receipts in the finance portal within 30 days. Travel is "
    "booked through the travel desk; economy class for flights under six hours."
)
RUNBOOK_URI = "https://wiki.acme.example/sre/payments-oncall"
RUNBOOK_TEXT = (
    "Payments on-call: the primary is paged through PagerDuty rotation 'payments-primary'. "
    "Escalate to the secondary after 15 minutes without acknowledgement."
)


def knowledge_chunk(
    kb_id: str, document_id: str, index: int, score: float | None
) -> KnowledgeChunk:
    return KnowledgeChunk(
        id=point_id(kb_id, document_id, index),
        content=RUNBOOK_TEXT,
        score=score,
        matchType="hybrid" if score is not None else None,
        sourceId="sre-wiki",
        uri=RUNBOOK_URI,
        metadata={"team": "sre"},
        chunkIndex=index,
        totalChunks=1,
    )


# The handbook's git repository, kept in sync with the KB (the source of the events above).
SOURCE_KEY = "handbook-repo"
SOURCE_SPEC = SourceCreate(
    source_id=SOURCE_KEY,
    kind="git",
    kb=KB_NAME,
    url="https://github.com/acme/handbook.git",
    name="handbook repository",
    branch="main",
    include=["hr/**/*.md", "policies/**"],
    exclude=["**/drafts/**"],
    tags=["hr"],
    schedule="30m",
)


def _last_run() -> SourceRun:
    event = EVENT_EXAMPLES[Subject.SOURCE_RUN]
    if not isinstance(event, SourceRunEvent):
        raise TypeError("the source.run example is no SourceRunEvent")
    return event.run


_LAST_RUN = _last_run()
SOURCE_VIEW = SourceView(
    **SOURCE_SPEC.model_dump(exclude={"source_id", "token", "ssh_key"}),
    source_id=SOURCE_KEY,
    kb_id=KB_ID,
    has_credentials=True,
    hook_path=f"/v1/sources/{SOURCE_KEY}/hook",
    created_at=CREATED,
    updated_at=UPDATED,
    status=SourceStatus(
        last_run=_LAST_RUN,
        next_run_at=UPDATED + timedelta(minutes=30),
        runs=[_LAST_RUN],
    ),
)
NEW_SOURCE_VIEW = SOURCE_VIEW.model_copy(
    update={
        "webhook_secret": "Qm9vdHN0cmFwLXNlY3JldC1zaG93bi1vbmNl",
        "updated_at": CREATED,
        "status": SourceStatus(),
    }
)


class PushEvent(BaseModel):
    """The part of a git host's push event the hook looks at (it verifies the whole body)."""

    ref: str
    before: str
    after: str


SYNC_REQUESTED = SourceAck(status="requested", source_id=SOURCE_KEY, trigger="manual")
SOURCE_REMOVED = SourceAck(status="deleted", source_id=SOURCE_KEY, documents_deleted=True)

TOOL_EXAMPLES: dict[str, list[ToolExample]] = {
    "kb_ask": [
        ToolExample(
            KbAskInput(
                question="How many vacation days do employees get, and how many carry over?",
                kb_ids=[KB_NAME],
                model=CHAT_MODEL,
                instructions=PROMPT_INSTRUCTIONS,
                response_schema=VACATION_SCHEMA,
            ),
            ASK_ANSWER,
        ),
        ToolExample(KbAskInput(prompt="vacation-allowance", document_id=DOC_ID), ASK_ANSWER),
    ],
    "kb_search": [
        ToolExample(
            KbSearchInput(
                query=QUERY,
                kb=KB_NAME,
                top_k=2,
                filters=SearchFilters(collection=COLLECTION),
                coalesce_neighbors=1,
            ),
            SEARCH_ANSWER,
        )
    ],
    "kb_get_chunk": [
        ToolExample(KbGetChunkInput(chunk_id=chunk_id(1), kb=KB_NAME, neighbors=1), CHUNK_ANSWER)
    ],
    "kb_upload": [
        ToolExample(
            KbUploadInput(
                kb=KB_NAME,
                name=DOC_NAME,
                content=DOC_TEXT,
                mime_type="text/markdown",
                tags=TAGS,
                collection=COLLECTION,
                metadata=METADATA,
                source_id=SOURCE_ID,
                uri=DOC_URI,
            ),
            KbUploadOutput(
                document_id=DOC_ID,
                name=DOC_NAME,
                status="complete",
                revision=1,
                kb_ids=[KB_ID],
                chunk_count=len(CHUNKS),
                mime_type="text/markdown",
            ),
        ),
        ToolExample(
            KbUploadInput(kb=KB_NAME, url=TRAVEL_URL, tags=["policies", "travel"]),
            KbUploadOutput(
                document_id=TRAVEL_ID,
                name="travel.html",
                status="complete",
                revision=1,
                kb_ids=[KB_ID],
                chunk_count=4,
                mime_type="text/html",
            ),
        ),
    ],
    "kb_delete": [
        ToolExample(
            DocumentRef(document_id=DOC_ID),
            DeleteOutput(
                status="deleted",
                deleted_count=1,
                document_id=DOC_ID,
                title=DOC_NAME,
                message=f"deleted document {DOC_NAME!r} ({DOC_ID})",
            ),
        )
    ],
    "kb_delete_source": [
        ToolExample(
            SourceRef(source_id=SOURCE_ID),
            DeleteSourceOutput(
                status="deleted",
                source_id=SOURCE_ID,
                deleted_count=2,
                document_ids=[DOC_ID, TRAVEL_ID],
                message=f"deleted 2 document(s) of source {SOURCE_ID!r}",
            ),
        )
    ],
    "kb_set_collection": [
        ToolExample(
            SetCollectionInput(document_id=DOC_ID, collection=COLLECTION),
            SetCollectionOutput(
                document_id=DOC_ID, title=DOC_NAME, collection=COLLECTION, revision=2
            ),
        )
    ],
    "kb_update_document": [
        ToolExample(
            UpdateDocumentInput(
                document_id=DOC_ID, tags=[*TAGS, "2025"], metadata={**METADATA, "version": 4}
            ),
            DOC_VIEW.model_copy(
                update={
                    "tags": ["2025", "hr", f"kb:{KB_ID}", "policies"],
                    "metadata": {**METADATA, "version": 4},
                    "revision": 3,
                    "updated_at": UPDATED,
                }
            ),
        )
    ],
    "kb_list_documents": [
        ToolExample(
            ListDocumentsInput(kb=KB_NAME, collection=COLLECTION, limit=20),
            Page[DocumentView](items=[DOC_VIEW], total=1, skip=0, limit=20),
        )
    ],
    "kb_list": [
        ToolExample(
            ListKbsInput(name_search="hand"),
            KbList(items=[KB_VIEW], total=1, skip=0, limit=50),
        )
    ],
    "kb_create": [
        ToolExample(
            KbCreate(
                name=KB_NAME,
                description=KB_VIEW.description,
                tag_ids=TAGS,
                chunk_size=200,
            ),
            NEW_KB_VIEW,
        )
    ],
    "kb_update": [
        ToolExample(KbUpdateInput(kb=KB_NAME, tag_ids=[*TAGS, "benefits"]), UPDATED_KB_VIEW)
    ],
    "kb_stats": [
        ToolExample(
            KbRef(kb=KB_NAME),
            KbStats(
                kb_id=KB_ID,
                document_count=12,
                chunk_count=57,
                total_documents_with_tags=13,
                failed_count=1,
                pending_count=0,
                progress=KbProgress(total=13, indexed=12, pending=0, failed=1, reindex=None),
            ),
        )
    ],
    "kb_reindex": [
        ToolExample(
            ReindexInput(kb=KB_NAME, failed_only=True),
            Ack(status="reindexing", kb_id=KB_ID, documents=13),
        )
    ],
    "search_docs": [
        ToolExample(
            SearchDocsInput(query="parental leave", projectId=KB_NAME, topK=3, minScore=0.5),
            SearchDocsOutput(
                results=[
                    DocResult(content=CHUNKS[1], documentTitle=DOC_NAME, chunkIndex=1, score=0.644)
                ]
            ),
        )
    ],
    "upload_document": [
        ToolExample(
            UploadDocumentInput(
                projectId=KB_NAME,
                fileName="expense-policy.md",
                content=EXPENSE_TEXT,
                mimeType="text/markdown",
            ),
            UploadDocumentOutput(
                documentId=EXPENSE_ID,
                fileName="expense-policy.md",
                status="complete",
                chunkCount=1,
            ),
        )
    ],
    "delete_document": [
        ToolExample(
            DeleteDocumentInput(filepath=DOC_URI),
            DeleteOutput(
                status="deleted",
                deleted_count=1,
                document_id=DOC_ID,
                title=DOC_NAME,
                message=f"deleted document {DOC_NAME!r} ({DOC_ID})",
            ),
        )
    ],
    "manageKnowledge": [
        ToolExample(
            ManageKnowledgeInput(
                operation="ingest",
                content=RUNBOOK_TEXT,
                uri=RUNBOOK_URI,
                sourceId="sre-wiki",
                metadata={"team": "sre"},
            ),
            ManageKnowledgeOutput(
                operation="ingest",
                message="Successfully ingested document into 1 chunks",
                documentId=RUNBOOK_ID,
                chunksCreated=1,
                chunkIds=[point_id(DEFAULT_KB_ID, RUNBOOK_ID, 0)],
                uri=RUNBOOK_URI,
                sourceId="sre-wiki",
            ),
        ),
        ToolExample(
            ManageKnowledgeInput(operation="search", query="who is on call for payments?", limit=5),
            ManageKnowledgeOutput(
                operation="search",
                message="Found 1 matching chunks",
                chunks=[knowledge_chunk(DEFAULT_KB_ID, RUNBOOK_ID, 0, 0.681)],
                totalMatches=1,
                query="who is on call for payments?",
            ),
        ),
        ToolExample(
            ManageKnowledgeInput(
                operation="getChunk", chunkId=point_id(DEFAULT_KB_ID, RUNBOOK_ID, 0)
            ),
            ManageKnowledgeOutput(
                operation="getChunk",
                message="chunk found",
                chunk=knowledge_chunk(DEFAULT_KB_ID, RUNBOOK_ID, 0, None),
            ),
        ),
        ToolExample(
            ManageKnowledgeInput(operation="deleteBySource", sourceId="sre-wiki"),
            ManageKnowledgeOutput(
                operation="deleteBySource",
                message="deleted 1 document(s) of source 'sre-wiki'",
                sourceId="sre-wiki",
                deletedCount=1,
            ),
        ),
    ],
    "search_knowledge_base": [
        ToolExample(
            SearchKnowledgeBaseInput(
                query=QUERY,
                top_k=2,
                coalesce_neighbors=1,
                metadata_filter=MetadataFilter(tag_ids=["policies"]),
                upload_date_from=datetime(2025, 1, 1, tzinfo=UTC),
            ),
            SearchKnowledgeBaseOutput(
                results=[
                    KnowledgeResult(
                        content=h.content,
                        source=h.document_name,
                        relevance=h.score,
                        is_matched=h.is_matched,
                        chunk_index=h.chunk_index,
                    )
                    for h in SEARCH_ANSWER.hits
                ],
                query=QUERY,
                sources_searched=2,
                coalesced=1,
            ),
        )
    ],
    "kb_source_list": [
        ToolExample(SourceListInput(kb=KB_NAME), SourceList(items=[SOURCE_VIEW], total=1))
    ],
    "kb_source_get": [ToolExample(KbSourceRef(source=SOURCE_KEY), SOURCE_VIEW)],
    "kb_source_add": [
        ToolExample(SOURCE_SPEC.model_copy(update={"token": "github_pat_11AC0"}), NEW_SOURCE_VIEW)
    ],
    "kb_source_update": [
        ToolExample(
            SourceUpdateInput(source=SOURCE_KEY, schedule="0 */2 * * *"),
            SOURCE_VIEW.model_copy(update={"schedule": "0 */2 * * *"}),
        )
    ],
    "kb_source_sync": [ToolExample(KbSourceRef(source=SOURCE_KEY), SYNC_REQUESTED)],
    "kb_source_remove": [ToolExample(SourceRemoveInput(source=SOURCE_KEY), SOURCE_REMOVED)],
}


# ---- REST (contracts/rest/examples) ---------------------------------------------------------

KB_PATH = {"kb": KB_NAME}
DOC_PATH = {"document_id": DOC_ID}
KB_DOCUMENT = KbDocumentView(
    document_id=DOC_ID,
    name=DOC_NAME,
    source_id=SOURCE_ID,
    uri=DOC_URI,
    status="complete",
    tags=TAGS,
    collection=COLLECTION,
    chunk_count=len(CHUNKS),
    indexed_at=INDEXED,
    revision=1,
)

DEAD_LETTER = DeadLetterView(
    sequence=7,
    subject="doc.uploaded",
    error_type="ValidationError",
    error="knowledge base 'benefits' not found",
    delivered=1,
    time=INDEXED,
    document_id=DOC_ID,
    kb_id="benefits",
    name=DOC_NAME,
)

# GET /api/v1/tools and POST /api/v1/tools/{name} are derived from the tools registry and the
# tool examples by the export (services/contracts/export.py).
REST_EXAMPLES: list[RestExample] = [
    RestExample("GET", "/healthz", 200, {"status": "ok"}),
    RestExample(
        "GET",
        "/readyz",
        200,
        {"status": "ready", "nats": True, "services": ["ingest", "embed", "search", "gateway"]},
    ),
    RestExample(
        "POST",
        "/v1/kbs",
        201,
        NEW_KB_VIEW,
        body=KbCreate(name=KB_NAME, description=KB_VIEW.description, tag_ids=TAGS),
    ),
    RestExample(
        "GET",
        "/v1/kbs",
        200,
        KbList(items=[KB_VIEW], total=1, skip=0, limit=20),
        query={"limit": 20},
    ),
    RestExample("GET", "/v1/kbs/{kb}", 200, KB_VIEW, path_params=KB_PATH),
    RestExample("GET", "/v1/defaults", 200, DEFAULTS_VIEW),
    RestExample(
        "PATCH",
        "/v1/kbs/{kb}",
        200,
        UPDATED_KB_VIEW,
        path_params=KB_PATH,
        body=KbUpdate(tag_ids=[*TAGS, "benefits"]),
    ),
    RestExample(
        "DELETE", "/v1/kbs/{kb}", 200, Ack(status="deleted", kb_id=KB_ID), path_params=KB_PATH
    ),
    RestExample(
        "POST",
        "/v1/kbs/{kb}/reindex",
        202,
        Ack(status="reindexing", kb_id=KB_ID, documents=13),
        path_params=KB_PATH,
    ),
    RestExample(
        "POST",
        "/v1/kbs/{kb}/reindex/cancel",
        200,
        Ack(status="cancelled", kb_id=KB_ID),
        path_params=KB_PATH,
    ),
    RestExample(
        "POST",
        "/v1/kbs/{kb}/retry-failed",
        202,
        Ack(status="reindexing", kb_id=KB_ID, documents=13),
        path_params=KB_PATH,
    ),
    RestExample(
        "GET", "/v1/kbs/{kb}/stats", 200, TOOL_EXAMPLES["kb_stats"][0].output, path_params=KB_PATH
    ),
    RestExample(
        "GET",
        "/v1/kbs/{kb}/documents",
        200,
        Page[KbDocumentView](items=[KB_DOCUMENT], total=1, skip=0, limit=50),
        path_params=KB_PATH,
        query={"name_search": "vacation"},
    ),
    RestExample(
        "POST",
        "/v1/kbs/{kb}/documents",
        202,
        PROCESSING,
        path_params=KB_PATH,
        body=UPLOAD_BODY,
    ),
    RestExample(
        "POST",
        "/v1/documents",
        202,
        PROCESSING,
        body=UPLOAD_BODY.model_copy(update={"kb_id": KB_NAME}),
    ),
    RestExample(
        "GET",
        "/v1/documents",
        200,
        Page[DocumentView](items=[DOC_VIEW], total=1, skip=0, limit=50),
        query={"tag": "policies", "collection": COLLECTION},
    ),
    RestExample(
        "DELETE",
        "/v1/documents",
        200,
        DeleteResult(status="deleted", deleted_count=2, document_ids=[DOC_ID, TRAVEL_ID]),
        query={"source_id": SOURCE_ID},
    ),
    RestExample("GET", "/v1/documents/{document_id}", 200, DOC_VIEW, path_params=DOC_PATH),
    RestExample(
        "PATCH",
        "/v1/documents/{document_id}",
        200,
        DOC_VIEW,
        path_params=DOC_PATH,
        body=DocumentPatch(collection=COLLECTION),
    ),
    RestExample(
        "DELETE",
        "/v1/documents/{document_id}",
        200,
        DeleteResult(status="deleted", deleted_count=1, document_id=DOC_ID, title=DOC_NAME),
        path_params=DOC_PATH,
    ),
    RestExample(
        "POST",
        "/v1/search",
        200,
        SEARCH_ANSWER,
        body=SearchQuery(
            query=QUERY,
            kb_ids=[KB_NAME],
            top_k=2,
            filters=SearchFilters(collection=COLLECTION, source_ids=[SOURCE_ID]),
            coalesce_neighbors=1,
        ),
    ),
    RestExample(
        "POST",
        "/v1/ask",
        200,
        ASK_ANSWER,
        body=AskQuery(
            question="How many vacation days do employees get, and how many carry over?",
            kb_ids=[KB_NAME],
            model=CHAT_MODEL,
            instructions=PROMPT_INSTRUCTIONS,
            response_schema=VACATION_SCHEMA,
        ),
    ),
    RestExample(
        "POST",
        "/v1/prompts",
        201,
        PROMPT_VIEW,
        body=PromptCreate(
            name="vacation-allowance",
            instructions=PROMPT_INSTRUCTIONS,
            kb_ids=[KB_NAME],
            model=CHAT_MODEL,
            response_schema=VACATION_SCHEMA,
            max_iterations=3,
        ),
    ),
    RestExample("GET", "/v1/prompts", 200, PromptList(items=[PROMPT_VIEW], total=1)),
    RestExample("GET", "/v1/prompts/{prompt}", 200, PROMPT_VIEW, path_params={"prompt": PROMPT_ID}),
    RestExample(
        "PATCH",
        "/v1/prompts/{prompt}",
        200,
        PROMPT_VIEW.model_copy(update={"max_iterations": 5, "updated_at": UPDATED}),
        path_params={"prompt": "vacation-allowance"},
        body=PromptUpdate(max_iterations=5),
    ),
    RestExample(
        "DELETE",
        "/v1/prompts/{prompt}",
        200,
        PromptDeleted(prompt_id=PROMPT_ID),
        path_params={"prompt": PROMPT_ID},
    ),
    RestExample(
        "POST",
        "/v1/prompts/{prompt}/run",
        200,
        ASK_ANSWER,
        path_params={"prompt": "vacation-allowance"},
        body=AskTask(document_id=DOC_ID),
    ),
    RestExample(
        "GET",
        "/v1/chunks/{chunk_id}",
        200,
        CHUNK_ANSWER,
        path_params={"chunk_id": chunk_id(1)},
        query={"kb": KB_NAME, "neighbors": 1},
    ),
    RestExample(
        "GET",
        "/v1/dead-letters",
        200,
        DeadLetterList(items=[DEAD_LETTER], total=1),
        query={"subject": "doc.uploaded"},
    ),
    RestExample(
        "GET",
        "/v1/audit",
        200,
        AuditList(
            items=[
                AuditEntry(
                    event_id="0b6f3e0c5a7d4e21b9c8a1f2d3e4f5a6.doc-handbook",
                    org_id="acme",
                    occurred_at=CREATED,
                    kind="document",
                    action="uploaded",
                    writer=HR_KEY,
                    document_id=DOC_ID,
                    kb_id=KB_ID,
                    kb_ids=[KB_ID],
                    revision=1,
                    name=DOC_NAME,
                )
            ],
            total=1,
        ),
        query={"writer": HR_KEY.key_id or "", "kind": "document"},
    ),
    RestExample(
        "GET",
        "/v1/sign-in",
        200,
        SignIn(
            issuer="https://login.example.com/realms/acme",
            client_id="kbmesh",
            resource="https://kb.example.com/mcp",
            scopes=["openid", "profile", "email", "kb:read", "kb:write", "kb:admin"],
        ),
    ),
    RestExample(
        "POST",
        "/v1/dead-letters/{sequence}/replay",
        202,
        DEAD_LETTER,
        path_params={"sequence": DEAD_LETTER.sequence},
    ),
    RestExample(
        "GET",
        "/v1/dead-letters/{sequence}",
        200,
        DeadLetterBody(
            **DEAD_LETTER.model_dump(),
            body=DocUploaded(
                event_id="3c1d9e7f0a2b4c6d8e0f1a3b5c7d9e1f",
                org_id=ORG_ID,
                document_id=DOC_ID,
                name=DOC_NAME,
                content=CHUNKS[0],
                kb_id="benefits",
                occurred_at=CREATED,
            ).model_dump_json(exclude_none=True),
            body_encoding="text",
            body_truncated=False,
        ),
        path_params={"sequence": DEAD_LETTER.sequence},
    ),
    RestExample(
        "DELETE",
        "/v1/dead-letters/{sequence}",
        200,
        DEAD_LETTER,
        path_params={"sequence": DEAD_LETTER.sequence},
    ),
    RestExample("GET", "/v1/types", 200, types_view()),
    RestExample("POST", "/v1/sources", 201, NEW_SOURCE_VIEW, body=SOURCE_SPEC),
    RestExample(
        "GET",
        "/v1/sources",
        200,
        SourceList(items=[SOURCE_VIEW], total=1),
        query={"kb": KB_NAME},
    ),
    RestExample(
        "GET", "/v1/sources/{source}", 200, SOURCE_VIEW, path_params={"source": SOURCE_KEY}
    ),
    RestExample(
        "PATCH",
        "/v1/sources/{source}",
        200,
        SOURCE_VIEW.model_copy(update={"enabled": False}),
        path_params={"source": SOURCE_KEY},
        body=SourceUpdate(enabled=False),
    ),
    RestExample(
        "DELETE", "/v1/sources/{source}", 200, SOURCE_REMOVED, path_params={"source": SOURCE_KEY}
    ),
    RestExample(
        "POST",
        "/v1/sources/{source}/sync",
        202,
        SYNC_REQUESTED,
        path_params={"source": SOURCE_KEY},
    ),
    RestExample(
        "POST",
        "/v1/sources/{source}/hook",
        202,
        SYNC_REQUESTED.model_copy(update={"trigger": "hook"}),
        path_params={"source": SOURCE_KEY},
        body=PushEvent(
            ref="refs/heads/main",
            before="9a1c3e5f7b9d1f3a5c7e9b1d3f5a7c9e1b3d5f7a",
            after="3f786850e387550fdab836ed7e6dc881de23001b",
        ),
    ),
]
