"""Search and chunk reads: names and scope checked here, the work asked of the search
service over NATS request/reply."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from services.common.bus import Bus
from services.common.errors import Transient, error_class
from services.common.events import Subject
from services.common.queries import (
    ChunkRequest,
    ChunkResponse,
    RemoteError,
    SearchQuery,
    SearchRequest,
    SearchResponse,
)
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.service.access import visible_tags
from services.gateway.service.kbs import KnowledgeBases


class Search:
    def __init__(self, bus: Bus, settings: Settings, kbs: KnowledgeBases) -> None:
        self.bus = bus
        self.settings = settings
        self.kbs = kbs

    async def query(self, p: Principal, query: SearchQuery) -> SearchResponse:
        if query.kb_ids:
            # Names and ids, checked against scope here so errors name what was asked for.
            kbs = [await self.kbs.resolve(p, ref) for ref in query.kb_ids]
            query = query.model_copy(update={"kb_ids": [k.kb_id for k in kbs]})
        request = SearchRequest(**query.model_dump(), org_id=p.org_id, scope_kb_ids=p.scope)
        body = await self._request(Subject.SEARCH_QUERY, request)
        response = SearchResponse.model_validate(body)
        for hit in response.hits:
            hit.tags = visible_tags(p, hit.tags)
        return response

    async def chunk(
        self, p: Principal, chunk_id: str, kb: str | None = None, neighbors: int = 0
    ) -> ChunkResponse:
        kb_id = (await self.kbs.resolve(p, kb)).kb_id if kb else None
        request = ChunkRequest(
            org_id=p.org_id,
            chunk_id=chunk_id,
            kb_id=kb_id,
            neighbors=neighbors,
            scope_kb_ids=p.scope,
        )
        return ChunkResponse.model_validate(await self._request(Subject.SEARCH_CHUNK, request))

    async def _request(self, subject: str, request: BaseModel) -> dict[str, Any]:
        return await request_reply(self.bus, subject, request, self.settings.search.timeout_seconds)


async def request_reply(
    bus: Bus, subject: str, request: BaseModel, timeout: float
) -> dict[str, Any]:
    """Ask the search service; its errors come back as `RemoteError` bodies and are raised
    here as the same kbmesh errors."""
    try:
        reply = await bus.request(subject, request, timeout=timeout)
    except TimeoutError as err:
        raise Transient("search service did not answer in time") from err
    except Exception as err:
        if "no responders" in str(err).lower() or type(err).__name__ == "NoRespondersError":
            raise Transient("no search service is running") from err
        raise
    if "error" in reply:
        error = RemoteError.model_validate(reply["error"])
        raise error_class(error.error_type)(error.message, field=error.field)
    result: dict[str, Any] = reply["result"]
    return result
