"""REST: knowledge bases, their documents and their uploads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from services.gateway.api.deps import WAITED, Caller, Docs, Kbs, answered
from services.gateway.api.files import accepts_files, receive_file
from services.gateway.api.routing import StrictBodyRoute
from services.gateway.schemas import (
    Ack,
    DefaultsView,
    KbCreate,
    KbDocumentStatus,
    KbDocumentView,
    KbList,
    KbStats,
    KbUpdate,
    KbView,
    Page,
    UploadBody,
    UploadResult,
)

router = APIRouter(prefix="/v1/kbs", tags=["knowledge bases"], route_class=StrictBodyRoute)
defaults_router = APIRouter()
Wait = Annotated[bool, Query(description="wait until the index reflects the change")]


@defaults_router.get("/v1/defaults", tags=["knowledge bases"])
async def get_defaults(kbs: Kbs, caller: Caller) -> DefaultsView:
    """The settings a knowledge base gets when none are given, per embedding model, and the
    limits on what clients send. Clients read these instead of keeping their own copy."""
    return await kbs.defaults()


@router.post("", status_code=201)
async def create_kb(body: KbCreate, kbs: Kbs, caller: Caller) -> KbView:
    return await kbs.create(caller, body)


@router.get("")
async def list_kbs(
    kbs: Kbs,
    caller: Caller,
    skip: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    name_search: str | None = None,
) -> KbList:
    return await kbs.page(caller, skip, limit, name_search)


@router.get("/{kb}")
async def get_kb(kb: str, kbs: Kbs, caller: Caller) -> KbView:
    return await kbs.get(caller, kb)


@router.patch("/{kb}")
async def update_kb(kb: str, body: KbUpdate, kbs: Kbs, caller: Caller) -> KbView:
    return await kbs.update(caller, kb, body)


@router.delete("/{kb}")
async def delete_kb(kb: str, kbs: Kbs, caller: Caller) -> Ack:
    return await kbs.delete(caller, kb)


@router.post("/{kb}/reindex", status_code=202)
async def reindex(kb: str, kbs: Kbs, caller: Caller) -> Ack:
    return await kbs.reindex(caller, kb)


@router.post("/{kb}/retry-failed", status_code=202)
async def retry_failed(kb: str, kbs: Kbs, caller: Caller) -> Ack:
    return await kbs.reindex(caller, kb, failed_only=True)


@router.get("/{kb}/stats")
async def stats(kb: str, kbs: Kbs, caller: Caller) -> KbStats:
    return await kbs.stats(caller, kb)


@router.get("/{kb}/documents")
async def kb_documents(
    kb: str,
    kbs: Kbs,
    caller: Caller,
    skip: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    name_search: str | None = None,
    status: Annotated[
        KbDocumentStatus | None, Query(description="only documents in this state")
    ] = None,
) -> Page[KbDocumentView]:
    return await kbs.documents(caller, kb, skip, limit, name_search, status)


async def upload_file_to_kb(
    kb: str,
    request: Request,
    documents: Docs,
    caller: Caller,
    response: Response,
    wait: Wait = False,
) -> UploadResult:
    result = await receive_file(request, documents, caller, kb, wait=wait)
    return answered(result, response)


@router.post("/{kb}/documents", status_code=202, responses=WAITED)
@accepts_files(upload_file_to_kb)
async def upload_to_kb(
    kb: str,
    body: UploadBody,
    documents: Docs,
    caller: Caller,
    response: Response,
    wait: Wait = False,
) -> UploadResult:
    """Upload a document into this KB (its implicit tag) and any KB its tags match."""
    result = await documents.upload(caller, body, kb, wait=wait)
    return answered(result, response)
