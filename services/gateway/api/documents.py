"""REST: documents across KBs (membership by tags)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from services.gateway.api.deps import WAITED, Caller, Docs, answered
from services.gateway.api.files import accepts_files, receive_file
from services.gateway.api.routing import StrictBodyRoute
from services.gateway.schemas import (
    DeleteResult,
    DocumentPatch,
    DocumentView,
    Page,
    UploadBody,
    UploadResult,
)

router = APIRouter(prefix="/v1/documents", tags=["documents"], route_class=StrictBodyRoute)
Wait = Annotated[bool, Query(description="wait until the index reflects the change")]


async def upload_file(
    request: Request, documents: Docs, caller: Caller, response: Response, wait: Wait = False
) -> UploadResult:
    result = await receive_file(request, documents, caller, None, wait=wait)
    return answered(result, response)


@router.post("", status_code=202, responses=WAITED)
@accepts_files(upload_file)
async def upload(
    body: UploadBody, documents: Docs, caller: Caller, response: Response, wait: Wait = False
) -> UploadResult:
    """Upload a document; it joins every KB whose tag_ids its tags match (and `kb_id`)."""
    result = await documents.upload(caller, body, None, wait=wait)
    return answered(result, response)


@router.get("")
async def list_documents(
    documents: Docs,
    caller: Caller,
    kb: str | None = None,
    tag: str | None = None,
    collection: str | None = None,
    source_id: str | None = None,
    name_search: str | None = None,
    writer: Annotated[
        str | None,
        Query(
            max_length=200,
            description="only documents a revision of which this writer wrote: an API key's "
            "id or name, a publisher's user, or local / bus / operator",
        ),
    ] = None,
    skip: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> Page[DocumentView]:
    return await documents.page(
        caller,
        kb=kb,
        tag=tag,
        collection=collection,
        source_id=source_id,
        name_search=name_search,
        writer=writer,
        skip=skip,
        limit=limit,
    )


@router.get("/{document_id}")
async def get_document(document_id: str, documents: Docs, caller: Caller) -> DocumentView:
    return await documents.get(caller, document_id)


@router.patch("/{document_id}")
async def patch_document(
    document_id: str, body: DocumentPatch, documents: Docs, caller: Caller, wait: Wait = True
) -> DocumentView:
    """Change tags, collection or metadata: payloads are rewritten, nothing is re-embedded."""
    return await documents.patch(caller, document_id, body, wait=wait)


@router.delete("/{document_id}")
async def delete_document(
    document_id: str, documents: Docs, caller: Caller, wait: Wait = True
) -> DeleteResult:
    """Delete a document everywhere. Unknown ids succeed with deleted_count 0."""
    return await documents.delete(caller, document_id, wait=wait)


@router.delete("")
async def delete_by_source(
    documents: Docs,
    caller: Caller,
    source_id: Annotated[str, Query(min_length=1)],
    wait: Wait = True,
) -> DeleteResult:
    """Delete every document of a source."""
    return await documents.delete_source(caller, source_id, wait=wait)
