"""The agent tools: one input model, one output model and one thin async function over
`GatewayService` per tool. MCP (`mcp.py`) and REST (`api/tools.py`) both run them through
`run_tool`, so the two surfaces answer with the same JSON; these models are the single source
of the tool contracts (`TOOLS` is the registry the contract export reads).

Toolsets: `core` — kbmesh's own knowledge-base lifecycle; `compat` — the names, parameters and
result shapes that existing knowledge-base clients already call. A tool may be in both.

Docstrings of the tool functions and `Field` descriptions are product text: an LLM reads them
to choose a tool and fill its arguments.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import PurePosixPath
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints
from urllib.parse import unquote, urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.content import HTML_TYPES, TEXT_TYPES, normalise_mime
from services.common.errors import Conflict, InvalidInput, KbmeshError, NotFound
from services.common.models import DEFAULT_SOURCE, point_id
from services.common.queries import (
    ChunkResponse,
    SearchFilters,
    SearchHit,
    SearchQuery,
    SearchResponse,
)
from services.common.store.base import Mode
from services.gateway.auth import Principal
from services.gateway.fetch import fetch_url, read_path
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
    UploadResult,
)
from services.gateway.service import GatewayService

log = logging.getLogger("kbmesh.tools")

TOOLSETS = ("core", "compat")
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


# ---- registry -------------------------------------------------------------------------------

ToolFn = Callable[[GatewayService, Principal, Any], Awaitable[BaseModel]]


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its contract (input and output models) and the function that runs it."""

    name: str
    toolsets: tuple[str, ...]
    title: str
    description: str
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    fn: ToolFn
    render: Callable[[Any], str] | None = None
    read_only: bool = False
    destructive: bool = False
    open_world: bool = False
    # manageKnowledge answers several operations with one model: unused fields stay out.
    exclude_none: bool = False

    @cached_property
    def input_schema(self) -> dict[str, Any]:
        return self.input_model.model_json_schema()

    @cached_property
    def output_schema(self) -> dict[str, Any]:
        return self.output_model.model_json_schema()


TOOLS: dict[str, ToolSpec] = {}


def tool(
    *toolsets: str,
    title: str,
    render: Callable[[Any], str] | None = None,
    read_only: bool = False,
    destructive: bool = False,
    open_world: bool = False,
    exclude_none: bool = False,
) -> Callable[[ToolFn], ToolFn]:
    """Register `fn(service, principal, input) -> output` under its own name; the input and
    output models are read from its annotations and the description from its docstring."""

    def register(fn: ToolFn) -> ToolFn:
        hints = get_type_hints(fn)
        TOOLS[fn.__name__] = ToolSpec(
            name=fn.__name__,
            toolsets=toolsets,
            title=title,
            # One paragraph per blank-line block: clients show descriptions reflowed.
            description=re.sub(r"(?<!\n)\n(?!\n)", " ", inspect.cleandoc(fn.__doc__ or "")),
            input_model=hints["inp"],
            output_model=hints["return"],
            fn=fn,
            render=render,
            read_only=read_only,
            destructive=destructive,
            open_world=open_world,
            exclude_none=exclude_none,
        )
        return fn

    return register


def tools_for(toolsets: list[str] | tuple[str, ...]) -> dict[str, ToolSpec]:
    unknown = [t for t in toolsets if t not in TOOLSETS]
    if unknown:
        raise ValueError(
            f"KBMESH_MCP_TOOLSETS: unknown toolset(s) {', '.join(unknown)}; "
            f"choose from {', '.join(TOOLSETS)}"
        )
    return {n: s for n, s in TOOLS.items() if set(s.toolsets) & set(toolsets)}


class ToolErrorResult(BaseModel):
    """What every tool returns on failure (flagged `isError` in MCP; a 4xx/5xx in REST)."""

    status: Literal["error"] = "error"
    error_type: str = Field(
        description="ValidationError, ContentTooLarge, NotFound, "
        "Forbidden, Unauthorized, Conflict, FetchError, Unavailable, ..."
    )
    message: str
    field: str | None = Field(None, description="the input field at fault, when known")


@dataclass(frozen=True)
class ToolOutcome:
    structured: dict[str, Any]
    text: str
    error: KbmeshError | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def status_code(self) -> int:
        return self.error.status_code if self.error is not None else 200


async def run_tool(
    spec: ToolSpec, service: GatewayService, principal: Principal, arguments: Mapping[str, Any]
) -> ToolOutcome:
    """Validate, run, and map the result or error: the one path both transports take."""
    try:
        inp = spec.input_model.model_validate(_json_strings(spec.input_model, arguments))
        output = await spec.fn(service, principal, inp)
    except ValidationError as err:
        return error_outcome(_invalid(err))
    except KbmeshError as err:
        return error_outcome(err)
    except Exception:
        # Recorded here with its traceback; the caller sees only that it happened.
        log.exception("tool_failed tool=%s org_id=%s", spec.name, principal.org_id)
        return error_outcome(
            KbmeshError(f"internal error while running {spec.name}; the server log has the details")
        )
    structured = output.model_dump(mode="json", exclude_none=spec.exclude_none)
    text = (
        spec.render(output) if spec.render else json.dumps(structured, indent=2, ensure_ascii=False)
    )
    return ToolOutcome(structured=structured, text=text)


def error_outcome(err: KbmeshError) -> ToolOutcome:
    result = ToolErrorResult(error_type=err.error_type, message=err.message, field=err.field)
    return ToolOutcome(
        structured=result.model_dump(exclude_none=True),
        text=f"Error ({err.error_type}): {err.message}",
        error=err,
    )


def _invalid(err: ValidationError) -> InvalidInput:
    parts, first_field = [], None
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"])
        first_field = first_field or loc or None
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return InvalidInput("invalid arguments: " + "; ".join(parts), field=first_field)


def _json_strings(model: type[BaseModel], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Some clients send lists and objects as JSON text; decode those for non-string fields."""
    out = dict(arguments or {})
    for name, value in out.items():
        field = model.model_fields.get(name)
        if field is None or _accepts_str(field.annotation) or not isinstance(value, str):
            continue
        if value.lstrip()[:1] in ("[", "{"):
            with contextlib.suppress(ValueError):
                out[name] = json.loads(value)
    return out


def _accepts_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) in (Union, UnionType, Literal):
        return any(_accepts_str(a) or isinstance(a, str) for a in get_args(annotation))
    return False


# ---- rendering ------------------------------------------------------------------------------


def _hit_header(hit: SearchHit) -> str:
    where = hit.uri or hit.source_id or ""
    score = f", score {hit.score:.3f}" if hit.score is not None else ""
    return (
        f"{hit.document_name} — chunk {hit.chunk_index + 1} of {hit.total_chunks}{score}"
        + (f"\n    source: {where}" if where else "")
        + f"\n    kb: {hit.kb_id} · document_id: {hit.document_id} · chunk_id: {hit.chunk_id}"
    )


def render_search(resp: SearchResponse) -> str:
    matched = [h for h in resp.hits if h.is_matched]
    if not matched:
        return f'No results for "{resp.query}".'
    lines = [
        f'{len(matched)} result(s) for "{resp.query}" ({resp.mode.value} search; '
        f"score = {resp.score_kind}):"
    ]
    n = 0
    for hit in resp.hits:
        if hit.is_matched:
            n += 1
            lines.append(f"\n[{n}] {_hit_header(hit)}\n{hit.content}")
        else:
            lines.append(
                f"\n    (context: chunk {hit.chunk_index + 1} of {hit.document_name})"
                f"\n{hit.content}"
            )
    return "\n".join(lines)


def render_chunk(resp: ChunkResponse) -> str:
    chunks = sorted([resp.chunk, *resp.neighbors], key=lambda h: h.chunk_index)
    lines = [_hit_header(resp.chunk)]
    for h in chunks:
        marker = ">>" if h.chunk_id == resp.chunk.chunk_id else "  "
        lines.append(f"\n{marker} chunk {h.chunk_index + 1}:\n{h.content}")
    return "\n".join(lines)


# ---- core: search and chunks ----------------------------------------------------------------

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
        description="drop matches scoring below this (cosine similarity 0-1 in hybrid "
        "and dense mode, BM25 relative to the best match in keyword mode)",
    )


@tool("core", title="Search knowledge bases", render=render_search, read_only=True)
async def kb_search(service: GatewayService, p: Principal, inp: KbSearchInput) -> SearchResponse:
    """Search the knowledge bases for passages relevant to a question. Use this first whenever
    an answer may depend on documents stored in kbmesh. Returns a numbered, source-attributed
    list (document, chunk, score, uri) and the structured hits; cite the document names.
    Use filters to restrict by tags, collection, source, document or metadata, and
    coalesce_neighbors to get surrounding context. Call kb_get_chunk to expand one hit."""
    query = SearchQuery(
        query=inp.query,
        kb_ids=[inp.kb] if inp.kb else None,
        top_k=inp.top_k,
        mode=inp.mode,
        filters=inp.filters,
        min_score=inp.min_score,
        coalesce_neighbors=inp.coalesce_neighbors,
    )
    return await service.search(p, query)


class KbGetChunkInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_id: str = Field(min_length=1, max_length=100, description="chunk_id of a search hit")
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


@tool("core", title="Get a chunk and its neighbours", render=render_chunk, read_only=True)
async def kb_get_chunk(
    service: GatewayService, p: Principal, inp: KbGetChunkInput
) -> ChunkResponse:
    """Fetch one chunk by its chunk_id (from kb_search) with optional neighbouring chunks of
    the same document, to read more context around a search hit."""
    return await service.get_chunk(p, inp.chunk_id, inp.kb, inp.neighbors)


# ---- core: documents ------------------------------------------------------------------------


class KbUploadInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kb: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="knowledge base name or id to add the document to; "
        "omitted: the default knowledge base",
    )
    name: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="document title or file name; required with content, "
        "taken from the URL or file name otherwise",
    )
    content: str | None = Field(
        None,
        description="the document itself: text, or base64 when "
        "content_encoding is base64 (PDF, DOCX, images)",
    )
    content_encoding: Literal["text", "base64"] = Field(
        "text", description="how content is encoded"
    )
    url: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="an http(s) URL for the server to fetch instead of "
        "pasting content (public addresses only, unless allow-listed)",
    )
    path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="a file on the kbmesh server, relative to its upload "
        "root (KBMESH_UPLOAD_ROOT), instead of pasting content",
    )
    mime_type: str | None = Field(
        None,
        description="text/plain, text/markdown, text/html, "
        "application/pdf, DOCX or image/*; omitted: detected",
    )
    tags: list[str] = Field(
        default_factory=list,
        description="labels; the document also joins "
        "every knowledge base whose tag_ids include one of them",
    )
    collection: str | None = Field(
        None, description="an exclusive label (at most one per document), e.g. a product or a team"
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="custom fields, filterable in kb_search"
    )
    source_id: str = Field(
        DEFAULT_SOURCE,
        min_length=1,
        max_length=256,
        description="provenance group, e.g. a repository; kb_delete_source removes a whole group",
    )
    uri: str | None = Field(
        None,
        description="where the document lives, shown with search results; defaults to url or path",
    )
    document_id: str | None = Field(
        None, pattern=ID_PATTERN, description="replace this existing document with a new revision"
    )
    wait: bool = Field(
        True,
        description="wait until the document is searchable (recommended); "
        "false returns at once with status 'processing'",
    )

    @model_validator(mode="after")
    def _one_source(self) -> KbUploadInput:
        given = [n for n in ("content", "url", "path") if getattr(self, n) is not None]
        if len(given) != 1:
            got = f" (got {', '.join(given)})" if given else ""
            raise ValueError(f"give exactly one of content, url or path{got}")
        if self.content is not None and not self.name:
            raise ValueError("name is required with content")
        return self


class KbUploadOutput(UploadResult):
    mime_type: str = Field(description="the type the document was stored and extracted as")


@tool("core", title="Add a document", open_world=True)
async def kb_upload(service: GatewayService, p: Principal, inp: KbUploadInput) -> KbUploadOutput:
    """Add a document to a knowledge base so it becomes searchable: pass its text as content,
    or let the server fetch it from a url, or read it from a server-side path (both avoid
    pasting large documents through the conversation). PDF, DOCX, HTML, markdown and text are
    extracted. Give document_id to replace an existing document. With wait (default) the call
    returns once the document is indexed, with its chunk_count."""
    # Resolved (and write access checked) first: a key that cannot write fetches nothing.
    kb = await service.resolve_kb(p, inp.kb or service.settings.default_kb, write=True)
    name, uri = inp.name, inp.uri
    if inp.content is not None:
        content, encoding = inp.content, inp.content_encoding
        mime = inp.mime_type or normalise_mime(None, name or "")
    else:
        fetched = (
            await fetch_url(inp.url, service.settings)
            if inp.url is not None
            else await read_path(inp.path or "", service.settings)
        )
        content, encoding = base64.b64encode(fetched.data).decode("ascii"), "base64"
        mime = inp.mime_type or fetched.mime_type
        name, uri = name or fetched.name, uri or fetched.uri
    body = UploadBody(
        name=name or "document",
        content=content,
        content_encoding=encoding,
        mime_type=mime,
        tags=inp.tags,
        collection=inp.collection,
        metadata=inp.metadata,
        source_id=inp.source_id,
        uri=uri,
        document_id=inp.document_id,
    )
    result = await service.upload(p, body, kb.kb_id, wait=inp.wait)
    return KbUploadOutput(**result.model_dump(), mime_type=normalise_mime(mime, body.name))


class DocumentRef(BaseModel):
    # Shared with the compat toolset, whose clients may send fields of their own.
    model_config = ConfigDict(extra="ignore")

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


def _delete_output(result: DeleteResult, ref: str) -> DeleteOutput:
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
    return _delete_output(await service.delete_document(p, inp.document_id), inp.document_id)


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
    result = await service.delete_source(p, inp.source_id)
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


@tool("core", "compat", title="Set a document's collection", destructive=False)
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
    view = await service.patch_document(p, inp.document_id, patch)
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


@tool("core", title="Update a document's tags or metadata")
async def kb_update_document(
    service: GatewayService, p: Principal, inp: UpdateDocumentInput
) -> DocumentView:
    """Replace a document's tags and/or metadata without touching its text: nothing is
    re-embedded, and search filters see the change once this returns. Use kb_upload with
    document_id to change the text."""
    patch = DocumentPatch(tags=inp.tags, metadata=inp.metadata)
    return await service.patch_document(p, inp.document_id, patch)


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
    skip: int = Field(0, ge=0, description="paging offset")
    limit: int = Field(50, ge=1, le=500, description="page size")


@tool("core", title="List documents", read_only=True)
async def kb_list_documents(
    service: GatewayService, p: Principal, inp: ListDocumentsInput
) -> Page[DocumentView]:
    """List documents with their id, name, status, tags, collection, metadata, source and the
    knowledge bases they are in; filter by knowledge base, tag, collection, source or name."""
    return await service.list_documents(
        p,
        kb=inp.kb,
        tag=inp.tag,
        collection=inp.collection,
        source_id=inp.source_id,
        name_search=inp.name_search,
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
    return await service.list_kbs(p, inp.skip, inp.limit, inp.name_search)


@tool("core", title="Create a knowledge base")
async def kb_create(service: GatewayService, p: Principal, inp: KbCreate) -> KbView:
    """Create a knowledge base with its own chunking and embedding settings. tag_ids make
    every document carrying one of those tags a member automatically."""
    return await service.create_kb(p, inp)


class KbUpdateInput(KbUpdate):
    kb: KbName


@tool("core", title="Update a knowledge base")
async def kb_update(service: GatewayService, p: Principal, inp: KbUpdateInput) -> KbView:
    """Change a knowledge base's name, description, tag_ids or settings. Changing chunking or
    the embedding model re-indexes every document (status pending_reindex); search keeps
    answering from the old index meanwhile. Only the fields you pass change."""
    changes = KbUpdate.model_validate(inp.model_dump(exclude_unset=True, exclude={"kb"}))
    return await service.update_kb(p, inp.kb, changes)


class KbRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kb: KbName


@tool("core", title="Knowledge base statistics", read_only=True)
async def kb_stats(service: GatewayService, p: Principal, inp: KbRef) -> KbStats:
    """Counts for one knowledge base: indexed documents and chunks, documents matching its
    tags, failed and pending documents."""
    return await service.kb_stats(p, inp.kb)


class ReindexInput(KbRef):
    failed_only: bool = Field(False, description="only retry documents whose indexing failed")


@tool("core", title="Re-index a knowledge base")
async def kb_reindex(service: GatewayService, p: Principal, inp: ReindexInput) -> Ack:
    """Re-index every document of a knowledge base (or, with failed_only, retry the failed
    ones). Runs in the background; watch kb_stats."""
    return await service.reindex_kb(p, inp.kb, failed_only=inp.failed_only)


# ---- compat: search_docs / upload_document / delete_document --------------------------------


async def _project(service: GatewayService, p: Principal, project_id: str) -> str:
    try:
        return (await service.resolve_kb(p, project_id)).kb_id
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


def render_docs(out: SearchDocsOutput) -> str:
    if not out.results:
        return "No matching documents found."
    return "\n\n".join(
        f"{i}. {r.documentTitle} (chunk {r.chunkIndex}, score {r.score:.3f})\n{r.content}"
        for i, r in enumerate(out.results, 1)
    )


@tool("compat", title="Search project documents", render=render_docs, read_only=True)
async def search_docs(
    service: GatewayService, p: Principal, inp: SearchDocsInput
) -> SearchDocsOutput:
    """Search the documents of one project (knowledge base) by meaning. Returns the best
    matching passages with their document title, chunk index and similarity score."""
    kb_id = await _project(service, p, inp.projectId)
    resp = await service.search(
        p,
        SearchQuery(
            query=inp.query,
            kb_ids=[kb_id],
            top_k=inp.topK,
            min_score=inp.minScore,
            coalesce_neighbors=0,
        ),
    )
    return SearchDocsOutput(
        results=[
            DocResult(
                content=h.content,
                documentTitle=h.document_name,
                chunkIndex=h.chunk_index,
                score=h.score or 0.0,
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
    result = await service.upload(p, body, kb_id, wait=True)
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
        return (await service.get_document(p, ref)).document_id
    except NotFound:
        pass
    record = await service.find_by_uri(p, ref)
    if record is not None:
        return record.document_id
    page = await service.list_documents(p, name_search=ref, limit=500)
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
    return _delete_output(await service.delete_document(p, document_id), ref)


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
        resp = await service.search(
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
        found = await service.get_chunk(p, inp.chunkId or "")
        return ManageKnowledgeOutput(
            operation=op, chunk=_knowledge_chunk(found.chunk), message="chunk found"
        )
    if op == "deleteBySource":
        deleted = await service.delete_source(p, inp.sourceId)
        return ManageKnowledgeOutput(
            operation=op,
            sourceId=inp.sourceId,
            deletedCount=deleted.deleted_count,
            message=f"deleted {deleted.deleted_count} document(s) of source {inp.sourceId!r}",
        )
    kb = await service.resolve_kb(p, service.settings.default_kb, write=True)
    existing = await service.find_by_uri(p, inp.uri) if inp.uri else None
    body = UploadBody(
        name=_name_from_uri(inp.uri),
        content=inp.content or "",
        uri=inp.uri,
        source_id=inp.sourceId,
        metadata=inp.metadata or {},
        mime_type=normalise_mime(None, _name_from_uri(inp.uri)),
        document_id=existing.document_id if existing else None,
    )
    result = await service.upload(p, body, kb.kb_id, wait=True)
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
    resp = await service.search(
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
