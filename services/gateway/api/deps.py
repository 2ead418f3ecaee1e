"""FastAPI dependencies: the gateway's parts and the caller's principal."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Request

from services.gateway.auth import KeyResolver, Principal
from services.gateway.schemas import UploadResult
from services.gateway.service import (
    Answers,
    DeadLetters,
    Documents,
    GatewayService,
    KnowledgeBases,
    Search,
)


def get_service(request: Request) -> GatewayService:
    service: GatewayService = request.app.state.service
    return service


def get_kbs(request: Request) -> KnowledgeBases:
    return get_service(request).kbs


def get_documents(request: Request) -> Documents:
    return get_service(request).documents


def get_search(request: Request) -> Search:
    return get_service(request).search


def get_answers(request: Request) -> Answers:
    return get_service(request).answers


def get_dead_letters(request: Request) -> DeadLetters:
    return get_service(request).dead_letters


async def get_principal(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    resolver: KeyResolver = request.app.state.keys
    host = request.client.host if request.client else None
    return await resolver.resolve(authorization, host)


Gateway = Annotated[GatewayService, Depends(get_service)]
Kbs = Annotated[KnowledgeBases, Depends(get_kbs)]
Docs = Annotated[Documents, Depends(get_documents)]
Searcher = Annotated[Search, Depends(get_search)]
Answerer = Annotated[Answers, Depends(get_answers)]
Letters = Annotated[DeadLetters, Depends(get_dead_letters)]
Caller = Annotated[Principal, Depends(get_principal)]

# With wait=true an upload that finished answers 200 instead of 202.
WAITED: dict[int | str, dict[str, Any]] = {
    200: {"model": UploadResult, "description": "indexed (or stored) before answering"}
}
