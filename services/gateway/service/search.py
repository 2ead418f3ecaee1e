"""Search and chunk reads: names and scope checked here, the work asked of the search
service over NATS request/reply."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from services.common.bus.client import Bus
from services.common.bus.replies import result_json
from services.common.domain.errors import Transient, error_class
from services.common.messages.names import Subject
from services.common.messages.queries import (
    ChunkRequest,
    ChunkResponse,
    RemoteError,
    SearchQuery,
    SearchRequest,
    SearchResponse,
)
from services.gateway.auth import Principal
from services.gateway.service.access import visible_tags
from services.gateway.service.kbs import KnowledgeBases


class Search:
    def __init__(self, bus: Bus, kbs: KnowledgeBases, *, timeout_seconds: float) -> None:
        self.bus = bus
        self.kbs = kbs
        self._timeout = timeout_seconds  # the wait for a search replica's reply

    async def query(self, p: Principal, query: SearchQuery) -> SearchResponse:
        body = await self._request(Subject.SEARCH_QUERY, await self._search_request(p, query))
        response = SearchResponse.model_validate(body)
        for hit in response.hits:
            hit.tags = visible_tags(p, hit.tags)
        return response

    async def query_json(self, p: Principal, query: SearchQuery) -> bytes:
        """`query`'s response as JSON, for REST. A key without a KB scope sees every tag, so
        the search service's JSON goes out as it came, not decoded, validated and encoded
        again (docs/benchmarks.md, "Figures behind the code")."""
        if p.kb_ids is not None:
            return (await self.query(p, query)).model_dump_json().encode()
        request = await self._search_request(p, query)
        timeout = self._timeout
        reply = await ask(self.bus, Subject.SEARCH_QUERY, request, timeout)
        body = result_json(reply)
        return body if body is not None else json.dumps(result(reply)).encode()

    async def _search_request(self, p: Principal, query: SearchQuery) -> SearchRequest:
        if query.kb_ids:
            # Names and ids, checked against scope here so errors name what was asked for.
            kbs = [await self.kbs.resolve(p, ref) for ref in query.kb_ids]
            query = query.model_copy(update={"kb_ids": [k.kb_id for k in kbs]})
        return SearchRequest(**query.model_dump(), org_id=p.org_id, scope_kb_ids=p.scope)

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
        return await request_reply(self.bus, subject, request, self._timeout)


async def request_reply(
    bus: Bus, subject: str, request: BaseModel, timeout: float
) -> dict[str, Any]:
    """Ask the search service; its errors come back as `RemoteError` bodies and are raised
    here as the same kbmesh errors."""
    return result(await ask(bus, subject, request, timeout))


async def ask(bus: Bus, subject: str, request: BaseModel, timeout: float) -> bytes:
    """The search service's reply as it came; no answer in time, or no service, is Transient."""
    try:
        return await bus.ask(subject, request, timeout=timeout)
    except TimeoutError as err:
        raise Transient("search service did not answer in time") from err
    except Exception as err:
        if "no responders" in str(err).lower() or type(err).__name__ == "NoRespondersError":
            raise Transient("no search service is running") from err
        raise


def result(reply: bytes) -> dict[str, Any]:
    """The result a reply holds; its error raised as the same kbmesh error."""
    body = json.loads(reply)
    if "error" in body:
        error = RemoteError.model_validate(body["error"])
        raise error_class(error.error_type)(error.message, field=error.field)
    found: dict[str, Any] = body["result"]
    return found
