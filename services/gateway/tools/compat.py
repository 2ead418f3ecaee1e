"""The `compat` tools: the names, parameters and result shapes that existing knowledge-base
clients already call ("project" is their word for a knowledge base).

Docstrings of the tool functions and `Field` descriptions are product text: an LLM reads them
to choose a tool and fill its arguments.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.content import HTML_TYPES, TEXT_TYPES, normalise_mime
from services.common.errors import Conflict, InvalidInput, NotFound
from services.common.models import DEFAULT_SOURCE, point_id
from services.common.queries import SearchFilters, SearchHit, SearchQuery
from services.gateway.auth import Principal
from services.gateway.schemas import UploadBody
from services.gateway.service import GatewayService
from services.gateway.tools.core import DeleteOutput, _delete_output
from services.gateway.tools.registry import tool
from services.gateway.tools.rendering import render_docs, render_knowledge


async def _project(service: GatewayService, p: Principal, project_id: str) -> str:
    try:
        return (await service.kbs.resolve(p, project_id)).kb_id
    except NotFound as err:
        raise NotFound(f"project {project_id!r} not found", field="projectId") from err


class SearchDocsInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    query: str = Field(min_length=1, max_length=4000, description="what to look for")
    projectId: str = Field(
        min_length=1,
        max_length=100,
        description="the project (knowledge base) id or name to search",
    )
    topK: int = Field(5, ge=1, le=50, description="how many results to return")
    minScore: float = Field(
        0.5, description="drop results whose similarity score (0-1) is below this"
    )


class DocResult(BaseModel):
    content: str
    documentTitle: str
    chunkIndex: int
    score: float


class SearchDocsOutput(BaseModel):
    results: list[DocResult]


@tool("compat", title="Search project documents", render=render_docs, read_only=True)
async def search_docs(
    service: GatewayService, p: Principal, inp: SearchDocsInput
) -> SearchDocsOutput:
    """Search the documents of one project (knowledge base) by meaning. Returns the best
    matching passages with their document title, chunk index and similarity score."""
    kb_id = await _project(service, p, inp.projectId)
    resp = await service.search.query(
        p,
        SearchQuery(
            query=inp.query,
            kb_ids=[kb_id],
            top_k=inp.topK,
            min_similarity=inp.minScore,
            coalesce_neighbors=0,
        ),
    )
    # The contract's score is similarity (0-1), as minScore is; the order is the ranking.
    return SearchDocsOutput(
        results=[
            DocResult(
                content=h.content,
                documentTitle=h.document_name,
                chunkIndex=h.chunk_index,
                score=h.similarity or 0.0,
            )
            for h in resp.hits
            if h.is_matched
        ]
    )


class UploadDocumentInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    projectId: str = Field(
        min_length=1, max_length=100, description="the project (knowledge base) id or name"
    )
    fileName: str = Field(min_length=1, max_length=512, description="the document's file name")
    content: str = Field(
        description="the document: plain text, or base64 for binary types "
        "(PDF, DOCX, images); at most 10 MB"
    )
    mimeType: str = Field("text/plain", description="the document's media type")


class UploadDocumentOutput(BaseModel):
    documentId: str
    fileName: str
    status: Literal["processing", "complete"]
    chunkCount: int


_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")


def _compat_encoding(content: str, mime: str) -> Literal["text", "base64"]:
    """Binary types are base64. Text types are plain unless the content is unmistakably
    base64: no whitespace, valid padding, and it decodes to UTF-8 text."""
    if mime not in TEXT_TYPES and mime not in HTML_TYPES:
        return "base64"
    if len(content) < 16 or len(content) % 4 or not _BASE64.match(content):
        return "text"
    try:
        base64.b64decode(content, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return "text"
    return "base64"


@tool("compat", title="Upload a document to a project")
async def upload_document(
    service: GatewayService, p: Principal, inp: UploadDocumentInput
) -> UploadDocumentOutput:
    """Upload a document into a project (knowledge base). The content is plain text, or base64
    for binary files. Returns the document id, and status 'complete' with its chunk count once
    it is searchable. Documents over 10 MB are rejected."""
    kb_id = await _project(service, p, inp.projectId)
    mime = normalise_mime(inp.mimeType, inp.fileName)
    body = UploadBody(
        name=inp.fileName,
        content=inp.content,
        mime_type=mime,
        content_encoding=_compat_encoding(inp.content, mime),
        uri=inp.fileName,
    )
    result = await service.documents.upload(p, body, kb_id, wait=True)
    if result.status == "failed":
        raise InvalidInput(f"the document could not be processed: {result.error}", field="content")
    return UploadDocumentOutput(
        documentId=result.document_id,
        fileName=inp.fileName,
        status="complete" if result.status == "complete" else "processing",
        chunkCount=result.chunk_count or 0,
    )


class DeleteDocumentInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    filepath: str = Field(
        min_length=1,
        max_length=4096,
        description="the document id, or the uri, path or file name the document was uploaded with",
    )


async def _find_document(service: GatewayService, p: Principal, ref: str) -> str | None:
    """A document id, else a uri/path, else an unambiguous file name."""
    try:
        return (await service.documents.get(p, ref)).document_id
    except NotFound:
        pass
    record = await service.documents.find_by_uri(p, ref)
    if record is not None:
        return record.document_id
    page = await service.documents.page(p, name_search=ref, limit=500)
    named = [d.document_id for d in page.items if d.name == ref]
    if len(named) > 1:
        raise Conflict(
            f"{len(named)} documents are named {ref!r}; pass the document id", field="filepath"
        )
    return named[0] if named else None


@tool("compat", title="Delete a document by id or path", destructive=True)
async def delete_document(
    service: GatewayService, p: Principal, inp: DeleteDocumentInput
) -> DeleteOutput:
    """Delete a document given its id or the uri/path/file name it was uploaded with. Returns
    deleted_count 1, or 0 when nothing matches (not an error)."""
    ref = inp.filepath.strip()
    if not ref:
        raise InvalidInput(
            "filepath must not be empty: give a document id or its uri/path", field="filepath"
        )
    document_id = await _find_document(service, p, ref)
    if document_id is None:
        return DeleteOutput(
            status="not_found",
            deleted_count=0,
            document_id=None,
            title=None,
            message=f"no document matches {ref!r}; nothing was deleted",
        )
    return _delete_output(await service.documents.delete(p, document_id), ref)


# ---- compat: manageKnowledge ----------------------------------------------------------------


class ManageKnowledgeInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    operation: Literal["ingest", "search", "deleteBySource", "getChunk"] = Field(
        description="ingest: store content; search: find chunks by meaning; deleteBySource: "
        "remove every document of sourceId; getChunk: fetch one chunk by chunkId"
    )
    content: str | None = Field(None, description="document text to store (ingest)")
    uri: str | None = Field(
        None,
        max_length=4096,
        description="URL identifying the document "
        "(ingest); ingesting the same uri again replaces that document",
    )
    sourceId: str = Field(
        DEFAULT_SOURCE,
        min_length=1,
        max_length=256,
        description="source group of the document (ingest) or the group to delete (deleteBySource)",
    )
    metadata: dict[str, Any] | None = Field(
        None, description="metadata stored with the document (ingest)"
    )
    query: str | None = Field(None, max_length=4000, description="natural-language query (search)")
    limit: int = Field(10, ge=1, le=50, description="maximum results (search)")
    chunkId: str | None = Field(
        None, max_length=100, description="the chunk to fetch (getChunk), as returned by search"
    )

    @model_validator(mode="after")
    def _required_per_operation(self) -> ManageKnowledgeInput:
        needed = {"ingest": "content", "search": "query", "getChunk": "chunkId"}
        name = needed.get(self.operation)
        if name and not getattr(self, name):
            raise ValueError(f"{name} is required for operation {self.operation!r}")
        if self.operation == "deleteBySource" and "sourceId" not in self.model_fields_set:
            raise ValueError("sourceId is required for operation 'deleteBySource'")
        return self


class KnowledgeChunk(BaseModel):
    id: str
    content: str
    score: float | None = None
    matchType: str | None = None
    sourceId: str | None = None
    uri: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    chunkIndex: int
    totalChunks: int


class ManageKnowledgeOutput(BaseModel):
    success: bool = True
    operation: str
    message: str
    chunks: list[KnowledgeChunk] | None = Field(None, description="search")
    totalMatches: int | None = Field(None, description="search")
    query: str | None = Field(None, description="search")
    chunk: KnowledgeChunk | None = Field(None, description="getChunk")
    documentId: str | None = Field(None, description="ingest")
    chunksCreated: int | None = Field(None, description="ingest")
    chunkIds: list[str] | None = Field(None, description="ingest")
    uri: str | None = Field(None, description="ingest")
    sourceId: str | None = Field(None, description="ingest, deleteBySource")
    deletedCount: int | None = Field(None, description="deleteBySource")


def _knowledge_chunk(hit: SearchHit) -> KnowledgeChunk:
    return KnowledgeChunk(
        id=hit.chunk_id,
        content=hit.content,
        score=hit.score,
        matchType=hit.match_type,
        sourceId=hit.source_id,
        uri=hit.uri,
        metadata=hit.metadata,
        chunkIndex=hit.chunk_index,
        totalChunks=hit.total_chunks,
    )


def _name_from_uri(uri: str | None) -> str:
    if not uri:
        return "document"
    parsed = urlparse(uri)
    return (PurePosixPath(unquote(parsed.path)).name or parsed.netloc or uri)[:512]


@tool("compat", title="Manage the knowledge base", exclude_none=True)
async def manageKnowledge(
    service: GatewayService, p: Principal, inp: ManageKnowledgeInput
) -> ManageKnowledgeOutput:
    """Manage the knowledge base: "ingest" stores organisational documentation (content, uri,
    sourceId, metadata); "search" finds relevant chunks by meaning (query, limit) — for complex
    questions, search several phrasings; "deleteBySource" removes every document of a sourceId;
    "getChunk" fetches one chunk by chunkId."""
    op = inp.operation
    if op == "search":
        resp = await service.search.query(
            p, SearchQuery(query=inp.query or "", top_k=inp.limit, coalesce_neighbors=0)
        )
        chunks = [_knowledge_chunk(h) for h in resp.hits if h.is_matched]
        return ManageKnowledgeOutput(
            operation=op,
            chunks=chunks,
            totalMatches=len(chunks),
            query=inp.query,
            message=f"Found {len(chunks)} matching chunks"
            if chunks
            else "No matching documents found",
        )
    if op == "getChunk":
        found = await service.search.chunk(p, inp.chunkId or "")
        return ManageKnowledgeOutput(
            operation=op, chunk=_knowledge_chunk(found.chunk), message="chunk found"
        )
    if op == "deleteBySource":
        deleted = await service.documents.delete_source(p, inp.sourceId)
        return ManageKnowledgeOutput(
            operation=op,
            sourceId=inp.sourceId,
            deletedCount=deleted.deleted_count,
            message=f"deleted {deleted.deleted_count} document(s) of source {inp.sourceId!r}",
        )
    kb = await service.kbs.resolve(p, service.settings.default_kb, write=True)
    existing = await service.documents.find_by_uri(p, inp.uri) if inp.uri else None
    body = UploadBody(
        name=_name_from_uri(inp.uri),
        content=inp.content or "",
        uri=inp.uri,
        source_id=inp.sourceId,
        metadata=inp.metadata or {},
        mime_type=normalise_mime(None, _name_from_uri(inp.uri)),
        document_id=existing.document_id if existing else None,
    )
    result = await service.documents.upload(p, body, kb.kb_id, wait=True)
    if result.status == "failed":
        raise InvalidInput(f"the document could not be processed: {result.error}", field="content")
    count = result.chunk_count or 0
    return ManageKnowledgeOutput(
        operation=op,
        documentId=result.document_id,
        chunksCreated=count,
        uri=inp.uri,
        sourceId=inp.sourceId,
        # Point ids are deterministic per (kb, document, index): they are the chunk ids.
        chunkIds=[point_id(kb.kb_id, result.document_id, i) for i in range(count)],
        message=f"Successfully ingested document into {count} chunks"
        if count
        else f"Document accepted ({result.status})",
    )


# ---- compat: search_knowledge_base ----------------------------------------------------------


class MetadataFilter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    document_name: str | None = Field(None, description="only documents whose name contains this")
    tag_ids: list[str] | None = Field(None, description="only documents with any of these tags")


class SearchKnowledgeBaseInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    query: str = Field(min_length=1, max_length=4000, description="what to look for")
    top_k: int = Field(5, ge=1, le=50, description="how many matching chunks to return")
    coalesce_neighbors: int | None = Field(
        None, ge=0, le=5, description="also return this many chunks around each match, for context"
    )
    metadata_filter: MetadataFilter | None = Field(
        None, description="restrict by document name and tags"
    )
    upload_date_from: datetime | None = Field(
        None, description="only documents uploaded at or after this (ISO 8601)"
    )
    upload_date_to: datetime | None = Field(
        None, description="only documents uploaded at or before this (ISO 8601)"
    )


class KnowledgeResult(BaseModel):
    content: str
    source: str = Field(description="the document's name")
    relevance: float | None = Field(
        description="similarity to the query (0-1); null for neighbour chunks added for context"
    )
    is_matched: bool = Field(description="false for neighbour chunks added for context")
    chunk_index: int


class SearchKnowledgeBaseOutput(BaseModel):
    results: list[KnowledgeResult]
    query: str
    sources_searched: int = Field(description="how many knowledge bases were searched")
    coalesced: int = Field(description="neighbour chunks added on each side of a match")


@tool("compat", title="Search the knowledge base", render=render_knowledge, read_only=True)
async def search_knowledge_base(
    service: GatewayService, p: Principal, inp: SearchKnowledgeBaseInput
) -> SearchKnowledgeBaseOutput:
    """Search every knowledge base you can access for passages relevant to a query, optionally
    restricted by document name, tags and upload date, with neighbouring chunks for context."""
    mf = inp.metadata_filter or MetadataFilter()
    filters = SearchFilters(
        document_name=mf.document_name or None,
        tags=mf.tag_ids or None,
        upload_date_from=inp.upload_date_from,
        upload_date_to=inp.upload_date_to,
    )
    resp = await service.search.query(
        p,
        SearchQuery(
            query=inp.query,
            top_k=inp.top_k,
            coalesce_neighbors=inp.coalesce_neighbors,
            filters=filters,
        ),
    )
    return SearchKnowledgeBaseOutput(
        results=[
            KnowledgeResult(
                content=h.content,
                source=h.document_name,
                relevance=h.score,
                is_matched=h.is_matched,
                chunk_index=h.chunk_index,
            )
            for h in resp.hits
        ],
        query=resp.query,
        sources_searched=len(resp.kb_ids),
        coalesced=resp.coalesced,
    )
