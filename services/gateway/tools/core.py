"""The `core` tools: kbmesh's own knowledge-base lifecycle — search, chunks, documents and
knowledge bases — one input model, one output model and one thin function over
`GatewayService` each.

Docstrings of the tool functions and `Field` descriptions are product text: an LLM reads them
to choose a tool and fill its arguments.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.domain.ids import UUID_PATTERN
from services.common.domain.models import DEFAULT_KB
from services.common.messages.queries import (
    ChunkResponse,
    Mode,
    SearchFilters,
    SearchQuery,
    SearchResponse,
)
from services.gateway.auth import Principal
from services.gateway.schemas import (
    Ack,
    DeleteResult,
    DocumentPatch,
    DocumentView,
    KbCreate,
    KbList,
    KbStats,
    KbUpdate,
    KbView,
    Page,
    UploadBody,
    UploadFields,
    UploadResult,
)
from services.gateway.service import GatewayService
from services.gateway.tools.registry import tool
from services.gateway.tools.rendering import render_chunk, render_search, search_links

# Errors about a KB name the `kb` parameter.
KB_FIELD = {"kb_id": "kb"}


KbName = Annotated[
    str, Field(min_length=1, max_length=100, description="knowledge base name or id (see kb_list)")
]


class KbSearchInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(
        min_length=1, max_length=4000, description="what to look for, as a question or keywords"
    )
    kb: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="knowledge base name or id to search; omit to search "
        "every knowledge base you can access (see kb_list)",
    )
    top_k: int = Field(5, ge=1, le=50, description="how many matching chunks to return")
    mode: Mode = Field(
        Mode.hybrid,
        description="hybrid (default: meaning and exact words), "
        "dense (meaning only) or keyword (exact terms: names, ids, error codes)",
    )
    filters: SearchFilters | None = Field(
        None,
        description="narrow the search: document_ids, source_ids, tags (any of), "
        "collection, document_name, metadata conditions, upload date range",
    )
    coalesce_neighbors: int | None = Field(
        None,
        ge=0,
        le=5,
        description="also return this many chunks before and after each "
        "match, for context (marked is_matched=false); omitted: the knowledge base's default",
    )
    min_score: float | None = Field(
        None,
        ge=0,
        le=1,
        description="drop matches whose score (0-1, the ranking score shown with each "
        "hit: 1.0 = best by every signal) is below this",
    )
    min_similarity: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="drop matches less similar in meaning than this (cosine, typically "
        "0.2-0.7 for relevant text; hybrid and dense mode)",
    )
    rerank: bool | None = Field(
        None,
        description="rerank with the knowledge base's rerank model (true) or not (false); "
        "omitted: as the knowledge base is set",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=200_000,
        description="return no more than this many tokens of content: the best matches "
        "(with their neighbours) that fit, whole chunks only; the answer lists what was "
        "left out",
    )


@tool(
    "core",
    title="Search knowledge bases",
    render=render_search,
    cites=search_links,
    read_only=True,
    error_fields=KB_FIELD,
)
async def kb_search(service: GatewayService, p: Principal, inp: KbSearchInput) -> SearchResponse:
    """Search the knowledge bases for passages relevant to a question. Use this first whenever
    an answer may depend on documents stored in kbmesh. Returns a numbered, source-attributed
    list (document, chunk, score, uri) and the structured hits; cite the document names.
    Use filters to restrict by tags, collection, source, document or metadata,
    coalesce_neighbors to get surrounding context, and max_tokens to bound the answer's size.
    Call kb_get_chunk to expand one hit. The result links each cited document as a resource
    (kbmesh://documents/<document_id>) that reads as its whole text."""
    query = SearchQuery(
        query=inp.query,
        kb_ids=[inp.kb] if inp.kb else None,
        top_k=inp.top_k,
        mode=inp.mode,
        filters=inp.filters,
        min_score=inp.min_score,
        min_similarity=inp.min_similarity,
        rerank=inp.rerank,
        max_tokens=inp.max_tokens,
        coalesce_neighbors=inp.coalesce_neighbors,
    )
    return await service.search.query(p, query)


class KbGetChunkInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_id: str = Field(pattern=UUID_PATTERN, description="chunk_id of a search hit (a UUID)")
    kb: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="knowledge base name or id the chunk is in (faster); "
        "omitted: looked up in every knowledge base you can access",
    )
    neighbors: int = Field(
        0, ge=0, le=5, description="also return this many chunks before and after it"
    )


@tool(
    "core",
    title="Get a chunk and its neighbours",
    render=render_chunk,
    read_only=True,
    error_fields=KB_FIELD,
)
async def kb_get_chunk(
    service: GatewayService, p: Principal, inp: KbGetChunkInput
) -> ChunkResponse:
    """Fetch one chunk by its chunk_id (from kb_search) with optional neighbouring chunks of
    the same document, to read more context around a search hit."""
    return await service.search.chunk(p, inp.chunk_id, inp.kb, inp.neighbors)


# ---- core: documents ------------------------------------------------------------------------


class KbUploadInput(UploadFields):
    kb: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="knowledge base name or id to add the document to; "
        "omitted: the default knowledge base",
    )
    wait: bool = Field(
        True,
        description="wait until the document is searchable (recommended); "
        "false returns at once with status 'processing'",
    )


class KbUploadOutput(UploadResult):
    mime_type: str | None = Field(
        description="the type the document was stored and extracted as (with wait false: the "
        "type declared, or null when none was: the server reads it from the bytes)"
    )


@tool("core", title="Add a document", open_world=True, destructive=True, error_fields=KB_FIELD)
async def kb_upload(service: GatewayService, p: Principal, inp: KbUploadInput) -> KbUploadOutput:
    """Add a document to a knowledge base so it becomes searchable: pass its text as content,
    or let the server fetch it from a url, or read it from a server-side path (both avoid
    pasting large documents through the conversation). PDF, DOCX, HTML, markdown and text are
    extracted. Give document_id to replace an existing document. With wait (default) the call
    returns once the document is indexed, with its chunk_count; content that cannot be read
    is an error."""
    body = UploadBody.model_validate(inp.model_dump(exclude={"kb", "wait"}, exclude_unset=True))
    kb = inp.kb or DEFAULT_KB
    result = await service.documents.upload(p, body, kb, wait=inp.wait)
    return KbUploadOutput.model_validate(result.model_dump())


class DocumentRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    document_id: str = Field(
        min_length=1,
        max_length=64,
        description="the document's id (from kb_upload, kb_search or kb_list_documents)",
    )


class DeleteOutput(BaseModel):
    status: Literal["deleted", "not_found"]
    deleted_count: int = Field(
        description="1 when the document was deleted, 0 when no such document exists"
    )
    document_id: str | None
    title: str | None = Field(description="the deleted document's name")
    message: str


def delete_output(result: DeleteResult, ref: str) -> DeleteOutput:
    if result.deleted_count:
        message = f"deleted document {result.title!r} ({result.document_id})"
    else:
        message = f"no document {ref!r} exists; nothing was deleted"
    return DeleteOutput(
        status=result.status,
        deleted_count=result.deleted_count,
        document_id=result.document_id,
        title=result.title,
        message=message,
    )


@tool("core", "compat", title="Delete a document", destructive=True)
async def kb_delete(service: GatewayService, p: Principal, inp: DocumentRef) -> DeleteOutput:
    """Delete a document by id from every knowledge base; once this returns, no search returns
    it. An unknown id is not an error: it returns deleted_count 0."""
    return delete_output(await service.documents.delete(p, inp.document_id), inp.document_id)


class SourceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_id: str = Field(
        min_length=1, max_length=256, description="the source_id the documents were uploaded with"
    )


class DeleteSourceOutput(BaseModel):
    status: Literal["deleted", "not_found"]
    source_id: str
    deleted_count: int
    document_ids: list[str]
    message: str


@tool("core", title="Delete every document of a source", destructive=True)
async def kb_delete_source(
    service: GatewayService, p: Principal, inp: SourceRef
) -> DeleteSourceOutput:
    """Delete every document that was uploaded with this source_id (e.g. a whole repository
    before re-ingesting it). Returns how many were deleted; 0 is not an error."""
    result = await service.documents.delete_source(p, inp.source_id)
    return DeleteSourceOutput(
        status=result.status,
        source_id=inp.source_id,
        deleted_count=result.deleted_count,
        document_ids=result.document_ids,
        message=f"deleted {result.deleted_count} document(s) of source {inp.source_id!r}",
    )


class SetCollectionInput(DocumentRef):
    collection: str | None = Field(
        min_length=1,
        max_length=200,
        description="the collection "
        "to put the document in, or null to remove it from its "
        "collection",
    )


class SetCollectionOutput(BaseModel):
    status: Literal["updated"] = "updated"
    document_id: str
    title: str
    collection: str | None
    revision: int


@tool("core", "compat", title="Set a document's collection", destructive=True)
async def kb_set_collection(
    service: GatewayService, p: Principal, inp: SetCollectionInput
) -> SetCollectionOutput:
    """Put a document in a collection (an exclusive label: at most one per document), or pass
    null to clear it. Search can then filter on the collection. Nothing is re-embedded."""
    patch = (
        DocumentPatch(collection=inp.collection)
        if inp.collection is not None
        else DocumentPatch(clear_collection=True)
    )
    view = await service.documents.patch(p, inp.document_id, patch)
    return SetCollectionOutput(
        document_id=view.document_id,
        title=view.name,
        collection=view.collection,
        revision=view.revision,
    )


class UpdateDocumentInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    document_id: str = Field(min_length=1, max_length=64, description="the document's id")
    tags: list[str] | None = Field(
        None,
        description="the new full tag list (replaces the "
        "current tags; membership in tag-matched knowledge bases "
        "follows)",
    )
    metadata: dict[str, Any] | None = Field(
        None, description="the new metadata (replaces the current metadata)"
    )

    @model_validator(mode="after")
    def _something(self) -> UpdateDocumentInput:
        if self.tags is None and self.metadata is None:
            raise ValueError("give tags, metadata or both")
        return self


@tool("core", title="Update a document's tags or metadata", destructive=True)
async def kb_update_document(
    service: GatewayService, p: Principal, inp: UpdateDocumentInput
) -> DocumentView:
    """Replace a document's tags and/or metadata without touching its text: nothing is
    re-embedded, and search filters see the change once this returns. Use kb_upload with
    document_id to change the text."""
    patch = DocumentPatch(tags=inp.tags, metadata=inp.metadata)
    return await service.documents.patch(p, inp.document_id, patch)


class ListDocumentsInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kb: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="only documents of "
        "this knowledge base (name or id); omitted: all you can access",
    )
    tag: str | None = Field(None, description="only documents with this tag")
    collection: str | None = Field(None, description="only documents in this collection")
    source_id: str | None = Field(None, description="only documents of this source")
    name_search: str | None = Field(None, description="only documents whose name contains this")
    writer: str | None = Field(
        None,
        max_length=200,
        description="only documents a revision of which this writer wrote: an API key's id or "
        "name, a publisher's user, or local / bus / operator",
    )
    skip: int = Field(0, ge=0, description="paging offset")
    limit: int = Field(50, ge=1, le=500, description="page size")


@tool("core", title="List documents", read_only=True, error_fields=KB_FIELD)
async def kb_list_documents(
    service: GatewayService, p: Principal, inp: ListDocumentsInput
) -> Page[DocumentView]:
    """List documents with their id, name, status, tags, collection, metadata, source, the
    knowledge bases they are in and who wrote each revision; filter by knowledge base, tag,
    collection, source, name or writer."""
    return await service.documents.page(
        p,
        kb=inp.kb,
        tag=inp.tag,
        collection=inp.collection,
        source_id=inp.source_id,
        name_search=inp.name_search,
        writer=inp.writer,
        skip=inp.skip,
        limit=inp.limit,
    )


# ---- core: knowledge bases ------------------------------------------------------------------


class ListKbsInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name_search: str | None = Field(
        None, description="only knowledge bases whose name contains this"
    )
    skip: int = Field(0, ge=0, description="paging offset")
    limit: int = Field(50, ge=1, le=200, description="page size")


@tool("core", title="List knowledge bases", read_only=True)
async def kb_list(service: GatewayService, p: Principal, inp: ListKbsInput) -> KbList:
    """List the knowledge bases you can access, with their description, settings, status and
    document and chunk counts. Use it to pick the kb for kb_search or kb_upload."""
    return await service.kbs.page(p, inp.skip, inp.limit, inp.name_search)


@tool("core", title="Create a knowledge base")
async def kb_create(service: GatewayService, p: Principal, inp: KbCreate) -> KbView:
    """Create a knowledge base with its own chunking and embedding settings. tag_ids make
    every document carrying one of those tags a member automatically."""
    return await service.kbs.create(p, inp)


class KbUpdateInput(KbUpdate):
    kb: KbName


@tool("core", title="Update a knowledge base", destructive=True, error_fields=KB_FIELD)
async def kb_update(service: GatewayService, p: Principal, inp: KbUpdateInput) -> KbView:
    """Change a knowledge base's name, description, tag_ids or settings. Changing chunking or
    the embedding model re-indexes every document (status pending_reindex); search keeps
    answering from the old index meanwhile. Only the fields you pass change."""
    changes = KbUpdate.model_validate(inp.model_dump(exclude_unset=True, exclude={"kb"}))
    return await service.kbs.update(p, inp.kb, changes)


class KbRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kb: KbName


@tool("core", title="Knowledge base statistics", read_only=True, error_fields=KB_FIELD)
async def kb_stats(service: GatewayService, p: Principal, inp: KbRef) -> KbStats:
    """Counts for one knowledge base: indexed documents and chunks, documents matching its
    tags, failed and pending documents, and progress: how many documents are indexed,
    pending and failed, and how far a reindex has got (done of total)."""
    return await service.kbs.stats(p, inp.kb)


class ReindexInput(KbRef):
    failed_only: bool = Field(False, description="only retry documents whose indexing failed")


@tool("core", title="Re-index a knowledge base", error_fields=KB_FIELD)
async def kb_reindex(service: GatewayService, p: Principal, inp: ReindexInput) -> Ack:
    """Re-index every document of a knowledge base (or, with failed_only, retry the failed
    ones). Runs in the background; watch kb_stats."""
    return await service.kbs.reindex(p, inp.kb, failed_only=inp.failed_only)
