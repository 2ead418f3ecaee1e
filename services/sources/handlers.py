"""The sources service's bus subscribers: a `source.sync` asks for a run, which the
scheduler starts at once (here, or on whichever replica is free first)."""

from __future__ import annotations

from faststream.nats import NatsRouter

from services.common.bus.client import Bus, consume
from services.common.messages.events import SourceSync
from services.common.messages.names import Subject
from services.sources.service import SourcesService


def create_router(bus: Bus, service: SourcesService) -> NatsRouter:
    router = NatsRouter()

    async def on_sync(ev: SourceSync) -> None:
        # Recorded in the source's state (durable, seen by every replica), not run inside
        # the delivery: a long run would hold the consumer, and a replica that dies
        # mid-run would leave the request to the lease's expiry either way.
        await service.request(ev.org_id, ev.source_id, ev.trigger)

    consume(router, bus, Subject.SOURCE_SYNC, "sources-source-sync", on_sync)
    return router
