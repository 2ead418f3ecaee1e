"""Prometheus metrics: what every service counts, and the bus gauges read from JetStream.

The metrics live in the client library's default registry, as Prometheus expects one
registry per process: `kbmesh up` (all services in one process) serves them all at the
gateway's `/metrics`; a process started with `KBMESH_METRICS_PORT` serves its own there.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from nats.js import JetStreamContext
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from services.common.domain.models import utcnow
from services.common.messages.names import DLQ_STREAM, STREAM, UPSTREAM_STREAM

log = logging.getLogger("kbmesh.metrics")
# Seconds between bus gauge refreshes in processes without a gateway (scrapes refresh too).
BUS_REFRESH_SECONDS = 15.0

DOCUMENTS_INDEXED = Counter(
    "kbmesh_documents_indexed", "Documents indexed into a knowledge base (one per KB)"
)
DOCUMENTS_FAILED = Counter("kbmesh_documents_failed", "Documents that failed, by stage", ["stage"])
CHUNKS_EMBEDDED = Counter("kbmesh_chunks_embedded", "Chunks the embedder encoded")
SEARCH_REQUESTS = Counter("kbmesh_search_requests", "Search requests answered")
INDEX_SECONDS = Histogram(
    "kbmesh_index_seconds",
    "From an upload accepted to its document indexed in a knowledge base",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
EMBED_BATCH_SECONDS = Histogram(
    "kbmesh_embed_batch_seconds",
    "Time of one embedding model call over a batch of chunks (of one or more documents)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SEARCH_SECONDS = Histogram(
    "kbmesh_search_seconds",
    "Time to answer one search request",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PENDING_MESSAGES = Gauge(
    "kbmesh_pending_messages",
    "Messages waiting for (or being worked by) a consumer of the event stream",
    ["consumer"],
)
DEAD_LETTERS = Gauge("kbmesh_dead_letters", "Messages in the dead-letter stream")
DOCUMENT_ID_READS = Gauge(
    "kbmesh_search_document_id_reads",
    "Collections whose chunks' document ids search is still reading in the background (each "
    "from its first search on); until a read ends, searches of that collection run slower",
)
DOCUMENT_IDS = Gauge(
    "kbmesh_search_document_ids", "Chunks whose document id search remembers (services/search)"
)


def index_latency(accepted_at: datetime | None) -> None:
    if accepted_at is not None:
        INDEX_SECONDS.observe(max((utcnow() - accepted_at).total_seconds(), 0.0))


async def refresh_bus_gauges(js: JetStreamContext) -> None:
    """Pending messages per durable consumer of the event streams (kbmesh's own and the
    upstream publishers'), and dead letters."""
    consumers = [
        info for stream in (STREAM, UPSTREAM_STREAM) for info in await js.consumers_info(stream)
    ]
    for info in consumers:
        name = info.name or (info.config.durable_name if info.config else None) or "?"
        PENDING_MESSAGES.labels(consumer=name).set(
            (info.num_pending or 0) + (info.num_ack_pending or 0)
        )
    dlq = await js.stream_info(DLQ_STREAM)
    DEAD_LETTERS.set(dlq.state.messages)


def exposition() -> tuple[bytes, str]:
    """The text format body and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST


def serve(port: int, host: str = "0.0.0.0") -> None:
    """This process's metrics on their own port (services without a gateway)."""
    start_http_server(port, addr=host)
    log.info("metrics port=%d", port)


async def follow_bus(js: JetStreamContext) -> None:
    """Keep the bus gauges fresh for a metrics port that has no request hook."""
    while True:
        try:
            await refresh_bus_gauges(js)
        except Exception as err:  # a bus hiccup must not end the metrics
            log.warning("bus gauges not refreshed error=%r", err)
        await asyncio.sleep(BUS_REFRESH_SECONDS)
