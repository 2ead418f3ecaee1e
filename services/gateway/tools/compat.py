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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from services.common.domain.content import (
    HTML_TYPES,
    TEXT_TYPES,
    decode_content,
    normalise_mime,
)
from services.common.domain.errors import InvalidInput, NotFound
from services.common.domain.ids import UUID_PATTERN, point_id
from services.common.domain.models import DEFAULT_KB, DEFAULT_SOURCE
from services.common.messages.queries import MatchType, SearchFilters, SearchHit, SearchQuery
from services.gateway.auth import Principal
from services.gateway.schemas import MIME_TYPES, FileFields, UploadBody
from services.gateway.service import GatewayService
from services.gateway.service.documents import Content
from services.gateway.tools.core import DeleteOutput, delete_output
from services.gateway.tools.registry import CitingOutput, tool
from services.gateway.tools.rendering import hit_links


async def _project(service: GatewayService, p: Principal, project_id: str) -> str:
    try:
        return (await service.kbs.resolve(p, project_id)).kb_id
    except NotFound as err:
        raise NotFound(f"project {project_id!r} not found", field="projectId") from err


MAX_MATCHES = 50  # the most one search returns
# Errors about the KB or document name the parameter the caller sent.
PROJECT_FIELDS = {"kb_id": "projectId", "name": "fileName", "uri": "fileName"}


class SearchDocsInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4000, description="what to look for")
    projectId: str = Field(
        min_length=1,
        max_length=100,
        description="the project (knowledge base) id or name to search",
    )
    topK: int = Field(5, ge=1, le=50, description="how many results to return")
    minScore: float = Field(
        0.5, ge=0, le=1, description="drop results whose similarity score (0-1) is below this"
    )


class DocResult(BaseModel):
    content: str = Field(description="the matching passage")
    documentTitle: str = Field(description="the name of the document it is from")
    chunkIndex: int = Field(description="its position in the document (0-based)")
    score: float = Field(description="similarity to the query (cosine, 0-1 for relevant text)")


class SearchDocsOutput(CitingOutput):
    results: list[DocResult] = Field(description="best match first")


# The text an LLM reads beside the structured results (tools/rendering.py for core tools).


def render_docs(out: SearchDocsOutput) -> str:
    if not out.results:
        return "No matching documents found."
    return "\n\n".join(
        f"{i}. {r.documentTitle} (chunk {r.chunkIndex}, score {r.score:.3f})\n{r.content}"
        for i, r in enumerate(out.results, 1)
    )


def render_knowledge(out: SearchKnowledgeBaseOutput) -> str:
    if not out.results:
        return f'No results for "{out.query}".'
    lines, n = [], 0
    for r in out.results:
        if r.is_matched:
            n += 1
            lines.append(
                f"{n}. {r.source} (chunk {r.chunk_index}, relevance "
                f"{(r.relevance or 0):.3f})\n{r.content}"
            )
        else:
            lines.append(f"   (context, chunk {r.chunk_index} of {r.source})\n{r.content}")
    return "\n\n".join(lines)


@tool(
    "compat",
    title="Search project documents",
    render=render_docs,
    cites=CitingOutput.cited,
    read_only=True,
    error_fields=PROJECT_FIELDS,
)
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
    ).citing(hit_links(resp.hits))


class UploadDocumentInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    projectId: str = Field(
        min_length=1, max_length=100, description="the project (knowledge base) id or name"
    )
    fileName: str = Field(
        min_length=1,
        max_length=512,
        description="the document's file name; uploading the same fileName into the same "
        "project again replaces that document",
    )
    content: str = Field(
        description="the document: plain text, or base64 for binary types "
        "(PDF, DOCX, images); at most 10 MB"
    )
    mimeType: str = Field("text/plain", description=f"the document's media type: {MIME_TYPES}")


class UploadDocumentOutput(BaseModel):
    documentId: str = Field(description="the document's id (delete_document takes it)")
    fileName: str = Field(description="the file name it was stored under")
    status: Literal["processing", "complete"] = Field(
        description="complete: searchable now; processing: still being indexed"
    )
    chunkCount: int = Field(description="chunks indexed (0 while processing)")


_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")


def _compat_content(content: str, mime: str, max_bytes: int) -> str | bytes:
    """The document as these clients send it: binary types in base64 (decoded here, the one
    decode), text types as text, unless the content is unmistakably base64 — no whitespace,
    valid padding, and it decodes to UTF-8 text, which is then the document."""
    if mime not in TEXT_TYPES and mime not in HTML_TYPES:
        return decode_content(content, "base64", max_bytes)
    if len(content) < 16 or len(content) % 4 or not _BASE64.match(content):
        return content
    try:
        return base64.b64decode(content, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return content


@tool(
    "compat", title="Upload a document to a project", destructive=True, error_fields=PROJECT_FIELDS
)
async def upload_document(
    service: GatewayService, p: Principal, inp: UploadDocumentInput
) -> UploadDocumentOutput:
    """Upload a document into a project (knowledge base). The content is plain text, or base64
    for binary files. Returns the document id, and status 'complete' with its chunk count once
    it is searchable. Uploading the same fileName into the same project again replaces that
    document. Documents over 10 MB, and content that cannot be read, are rejected."""
    kb_id = await _project(service, p, inp.projectId)
    mime = normalise_mime(inp.mimeType, inp.fileName)
    fields = FileFields(name=inp.fileName, mime_type=mime, uri=inp.fileName, replace_same_uri=True)
    content = Content(_compat_content(inp.content, mime, service.settings.max_content_bytes))
    result = await service.documents.upload_content(p, fields, content, kb_id, wait=True)
    if result.status == "failed":
        raise InvalidInput(f"the document could not be processed: {result.error}", field="content")
    return UploadDocumentOutput(
        documentId=result.document_id,
        fileName=inp.fileName,
        status="complete" if result.status == "complete" else "processing",
        chunkCount=result.chunk_count or 0,
    )


class DeleteDocumentInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filepath: str = Field(
        min_length=1,
        max_length=4096,
        description="the document id, or the uri, path or file name the document was uploaded with",
    )


@tool(
    "compat",
    title="Delete a document by id or path",
    destructive=True,
    error_fields={"document_id": "filepath"},
)
async def delete_document(
    service: GatewayService, p: Principal, inp: DeleteDocumentInput
) -> DeleteOutput:
    """Delete a document given its id or the uri/path/file name it was uploaded with. Returns
    deleted_count 1, or 0 when nothing matches (not an error). A uri or file name that several
    documents share is an error listing their ids: pass the id of the one to delete."""
    ref = inp.filepath.strip()
    if not ref:
        raise InvalidInput(
            "filepath must not be empty: give a document id or its uri/path", field="filepath"
        )
    record = await service.documents.find(p, ref)
    if record is None:
        return DeleteOutput(
            status="not_found",
            deleted_count=0,
            document_id=None,
            title=None,
            message=f"no document matches {ref!r}; nothing was deleted",
        )
    return delete_output(await service.documents.delete(p, record.document_id), ref)


# ---- compat: manageKnowledge ----------------------------------------------------------------


# What each operation needs, also said in the input schema (if/then per operation).
REQUIRED_FOR = {"ingest": "content", "search": "query", "getChunk": "chunkId"}


class ManageKnowledgeInput(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"operation": {"const": op}}, "required": ["operation"]},
                    "then": {"required": [name]},
                }
                for op, name in [*REQUIRED_FOR.items(), ("deleteBySource", "sourceId")]
            ]
        },
    )

    operation: Literal["ingest", "search", "deleteBySource", "getChunk"] = Field(
        description="ingest: store content; search: find chunks by meaning; deleteBySource: "
        "remove every document of sourceId; getChunk: fetch one chunk by chunkId"
    )
    content: str | None = Field(None, min_length=1, description="document text to store (ingest)")
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
        description="source group of the document (ingest), the group to delete "
        "(deleteBySource), or the only group to search (search; omitted: every source)",
    )
    metadata: dict[str, Any] | None = Field(
        None, description="metadata stored with the document (ingest)"
    )
    query: str | None = Field(None, max_length=4000, description="natural-language query (search)")
    limit: int = Field(10, ge=1, le=50, description="maximum results (search)")
    chunkId: str | None = Field(
        None,
        pattern=UUID_PATTERN,
        description="the chunk to fetch (getChunk): the id of a search result (a UUID)",
    )

    @model_validator(mode="after")
    def _required_per_operation(self) -> ManageKnowledgeInput:
        name = REQUIRED_FOR.get(self.operation)
        if name and not getattr(self, name):
            raise ValueError(f"{name} is required for operation {self.operation!r}")
        if self.operation == "deleteBySource" and "sourceId" not in self.model_fields_set:
            raise ValueError("sourceId is required for operation 'deleteBySource'")
        return self


class KnowledgeChunk(BaseModel):
    id: str = Field(description="the chunk id (getChunk takes it)")
    content: str = Field(description="the chunk's text")
    score: float | None = Field(None, description="similarity to the query (search only)")
    matchType: MatchType | None = Field(
        None,
        description="how it matched: semantic (by meaning), keyword (by the query's terms) "
        "or hybrid (both); null outside search",
    )
    sourceId: str | None = Field(description="the document's source group")
    uri: str | None = Field(description="the document's uri; null when it has none")
    metadata: dict[str, Any] = Field(default_factory=dict, description="the document's metadata")
    chunkIndex: int = Field(description="position of the chunk in its document (0-based)")
    totalChunks: int = Field(description="how many chunks the document has")


# The fields each operation answers with (besides success, operation and message); the
# others are left out of its result.
OPERATION_FIELDS = {
    "search": {"chunks", "totalMatches", "query"},
    "getChunk": {"chunk"},
    "ingest": {"documentId", "chunksCreated", "chunkIds", "uri", "sourceId"},
    "deleteBySource": {"sourceId", "deletedCount"},
}


class ManageKnowledgeOutput(CitingOutput):
    success: bool = Field(True, description="true: the operation succeeded")
    operation: Literal["ingest", "search", "deleteBySource", "getChunk"] = Field(
        description="the operation this answers"
    )
    message: str = Field(description="what happened, in a sentence")
    chunks: list[KnowledgeChunk] | None = Field(
        None, description="search: the best `limit` matching chunks, best first"
    )
    totalMatches: int | None = Field(
        None,
        description="search: how many chunks matched (counted up to 50); chunks holds the "
        "best `limit` of them",
    )
    query: str | None = Field(None, description="search: the query")
    chunk: KnowledgeChunk | None = Field(None, description="getChunk: the chunk")
    documentId: str | None = Field(None, description="ingest: the stored document's id")
    chunksCreated: int | None = Field(None, description="ingest: chunks indexed")
    chunkIds: list[str] | None = Field(None, description="ingest: the ids of those chunks")
    uri: str | None = Field(None, description="ingest: the document's uri, null when none")
    sourceId: str | None = Field(None, description="ingest, deleteBySource: the source group")
    deletedCount: int | None = Field(None, description="deleteBySource: documents deleted")

    @model_serializer(mode="wrap")
    def _operation_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        keep = {"success", "operation", "message"} | OPERATION_FIELDS[self.operation]
        return {k: v for k, v in data.items() if k in keep}


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


@tool("compat", title="Manage the knowledge base", cites=CitingOutput.cited, destructive=True)
async def manageKnowledge(
    service: GatewayService, p: Principal, inp: ManageKnowledgeInput
) -> ManageKnowledgeOutput:
    """Manage the knowledge base: "ingest" stores organisational documentation (content, uri,
    sourceId, metadata; the same uri again replaces that document); "search" finds relevant
    chunks by meaning (query, limit, optionally one sourceId) — for complex questions, search
    several phrasings; "deleteBySource" removes every document of a sourceId;
    "getChunk" fetches one chunk by chunkId."""
    op = inp.operation
    if op == "search":
        only = [inp.sourceId] if "sourceId" in inp.model_fields_set else None
        # Up to the most a search returns, to count the matches beyond `limit` too.
        resp = await service.search.query(
            p,
            SearchQuery(
                query=inp.query or "",
                top_k=MAX_MATCHES,
                coalesce_neighbors=0,
                filters=SearchFilters(source_ids=only) if only else None,
            ),
        )
        hits = [h for h in resp.hits if h.is_matched]
        shown = hits[: inp.limit]
        return ManageKnowledgeOutput(
            operation=op,
            chunks=[_knowledge_chunk(h) for h in shown],
            totalMatches=len(hits),
            query=inp.query,
            message=f"Found {len(hits)} matching chunks"
            if shown
            else "No matching documents found",
        ).citing(hit_links(shown))
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
    kb = await service.kbs.resolve(p, DEFAULT_KB, write=True)
    body = UploadBody(
        name=_name_from_uri(inp.uri),
        content=inp.content or "",
        uri=inp.uri,
        source_id=inp.sourceId,
        metadata=inp.metadata or {},
        mime_type=normalise_mime(None, _name_from_uri(inp.uri)),
        replace_same_uri=True,
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
    model_config = ConfigDict(extra="forbid")

    document_name: str | None = Field(None, description="only documents whose name contains this")
    tag_ids: list[str] | None = Field(None, description="only documents with any of these tags")


class SearchKnowledgeBaseInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

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


class SearchKnowledgeBaseOutput(CitingOutput):
    results: list[KnowledgeResult]
    query: str
    sources_searched: int = Field(description="how many knowledge bases were searched")
    coalesced: int = Field(description="neighbour chunks added on each side of a match")


@tool(
    "compat",
    title="Search the knowledge base",
    render=render_knowledge,
    cites=CitingOutput.cited,
    read_only=True,
)
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
    ).citing(hit_links(resp.hits))
