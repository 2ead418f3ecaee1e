"""REST: search and chunks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from services.common.messages.queries import ChunkResponse, SearchQuery, SearchResponse
from services.gateway.api.deps import Caller, Searcher
from services.gateway.api.routing import StrictBodyRoute

router = APIRouter(prefix="/v1", tags=["search"], route_class=StrictBodyRoute)


@router.post("/search", response_model=SearchResponse)
async def search(body: SearchQuery, search: Searcher, caller: Caller) -> Response:
    """Hybrid (default), dense or keyword search over one, several or all KBs."""
    # The JSON goes out as the service built it: FastAPI validating and serialising the
    # response model again would cost about as much as the engine query.
    return Response(await search.query_json(caller, body), media_type="application/json")


@router.get("/chunks/{chunk_id}")
async def get_chunk(
    chunk_id: str,
    search: Searcher,
    caller: Caller,
    kb: str | None = None,
    neighbors: Annotated[int, Query(ge=0, le=5)] = 0,
) -> ChunkResponse:
    return await search.chunk(caller, chunk_id, kb, neighbors)
