"""Request and response bodies of the gateway's REST surface (and the MCP tools on top)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.bus.audit import AuditEntry
from services.common.domain.content import SUPPORTED
from services.common.domain.formats import FORMATS, readable_types
from services.common.domain.ids import ID_PATTERN
from services.common.domain.limits import TAGS_PER_DOCUMENT, KbTag, PlainText
from services.common.domain.models import (
    CHUNK_SIZE_RANGE,
    DEFAULT_MODEL,
    DEFAULT_SOURCE,
    MAX_NEIGHBORS,
    Chunker,
    KBStatus,
    RevisionWriter,
    Writer,
)
from services.common.domain.sources import RunTrigger, SourceRun, SourceSpec
from services.common.messages.answers import AskOptions

T = TypeVar("T")


MIME_TYPES = ", ".join(SUPPORTED)


class DocumentFields(BaseModel):
    """What every upload carries besides its content: the document's name, declared type and
    labels (a JSON body's fields, a multipart form's fields, a raw body's query parameters)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="document title or file name; required with content, taken from the "
        "file, url or path otherwise",
    )
    mime_type: str | None = Field(
        None,
        description=f"one of {MIME_TYPES} (images wait for OCR); a hint: the server reads "
        "the type from the bytes and the name. Omitted: what the file name suggests (text/plain "
        "for text content it does not explain), or with a file, url or path the type it "
        "comes with",
    )
    tags: list[str] = Field(
        default_factory=list,
        description="labels; the document joins every KB whose tag_ids include one of them",
    )
    collection: str | None = Field(None, description="an exclusive label: at most one per document")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="custom fields, filterable in search"
    )
    source_id: str = Field(
        DEFAULT_SOURCE,
        min_length=1,
        max_length=256,
        description="provenance group, e.g. a repository; deleting a source deletes its documents",
    )
    uri: str | None = Field(None, description="where the document lives, shown with search results")
    document_id: str | None = Field(
        None, pattern=ID_PATTERN, description="replace this document (new revision)"
    )


class UploadFields(DocumentFields):
    """A document to add: its content, or a url or server path to read it from, and its
    labels (shared by REST uploads and the kb_upload tool)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["content", "name"],
                    "properties": {"content": {"type": "string"}, "name": {"type": "string"}},
                },
                {"required": ["url"], "properties": {"url": {"type": "string"}}},
                {"required": ["path"], "properties": {"path": {"type": "string"}}},
            ]
        },
    )

    content: str | None = Field(
        None,
        description="the document: text, or base64 when content_encoding is base64 (files are "
        "better sent as multipart/form-data or as the raw body: no base64)",
    )
    content_encoding: Literal["text", "base64"] = Field(
        "text", description="how content is encoded"
    )
    url: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="an http(s) URL for the server to fetch instead of sending content "
        "(public addresses only, unless allow-listed)",
    )
    path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="a file on the kbmesh server, relative to its upload root "
        "(KBMESH_UPLOAD_ROOT), instead of sending content",
    )

    @model_validator(mode="after")
    def _one_source(self) -> UploadFields:
        given = [n for n in ("content", "url", "path") if getattr(self, n) is not None]
        if len(given) != 1:
            got = f" (got {', '.join(given)})" if given else ""
            raise ValueError(f"give exactly one of content, url or path{got}")
        if self.content is not None and not self.name:
            raise ValueError("name is required with content")
        return self


_KB_ID = Field(None, description="KB id or name: direct membership")
_REPLACE_SAME_URI = Field(
    False,
    description="replace the document with the same uri (in the KB uploaded into, else "
    "among all you can see) with a new revision instead of adding another",
)


class UploadBody(UploadFields):
    kb_id: str | None = _KB_ID
    replace_same_uri: bool = _REPLACE_SAME_URI


class FileFields(DocumentFields):
    """The fields of a file upload: the form fields beside the file part of a multipart
    body, or the query parameters of a raw body. `tags` may be given several times;
    `metadata` is a JSON object."""

    kb_id: str | None = _KB_ID
    replace_same_uri: bool = _REPLACE_SAME_URI


class UploadResult(BaseModel):
    document_id: str
    name: str
    status: Literal["processing", "complete", "awaiting_ocr", "failed", "stored"] = Field(
        description="processing: accepted, not yet searchable; complete: searchable; "
        "awaiting_ocr: scanned, waits for OCR; failed: see error; stored: in no KB"
    )
    mime_type: str | None = Field(
        None,
        description="the type the document was read as; while it is processing, the type "
        "declared (null when none was: the server reads it from the bytes and the name)",
    )
    revision: int | None = None
    kb_ids: list[str] = Field(default_factory=list)
    chunk_count: int | None = None
    error: str | None = None


class KbSettingsFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: PlainText | None = Field(
        None, max_length=2000, description="what the knowledge base holds, for people and agents"
    )
    tag_ids: list[KbTag] | None = Field(
        None,
        max_length=TAGS_PER_DOCUMENT,
        description="documents carrying any of these tags are members automatically "
        f"(besides those uploaded into it); at most {TAGS_PER_DOCUMENT}",
    )
    chunker: Chunker | None = Field(
        None,
        description="how text is cut: recursive (default: paragraphs, then sentences, then "
        "words), sentence, or token (fixed token windows)",
    )
    chunk_size: int | None = Field(
        None,
        ge=CHUNK_SIZE_RANGE[0],
        le=CHUNK_SIZE_RANGE[1],
        description="tokens per chunk (default 200; at most the embedding model's input limit)",
    )
    chunk_overlap: int | None = Field(
        None, ge=0, description="tokens shared by neighbouring chunks (default 0)"
    )
    embedding_model: PlainText | None = Field(
        None,
        min_length=1,
        description=f"{DEFAULT_MODEL} (default, bundled) or any LiteLLM model id, e.g. "
        "openai/text-embedding-3-small; changing it re-indexes every document",
    )
    api_base: str | None = Field(
        None,
        description="base URL of the embedding provider (self-hosted or OpenAI-compatible "
        "servers); null: the provider's default",
    )
    coalesce_neighbors: int | None = Field(
        None,
        ge=0,
        le=MAX_NEIGHBORS,
        description="neighbour chunks added on each side of a search match by default (0-5)",
    )

    rerank_model: PlainText | None = Field(
        None,
        min_length=1,
        description="a LiteLLM rerank model (cohere/rerank-v3.5, jina_ai/..., voyage/..., or "
        "one served by TEI via rerank_api_base) that reorders the best search candidates; "
        "null turns reranking off (the default)",
    )
    rerank_api_base: str | None = Field(
        None, description="the rerank model's server, if not its provider's"
    )


KB_NAME = r"^[^\s/][^/]*$"


class KbCreate(KbSettingsFields):
    name: PlainText = Field(
        min_length=1,
        max_length=100,
        pattern=KB_NAME,
        description="a name unique in your org (no '/'); tools and routes take it or the id",
    )


class KbUpdate(KbSettingsFields):
    name: PlainText | None = Field(
        None,
        min_length=1,
        max_length=100,
        pattern=KB_NAME,
        description="a new name, unique in your org (no '/')",
    )


class KbView(BaseModel):
    kb_id: str
    name: str
    description: str
    tag_ids: list[str]
    chunker: Chunker
    chunk_size: int
    chunk_overlap: int
    embedding_model: str
    api_base: str | None
    coalesce_neighbors: int
    rerank_model: str | None = None
    rerank_api_base: str | None = None
    settings_version: int
    status: KBStatus
    document_count: int
    chunk_count: int
    created_at: datetime
    updated_at: datetime


class KbDefaults(BaseModel):
    """What a knowledge base created with no settings gets."""

    chunker: Chunker
    chunk_size: int = Field(description="tokens per chunk for `embedding_model`")
    chunk_overlap: int
    embedding_model: str
    coalesce_neighbors: int


class ModelDefaults(BaseModel):
    embedding_model: str
    max_chunk_size: int = Field(description="the largest chunk_size the model takes in one input")
    chunk_size: int = Field(description="the chunk_size a KB on this model gets by default")


class LimitsView(BaseModel):
    chunk_size_min: int
    chunk_size_max: int = Field(description="for any model; each model's own is in `models`")
    coalesce_neighbors_max: int
    top_k_max: int
    knowledge_bases_per_org: int
    tags_per_document: int
    tag_length: int
    metadata_bytes: int
    uri_length: int
    text_bytes: int = Field(description="a document's text after extraction, UTF-8")


class DefaultsView(BaseModel):
    """Defaults and limits from the server, so that no client keeps a copy that can drift."""

    kb: KbDefaults
    models: list[ModelDefaults] = Field(description="the bundled models, and the default one")
    limits: LimitsView


class KbList(BaseModel):
    items: list[KbView]
    total: int
    skip: int
    limit: int


class ReindexProgress(BaseModel):
    settings_version: int = Field(description="the settings version being built")
    done: int = Field(description="documents already rebuilt with it")
    total: int = Field(description="documents to rebuild (failed ones left out)")


class KbProgress(BaseModel):
    total: int = Field(description="documents whose tags match the knowledge base")
    indexed: int = Field(description="searchable at their current revision")
    pending: int = Field(description="waiting to be extracted, OCRed or indexed")
    failed: int = Field(description="failed to extract or to index here")
    reindex: ReindexProgress | None = Field(
        description="the latest reindex (done = total once finished); null when none was "
        "asked for since the last one was cancelled, or ever"
    )


class KbStats(BaseModel):
    kb_id: str
    document_count: int
    chunk_count: int
    total_documents_with_tags: int
    failed_count: int
    pending_count: int
    progress: KbProgress


class DocumentView(BaseModel):
    document_id: str
    name: str
    mime_type: str
    source_id: str
    uri: str | None
    source_revision: str | None = Field(
        None,
        description="for a document a source keeps in sync: the source's version of it (the "
        "commit it was read at, the page's ETag)",
    )
    tags: list[str]
    collection: str | None
    metadata: dict[str, Any]
    revision: int
    status: str
    error: str | None
    kb_ids: list[str]
    size_bytes: int
    content_checksum: str | None = Field(
        None,
        description="sha256 of the bytes as uploaded: compare with a local file's to skip "
        "uploading it again",
    )
    writer: Writer | None = Field(
        None,
        description="who wrote the current revision: an API key (id and name), `local` "
        "(keyless loopback), `bus` (an upstream publisher), `operator`, or `source` (a "
        "source kbmesh keeps in sync, by its id)",
    )
    revisions: list[RevisionWriter] = Field(
        default_factory=list, description="who wrote each kept revision, and when, oldest first"
    )
    created_at: datetime
    updated_at: datetime


class AuditList(BaseModel):
    items: list[AuditEntry] = Field(description="oldest first")
    total: int = Field(description="entries in this answer")
    skipped: int = Field(
        0,
        description="entries left out because they could not be trusted: not an audit entry, "
        "or naming another org or kind than where they were recorded",
    )


KbDocumentStatus = Literal["complete", "processing", "pending_reindex", "failed", "awaiting_ocr"]


class KbDocumentView(BaseModel):
    document_id: str
    name: str
    source_id: str
    uri: str | None = Field(None, description="where it came from (a path, a URL), if given")
    status: str
    error: str | None = Field(None, description="why it failed, when it did")
    tags: list[str] = Field(default_factory=list)
    collection: str | None = None
    chunk_count: int
    indexed_at: datetime | None
    revision: int


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    skip: int
    limit: int


class DocumentPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: list[str] | None = None
    collection: str | None = Field(None, description="set; use clear_collection to remove")
    clear_collection: bool = False
    metadata: dict[str, Any] | None = None


class DeleteResult(BaseModel):
    status: Literal["deleted", "not_found"]
    deleted_count: int
    document_id: str | None = None
    title: str | None = None
    document_ids: list[str] = Field(default_factory=list)


class Ack(BaseModel):
    status: str
    kb_id: str | None = None
    documents: int | None = None


class ProblemFieldError(BaseModel):
    """One field at fault in a refused request (REST problems and tool errors alike)."""

    field: str = Field(description="the request part at fault: a body field path, or a parameter")
    message: str


# ---- stored prompts -------------------------------------------------------------------------

PROMPT_NAME = r"^[^\s/][^/]*$"


class PromptCreate(AskOptions):
    name: PlainText = Field(
        min_length=1, max_length=100, pattern=PROMPT_NAME, description="unique in the org"
    )


class PromptUpdate(AskOptions):
    """Only the fields given change; null clears an optional field."""

    name: PlainText | None = Field(None, min_length=1, max_length=100, pattern=PROMPT_NAME)


class PromptView(AskOptions):
    prompt_id: str
    name: str
    created_at: datetime
    updated_at: datetime


class PromptList(BaseModel):
    items: list[PromptView]
    total: int


class PromptDeleted(BaseModel):
    status: Literal["deleted"] = "deleted"
    prompt_id: str


class DeadLetterView(BaseModel):
    sequence: int = Field(description="the dead letter's id: pass it to replay")
    subject: str = Field(description="the subject the message was published on")
    error_type: str
    error: str = Field(description="why it could not be processed")
    delivered: int = Field(description="delivery attempts before it was set aside")
    time: datetime | None = Field(description="when it was dead-lettered")
    document_id: str | None = None
    kb_id: str | None = None
    name: str | None = Field(None, description="the document's name, for uploads")


class DeadLetterBody(DeadLetterView):
    body: str = Field(description="the message as it was published (UTF-8 text or base64)")
    body_encoding: Literal["text", "base64"]
    body_truncated: bool = Field(description="the body is longer than what is shown")


class DeadLetterList(BaseModel):
    items: list[DeadLetterView]
    total: int = Field(description="the caller's dead letters in all (of `subject`, if given)")
    next: int | None = Field(
        None, description="more follow: pass this as `after` to read the next page"
    )
    without_org: int = Field(
        0,
        description="dead letters that name no org (not kbmesh events: malformed input), "
        "which no org sees here; operators list them with `kbmesh dlq list`",
    )


class FormatView(BaseModel):
    name: str
    kind: str = Field(
        description="how its text is read: text, markdown, code, document (converted to "
        "markdown) or image (waits for OCR)"
    )
    mime_types: list[str]
    extensions: list[str]
    binary: bool = Field(description="bytes rather than text: send it base64-encoded")


class TypesView(BaseModel):
    formats: list[FormatView]
    mime_types: list[str] = Field(description="every media type an upload may declare")
    extensions: list[str] = Field(
        description="every file extension read (a trailing .gz is undone first)"
    )


def types_view() -> TypesView:
    """What `GET /v1/types` answers: every format of services/common/domain/formats.py."""
    return TypesView(
        formats=[
            FormatView(
                name=f.name,
                kind=f.kind,
                mime_types=list(f.mime_types),
                extensions=list(f.extensions),
                binary=f.binary,
            )
            for f in FORMATS
        ],
        **readable_types(),
    )


# ---- sources --------------------------------------------------------------------------------

_TOKEN = Field(
    None,
    min_length=1,
    max_length=4096,
    description="git over https: an access token (write-only: stored apart, never shown again)",
)
_SSH_KEY = Field(
    None,
    min_length=1,
    max_length=16384,
    description="git over ssh: a private key in OpenSSH format (write-only, never shown again)",
)


class SourceCreate(SourceSpec):
    """A new source: its definition, an optional stable id, and its git credentials."""

    source_id: str | None = Field(
        None,
        pattern=ID_PATTERN,
        description="a stable id of your choosing (`kbmesh sources apply` sets one per "
        "declared source); default: a generated one",
    )
    token: str | None = _TOKEN
    ssh_key: str | None = _SSH_KEY


class SourceUpdate(BaseModel):
    """What changes in a source: only the fields given (null puts an optional one back to
    its default). A source's kind is fixed: to change it, remove the source and add another."""

    model_config = ConfigDict(extra="forbid")

    kb: str | None = Field(
        None, min_length=1, max_length=200, description="move it to feed this KB (id or name)"
    )
    url: str | None = Field(
        None, min_length=1, max_length=2000, description="the git remote or the start URL"
    )
    name: str | None = Field(None, max_length=200, description="a label")
    tags: list[str] | None = Field(None, description="tags its documents get")
    collection: str | None = Field(None, description="the collection its documents are in")
    schedule: str | None = Field(
        None, description="an interval (30m, 1h, 1d) or a five-field cron expression"
    )
    enabled: bool | None = Field(None, description="false: pause its schedule")
    include: list[str] | None = Field(None, description="globs of what to read; []: all")
    exclude: list[str] | None = Field(None, description="globs left out")
    branch: str | None = Field(None, max_length=255, description="git: branch or tag")
    sitemap: str | None = Field(None, max_length=2000, description="web: a sitemap.xml URL")
    start_urls: list[str] | None = Field(None, description="web: more start URLs")
    scope: str | None = Field(
        None, max_length=2000, description="web: the URL prefix pages must start with"
    )
    max_depth: int | None = Field(None, ge=0, le=50, description="web: link depth")
    max_pages: int | None = Field(None, ge=1, le=100_000, description="web: pages per run")
    rate: float | None = Field(None, gt=0, le=100, description="web: requests per second per host")
    removal_grace: str | None = Field(
        None, description="web: how long a page must be gone before its document is deleted"
    )
    token: str | None = _TOKEN
    ssh_key: str | None = _SSH_KEY
    clear_credentials: bool = Field(False, description="forget the stored token and key")
    rotate_webhook_secret: bool = Field(
        False,
        description="replace the webhook secret: the answer shows the new one, once; calls "
        "signed with the old one are refused from then on",
    )


class SourceStatus(BaseModel):
    """Where a source's sync stands, as the sources service last recorded it."""

    last_run: SourceRun | None = None
    next_run_at: datetime | None = Field(None, description="when the schedule runs it next")
    requested: RunTrigger | None = Field(
        None, description="a sync asked for (manual or webhook) that no run has taken yet"
    )
    runs: list[SourceRun] = Field(default_factory=list, description="recent runs, newest last")


class SourceView(SourceSpec):
    """A source as clients see it: its definition, ids, whether credentials are stored (never
    the credentials), its webhook's path, and its sync status."""

    model_config = ConfigDict(extra="forbid")

    source_id: str
    kb_id: str
    has_credentials: bool = Field(description="a git token or key is stored (never shown)")
    hook_path: str = Field(
        description="where the git host posts push events (POST, signed with the webhook "
        "secret): append it to the gateway's public address"
    )
    webhook_secret: str | None = Field(
        None,
        description="the webhook's secret (HMAC-SHA256 key, or token for a token header): "
        "shown only in the answer that creates it (create, rotate_webhook_secret)",
    )
    created_at: datetime
    updated_at: datetime
    status: SourceStatus


class SourceList(BaseModel):
    items: list[SourceView]
    total: int


class SourceAck(BaseModel):
    """What a request about a source's runs or removal did."""

    status: Literal["requested", "deleted", "ignored", "pong"] = Field(
        description="requested: a sync was asked of the sources service; deleted: the source "
        "is gone; ignored: a webhook call about another branch; pong: a webhook's ping"
    )
    source_id: str
    trigger: RunTrigger | None = None
    documents_deleted: bool | None = Field(
        None, description="on removal: whether its documents are being deleted too"
    )
