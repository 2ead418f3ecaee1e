"""FastAPI dependencies: the gateway's parts and the caller's principal."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Request, Response

from services.gateway.auth import KeyResolver, Principal
from services.gateway.guard import resolved_principal
from services.gateway.schemas import UploadResult
from services.gateway.service import (
    Answers,
    AuditLog,
    DeadLetters,
    Documents,
    GatewayService,
    KnowledgeBases,
    Search,
    Sources,
)

# `async def` throughout, though none of them waits: FastAPI runs a plain `def` dependency
# in its thread pool, a thread hop per request for nothing.


async def get_service(request: Request) -> GatewayService:
    return _service(request)


def _service(request: Request) -> GatewayService:
    service: GatewayService = request.app.state.service
    return service


async def get_kbs(request: Request) -> KnowledgeBases:
    return _service(request).kbs


async def get_documents(request: Request) -> Documents:
    return _service(request).documents


async def get_search(request: Request) -> Search:
    return _service(request).search


async def get_answers(request: Request) -> Answers:
    return _service(request).answers


async def get_dead_letters(request: Request) -> DeadLetters:
    return _service(request).dead_letters


async def get_audit(request: Request) -> AuditLog:
    return _service(request).audit


async def get_sources(request: Request) -> Sources:
    return _service(request).sources


async def get_keys(request: Request) -> KeyResolver:
    keys: KeyResolver = request.app.state.keys
    return keys


async def get_principal(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    resolved = resolved_principal(request.scope)  # writes: resolved before the body was read
    if resolved is not None:
        return resolved
    resolver: KeyResolver = request.app.state.keys
    host = request.client.host if request.client else None
    return await resolver.resolve(authorization, host)


Gateway = Annotated[GatewayService, Depends(get_service)]
Kbs = Annotated[KnowledgeBases, Depends(get_kbs)]
Docs = Annotated[Documents, Depends(get_documents)]
Searcher = Annotated[Search, Depends(get_search)]
Answerer = Annotated[Answers, Depends(get_answers)]
Letters = Annotated[DeadLetters, Depends(get_dead_letters)]
AuditTrail = Annotated[AuditLog, Depends(get_audit)]
SourceDefs = Annotated[Sources, Depends(get_sources)]
Caller = Annotated[Principal, Depends(get_principal)]
Keys = Annotated[KeyResolver, Depends(get_keys)]

# With wait=true an upload that finished answers 200 instead of 202.
WAITED: dict[int | str, dict[str, Any]] = {
    200: {"model": UploadResult, "description": "indexed (or stored) before answering"}
}


def answered(result: UploadResult, response: Response) -> UploadResult:
    """An upload's answer: 200 once it is indexed (or stored in no KB), 202 while it is not."""
    if result.status in ("complete", "stored"):
        response.status_code = 200
    return result
