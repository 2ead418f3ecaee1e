"""Search's request/reply subscribers, in a queue group so replicas share the load."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from faststream.nats import NatsRouter
from faststream.nats.annotations import NatsMessage
from pydantic import BaseModel, ValidationError

from services.common import metrics
from services.common.answers import AskRequest
from services.common.errors import KbmeshError
from services.common.events import Subject
from services.common.queries import ChunkRequest, RemoteError, SearchRequest, SearchResponse
from services.search import reply
from services.search.ask import AskService
from services.search.service import SearchService

log = logging.getLogger("kbmesh.search")
QUEUE = "search"
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default


def create_router(
    service: SearchService,
    ask: AskService | None = None,
    *,
    concurrency: int = 1,
    ask_concurrency: int = 1,
    max_payload: Callable[[], int] = lambda: DEFAULT_MAX_PAYLOAD,
) -> NatsRouter:
    """`max_payload` reads the connected server's message size limit."""
    router = NatsRouter()

    async def search(request: SearchRequest) -> SearchResponse:
        return reply.fit(await service.search(request), max_payload())

    # Requests are answered concurrently: a reply spends most of its time waiting on the
    # model and engine threads, and concurrent query embeddings are coalesced.
    @router.subscriber(Subject.SEARCH_QUERY, queue=QUEUE, max_workers=concurrency)
    async def on_search(msg: NatsMessage) -> dict[str, Any]:
        metrics.SEARCH_REQUESTS.inc()
        with metrics.SEARCH_SECONDS.time():
            return await _answer(msg.body, SearchRequest, search)

    @router.subscriber(Subject.SEARCH_CHUNK, queue=QUEUE, max_workers=concurrency)
    async def on_chunk(msg: NatsMessage) -> dict[str, Any]:
        return await _answer(msg.body, ChunkRequest, service.get_chunk)

    if ask is not None:
        answerer = ask

        # Answers take seconds to minutes (several model calls): their own workers, so that
        # they never hold up searches, which answers themselves make.
        @router.subscriber(Subject.SEARCH_ASK, queue=QUEUE, max_workers=ask_concurrency)
        async def on_ask(msg: NatsMessage) -> dict[str, Any]:
            return await _answer(msg.body, AskRequest, answerer.ask)

    return router


async def _answer(
    body: bytes,
    model: type[BaseModel],
    call: Callable[[Any], Awaitable[BaseModel]],
) -> dict[str, Any]:
    """Requests never raise across the bus: errors travel as a `RemoteError` body."""
    try:
        result = await call(model.model_validate_json(body))
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        return {
            "error": RemoteError(
                error_type="ValidationError", message=f"{field}: {first['msg']}", field=field
            ).model_dump()
        }
    except KbmeshError as err:
        return {
            "error": RemoteError(
                error_type=err.error_type, message=err.message, field=err.field
            ).model_dump()
        }
    except Exception as err:
        log.exception("search request failed")
        return {
            "error": RemoteError(
                error_type="InternalError", message=f"search failed: {type(err).__name__}"
            ).model_dump()
        }
    return {"result": result.model_dump(mode="json")}
