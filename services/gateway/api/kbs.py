"""REST: knowledge bases, their documents and their uploads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from services.gateway.api.deps import WAITED, Caller, Service
from services.gateway.schemas import (
    Ack,
    KbCreate,
    KbDocumentView,
    KbList,
    KbStats,
    KbUpdate,
    KbView,
    Page,
    UploadBody,
    UploadResult,
)

router = APIRouter(prefix="/v1/kbs", tags=["knowledge bases"])
Wait = Annotated[bool, Query(description="wait until the index reflects the change")]


@router.post("", status_code=201)
async def create_kb(body: KbCreate, service: Service, caller: Caller) -> KbView:
    return await service.create_kb(caller, body)


@router.get("")
async def list_kbs(
    service: Service,
    caller: Caller,
    skip: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    name_search: str | None = None,
) -> KbList:
    return await service.list_kbs(caller, skip, limit, name_search)


@router.get("/{kb}")
async def get_kb(kb: str, service: Service, caller: Caller) -> KbView:
    return await service.get_kb(caller, kb)


@router.patch("/{kb}")
async def update_kb(kb: str, body: KbUpdate, service: Service, caller: Caller) -> KbView:
    return await service.update_kb(caller, kb, body)


@router.delete("/{kb}")
async def delete_kb(kb: str, service: Service, caller: Caller) -> Ack:
    return await service.delete_kb(caller, kb)


@router.post("/{kb}/reindex", status_code=202)
async def reindex(kb: str, service: Service, caller: Caller) -> Ack:
    return await service.reindex_kb(caller, kb)


@router.post("/{kb}/retry-failed", status_code=202)
async def retry_failed(kb: str, service: Service, caller: Caller) -> Ack:
    return await service.reindex_kb(caller, kb, failed_only=True)


@router.get("/{kb}/stats")
async def stats(kb: str, service: Service, caller: Caller) -> KbStats:
    return await service.kb_stats(caller, kb)


@router.get("/{kb}/documents")
async def kb_documents(
    kb: str,
    service: Service,
    caller: Caller,
    skip: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    name_search: str | None = None,
) -> Page[KbDocumentView]:
    return await service.kb_documents(caller, kb, skip, limit, name_search)


@router.post("/{kb}/documents", status_code=202, responses=WAITED)
async def upload_to_kb(
    kb: str,
    body: UploadBody,
    service: Service,
    caller: Caller,
    response: Response,
    wait: Wait = False,
) -> UploadResult:
    """Upload a document into this KB (its implicit tag) and any KB its tags match."""
    result = await service.upload(caller, body, kb, wait=wait)
    if result.status in ("complete", "stored"):
        response.status_code = 200
    return result
