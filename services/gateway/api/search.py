"""REST: search and chunks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from services.common.queries import ChunkResponse, SearchQuery, SearchResponse
from services.gateway.api.deps import Caller, Service

router = APIRouter(prefix="/v1", tags=["search"])


@router.post("/search")
async def search(body: SearchQuery, service: Service, caller: Caller) -> SearchResponse:
    """Hybrid (default), dense or keyword search over one, several or all KBs."""
    return await service.search(caller, body)


@router.get("/chunks/{chunk_id}")
async def get_chunk(
    chunk_id: str,
    service: Service,
    caller: Caller,
    kb: str | None = None,
    neighbors: Annotated[int, Query(ge=0, le=5)] = 0,
) -> ChunkResponse:
    return await service.get_chunk(caller, chunk_id, kb, neighbors)
