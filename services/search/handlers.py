"""Search's request/reply responders, in a queue group so replicas share the load."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from services.common.bus.replies import DEFAULT_MAX_PAYLOAD, Responder, envelope
from services.common.domain.errors import KbmeshError
from services.common.messages.answers import AskRequest
from services.common.messages.names import Subject
from services.common.messages.queries import ChunkRequest, RemoteError, SearchRequest
from services.common.ops import metrics
from services.search import reply
from services.search.ask import AskService
from services.search.service import SearchService

log = logging.getLogger("kbmesh.search")
QUEUE = "search"


def create_responders(
    service: SearchService,
    ask: AskService | None = None,
    *,
    concurrency: int = 1,
    ask_concurrency: int = 1,
    max_payload: Callable[[], int] = lambda: DEFAULT_MAX_PAYLOAD,
) -> list[Responder]:
    """`max_payload` reads the connected server's message size limit."""

    async def search(request: SearchRequest) -> bytes:
        return reply.fitted_json(await service.search(request), max_payload())

    # Requests are answered concurrently: a reply spends much of its time waiting on the
    # model's thread, and concurrent query embeddings are coalesced.
    async def on_search(body: bytes) -> bytes:
        metrics.SEARCH_REQUESTS.inc()
        with metrics.SEARCH_SECONDS.time():
            return await _answer(body, SearchRequest, search)

    async def on_chunk(body: bytes) -> bytes:
        return await _answer(body, ChunkRequest, service.get_chunk)

    responders = [
        Responder(Subject.SEARCH_QUERY, on_search, queue=QUEUE, concurrency=concurrency),
        Responder(Subject.SEARCH_CHUNK, on_chunk, queue=QUEUE, concurrency=concurrency),
    ]
    if ask is not None:
        answerer = ask

        async def on_ask(body: bytes) -> bytes:
            return await _answer(body, AskRequest, answerer.ask)

        # Answers take seconds to minutes (several model calls): their own slots, so that
        # they never hold up searches, which answers themselves make.
        responders.append(
            Responder(Subject.SEARCH_ASK, on_ask, queue=QUEUE, concurrency=ask_concurrency)
        )
    return responders


async def _answer(
    body: bytes,
    model: type[BaseModel],
    call: Callable[[Any], Awaitable[BaseModel | bytes]],
) -> bytes:
    """Requests never raise across the bus: errors travel as a `RemoteError` body."""
    try:
        result = await call(model.model_validate_json(body))
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        error = RemoteError(
            error_type="ValidationError", message=f"{field}: {first['msg']}", field=field
        )
    except KbmeshError as err:
        error = RemoteError(error_type=err.error_type, message=err.message, field=err.field)
    except Exception as err:
        log.exception("search request failed")
        error = RemoteError(
            error_type="InternalError", message=f"search failed: {type(err).__name__}"
        )
    else:
        body = result if isinstance(result, bytes) else result.model_dump_json().encode()
        return envelope("result", body)
    return envelope("error", error.model_dump_json().encode())
