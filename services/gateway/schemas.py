"""Request and response bodies of the gateway's REST surface (and the MCP tools on top)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from services.common.answers import AskOptions
from services.common.models import DEFAULT_SOURCE, Chunker, KBStatus
from services.common.settings import DEFAULT_MODEL

T = TypeVar("T")


class UploadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=512, description="document title or file name")
    content: str = Field(description="the document: text, or base64 when content_encoding=base64")
    content_encoding: Literal["text", "base64"] = "text"
    mime_type: str = Field(
        "text/plain",
        description="text/plain, text/markdown, text/html, "
        "application/pdf, DOCX, image/* (images wait for OCR)",
    )
    tags: list[str] = Field(default_factory=list)
    collection: str | None = Field(None, description="at most one per document")
    metadata: dict[str, Any] = Field(default_factory=dict)
    source_id: str = Field(DEFAULT_SOURCE, min_length=1, max_length=256)
    uri: str | None = None
    kb_id: str | None = Field(None, description="KB id or name: direct membership")
    document_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="replace this document (new revision)"
    )


class UploadResult(BaseModel):
    document_id: str
    name: str
    status: Literal["processing", "complete", "awaiting_ocr", "failed", "stored"]
    revision: int | None = None
    kb_ids: list[str] = Field(default_factory=list)
    chunk_count: int | None = None
    error: str | None = None


class KbSettingsFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str | None = Field(None, max_length=2000)
    tag_ids: list[str] | None = None
    chunker: Chunker | None = None
    chunk_size: int | None = Field(None, ge=50, le=2000, description="tokens per chunk")
    chunk_overlap: int | None = Field(None, ge=0, description="tokens shared by neighbours")
    embedding_model: str | None = Field(
        None, min_length=1, description=f"{DEFAULT_MODEL} or any LiteLLM model id"
    )
    api_base: str | None = None
    coalesce_neighbors: int | None = Field(None, ge=0, le=5)
    rerank_model: str | None = Field(
        None,
        min_length=1,
        description="a LiteLLM rerank model (cohere/rerank-v3.5, jina_ai/..., voyage/..., or "
        "one served by TEI via rerank_api_base) that reorders the best search candidates; "
        "null turns reranking off (the default)",
    )
    rerank_api_base: str | None = Field(
        None, description="the rerank model's server, if not its provider's"
    )


class KbCreate(KbSettingsFields):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\s/][^/]*$")


class KbUpdate(KbSettingsFields):
    name: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[^\s/][^/]*$")


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


class KbList(BaseModel):
    items: list[KbView]
    total: int
    skip: int
    limit: int


class KbStats(BaseModel):
    kb_id: str
    document_count: int
    chunk_count: int
    total_documents_with_tags: int
    failed_count: int
    pending_count: int


class DocumentView(BaseModel):
    document_id: str
    name: str
    mime_type: str
    source_id: str
    uri: str | None
    tags: list[str]
    collection: str | None
    metadata: dict[str, Any]
    revision: int
    status: str
    error: str | None
    kb_ids: list[str]
    size_bytes: int
    created_at: datetime
    updated_at: datetime


class KbDocumentView(BaseModel):
    document_id: str
    name: str
    source_id: str
    status: str
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


# ---- stored prompts -------------------------------------------------------------------------

PROMPT_NAME = r"^[^\s/][^/]*$"


class PromptCreate(AskOptions):
    name: str = Field(
        min_length=1, max_length=100, pattern=PROMPT_NAME, description="unique in the org"
    )


class PromptUpdate(AskOptions):
    """Only the fields given change; null clears an optional field."""

    name: str | None = Field(None, min_length=1, max_length=100, pattern=PROMPT_NAME)


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


class DeadLetterList(BaseModel):
    items: list[DeadLetterView]
    total: int
