"""REST: live progress of a knowledge base (server-sent events), cancelling a reindex, and
the process's Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sse_starlette import EventSourceResponse

from services.common.domain.errors import Forbidden
from services.common.ops import metrics
from services.gateway.api.deps import Caller, Gateway, Kbs, Keys
from services.gateway.progress import KEEPALIVE_SECONDS, event_stream
from services.gateway.schemas import Ack, KbProgress

router = APIRouter(tags=["progress"])


# The stream and the metrics are not JSON operations: they stay out of the OpenAPI document
# (and so out of contract examples and schema-driven fuzzing, which would wait on the stream).
@router.get("/v1/kbs/{kb}/events", include_in_schema=False)
async def kb_events(kb: str, service: Gateway, caller: Caller) -> Response:
    """Server-sent events for one knowledge base, from the moment of the call: `progress`
    (the stats' `progress` object, sent first and whenever it changes: uploads, indexing,
    failures, reindex), `document` (a document indexed, failed or removed here) and
    `deleted` (the KB is gone; the stream ends). Comments keep idle connections open."""
    found = await service.kbs.resolve(caller, kb)

    async def snapshot() -> KbProgress | None:
        current = await service.reg.kbs.get(f"{found.org_id}.{found.kb_id}")
        return None if current is None else await service.kbs.progress(current)

    stream = event_stream(service.progress, caller.org_id, found.kb_id, snapshot)
    return EventSourceResponse(stream, ping=KEEPALIVE_SECONDS)


@router.post("/v1/kbs/{kb}/reindex/cancel", tags=["knowledge bases"])
async def cancel_reindex(kb: str, kbs: Kbs, caller: Caller) -> Ack:
    """Abandon the running reindex: searches keep answering from the index they used, the
    half-built one is dropped, and the KB's settings return to that index's. 409 when no
    reindex is running."""
    return await kbs.cancel_reindex(caller, kb)


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(service: Gateway, caller: Caller, keys: Keys) -> Response:
    """Prometheus metrics of this process (all services with `kbmesh up`): every org's
    counts together, so only for the operator. Keyless, that is whoever may call at all (a
    loopback client). Once API keys exist no key is the operator's: they map to orgs, and
    the metrics are served on the operator port (`KBMESH_METRICS_PORT`) instead."""
    if await keys.any_keys():
        raise Forbidden(
            "with API keys, the metrics are served on the operator port (KBMESH_METRICS_PORT), "
            "not to API keys"
        )
    await metrics.refresh_bus_gauges(service.bus.js)
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)
