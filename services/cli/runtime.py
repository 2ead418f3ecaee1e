"""Composition root: builds the services a process runs, on one bus connection.

`kbmesh up` runs all five on a private nats-server and the embedded store; `kbmesh serve`
runs the named ones against `KBMESH_NATS_URL`. Nothing here holds logic: each service is
built from its parts, and the gateway's app and MCP server from the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import TracerProvider

from services.common.bus import auth as busauth
from services.common.bus.audit import sink as audit_sink
from services.common.bus.client import STARTING_STREAMS, Bus
from services.common.bus.nats_server import NatsServer
from services.common.bus.registry import Registries
from services.common.embedders import EmbedderPool, LocalEmbedder
from services.common.ops import metrics
from services.common.ops.datadir import CURRENT_FORMAT, DataDirError, open_data_dir
from services.common.ops.files import write_private
from services.common.ops.telemetry import configure_telemetry
from services.common.outbound.egress import egress_policy
from services.common.settings import Settings
from services.common.store import VectorStore, create_store

if TYPE_CHECKING:
    # Services are imported when chosen: `kbmesh serve gateway` loads no chunker or model.
    from fastapi import FastAPI

    from services.embed.service import EmbedService
    from services.gateway.auth import KeyResolver, Principal
    from services.gateway.mcp import KbmeshMCP
    from services.gateway.service import GatewayService
    from services.ingest.service import IngestService
    from services.search.ask import AskService
    from services.search.service import SearchService
    from services.sources.fetch import Fetcher
    from services.sources.service import SourcesService

log = logging.getLogger("kbmesh")
SERVICES = ("ingest", "embed", "search", "gateway", "sources")


@dataclass
class Runtime:
    settings: Settings
    services: tuple[str, ...]
    bus: Bus
    registries: Registries
    embedders: EmbedderPool
    store: VectorStore | None = None
    nats: NatsServer | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ingest: IngestService | None = None
    embed: EmbedService | None = None
    search: SearchService | None = None
    ask: AskService | None = None
    gateway: GatewayService | None = None
    sources: SourcesService | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.sources is not None:  # runs under way stop; their leases expire
            with contextlib.suppress(Exception):
                await self.sources.close()
        if self.ingest is not None:  # its extraction children
            with contextlib.suppress(Exception):
                self.ingest.close()
        if self.search is not None:  # its background reads use the store, closed below
            with contextlib.suppress(Exception):
                await self.search.close()
        with contextlib.suppress(Exception):
            await self.registries.close()
        with contextlib.suppress(Exception):
            await self.bus.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self.nats is not None:
            self.nats.stop()


def prepare_data_dir(data_dir: Path) -> None:
    """The data directory holds credentials, documents and vectors: its owner's only (0700;
    files inside are created 0600 by the CLI's umask and by `files.write_private`)."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(data_dir, 0o700)


def start_private_nats(data_dir: Path) -> NatsServer:
    """`kbmesh up`'s own nats-server on `data_dir`, admitting only the users of the data
    directory's credentials; its URL is recorded (0600) for the CLI and `kbmesh mcp`."""
    prepare_data_dir(data_dir)
    server = NatsServer(
        data_dir / "nats", accounts=lambda: busauth.local_accounts(data_dir)
    ).start()
    write_private(data_dir / "nats.url", server.url)
    return server


def check_services(names: Iterable[str], settings: Settings) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(names))
    unknown = [n for n in chosen if n not in SERVICES]
    if unknown:
        raise SystemExit(f"unknown service(s): {', '.join(unknown)}; choose from {SERVICES}")
    if settings.store_kind == "edge" and ("embed" in chosen) != ("search" in chosen):
        raise SystemExit(
            "with the embedded store (no KBMESH_QDRANT_URL), embed and search share the "
            "Edge shards and must run in one process: `kbmesh serve embed search`"
        )
    return chosen


def check_data_dir(path: Path) -> None:
    """The data dir in the format this kbmesh writes (an older one migrated), before anything
    opens it; a newer one stops the process with the reason."""
    try:
        found = open_data_dir(path)
    except DataDirError as err:
        raise SystemExit(f"kbmesh: {err}") from err
    if found < CURRENT_FORMAT:
        log.info("data dir %s migrated from format %d to %d", path, found, CURRENT_FORMAT)


async def build_runtime(
    settings: Settings,
    services: Iterable[str] = SERVICES,
    *,
    embedded_nats: bool = False,
    span_processors: list[SpanProcessor] | None = None,
    embedders: EmbedderPool | None = None,
    store: VectorStore | None = None,
) -> Runtime:
    """The chosen services wired to the bus (`store`: the vector store they use; default:
    the one the settings name)."""
    chosen = check_services(services, settings)
    provider = configure_telemetry("kbmesh-" + "-".join(chosen), processors=span_processors)
    nats_server = None
    url = settings.nats_url
    if embedded_nats or not url or settings.store_kind == "edge":
        check_data_dir(settings.data_dir)
    credentials = operator = None
    if embedded_nats or not url:
        nats_server = start_private_nats(settings.data_dir)
        nats_server.supervise()
        url = nats_server.url
        local = busauth.local_credentials(settings.data_dir)
        credentials, operator = local[busauth.role_for(chosen)], local["operator"]
    bus = Bus(
        url, provider, credentials, rules=settings.bus, auth=settings.nats, audit=settings.audit
    )
    try:
        # Each step waits out a bus that is failing over (Bus.starting).
        if operator is not None:
            # The services' users may not set up the bus: the operator's does, first.
            await set_up_bus(url, provider, operator, settings)
        # On a NATS without authorization (no user) there is nothing to protect: the
        # services set it up themselves, as `kbmesh bus setup` would.
        await bus.connect(administer=operator is None and not bus.user)
        registries = await bus.starting(
            "registries", lambda: Registries.open(bus.js), waits_for=STARTING_STREAMS
        )
        pool = embedders or EmbedderPool(
            local_backend=settings.local_backend,
            local_device=settings.local_device,
            local_precision=settings.local_precision,
            cache_dir=settings.models_dir,
            egress=egress_policy(settings),
        )
        rt = Runtime(settings, chosen, bus, registries, pool, nats=nats_server)
        if "embed" in chosen or "search" in chosen:
            rt.store = store or create_store(settings)
        await _wire(rt)
        return rt
    except BaseException:
        await bus.close()
        if nats_server:
            nats_server.stop()
        raise


async def set_up_bus(
    url: str, provider: TracerProvider, operator: busauth.Credentials, settings: Settings
) -> None:
    """The topology step, as the operator: streams, buckets, the object store and the
    durable consumers created or brought up to date with `settings`."""
    bus = Bus(url, provider, operator, rules=settings.bus, auth=settings.nats, audit=settings.audit)
    try:
        await bus.connect(administer=True)
    finally:
        await bus.close()


async def _wire(rt: Runtime) -> None:
    publish = rt.bus.publish
    if "ingest" in rt.services:
        from services.ingest.handlers import create_router as ingest_router
        from services.ingest.service import IngestService

        rt.ingest = IngestService(
            rt.registries, publish, rt.settings, audit=audit_sink(lambda: rt.bus.js)
        )
        rt.bus.broker.include_router(ingest_router(rt.bus, rt.ingest))
    if "embed" in rt.services:
        from services.embed.handlers import create_responders as embed_responders
        from services.embed.handlers import create_router as embed_router
        from services.embed.service import EmbedService

        rt.embed = EmbedService(rt.registries, require_store(rt), rt.embedders, publish)
        rt.bus.broker.include_router(
            embed_router(rt.bus, rt.embed, concurrency=rt.settings.embed_concurrency)
        )
        rt.bus.responders += embed_responders(require_store(rt), max_payload=rt.bus.max_payload)
    if "search" in rt.services:
        from services.search.ask import AskService
        from services.search.handlers import create_responders
        from services.search.rerank import LiteLLMReranker
        from services.search.service import SearchService

        rt.search = SearchService(
            rt.registries,
            require_store(rt),
            rt.embedders,
            rt.settings.search,
            reranker=LiteLLMReranker(
                rt.settings.search.rerank_timeout_seconds, egress=egress_policy(rt.settings)
            ),
        )
        rt.ask = AskService(
            rt.registries,
            rt.search,
            rt.settings.ask,
            # Read per call: the policy is the operator's settings as they stand.
            egress=lambda: egress_policy(rt.settings),
        )
        rt.bus.responders += create_responders(
            rt.search,
            rt.ask,
            concurrency=rt.settings.search.concurrency,
            ask_concurrency=rt.settings.ask.concurrency,
            max_payload=rt.bus.max_payload,
        )
    if "gateway" in rt.services:
        from services.gateway.handlers import create_router as gateway_router
        from services.gateway.service import GatewayService

        rt.gateway = GatewayService(rt.bus, rt.registries, rt.settings)
        rt.bus.broker.include_router(gateway_router(rt.gateway))
    if "sources" in rt.services:
        from services.sources.handlers import create_router as sources_router
        from services.sources.service import SourcesService

        rt.sources = SourcesService(rt.registries, publish, source_fetchers(rt.settings))
        rt.bus.broker.include_router(sources_router(rt.bus, rt.sources))


def source_fetchers(settings: Settings) -> dict[str, Fetcher]:
    """The fetcher of each kind of source, held to the egress rule and the upload limit."""
    from services.sources.git import GitFetcher
    from services.sources.web import WebFetcher

    fetchers: dict[str, Fetcher] = {
        "git": GitFetcher(
            egress_policy(settings),
            git_cache_dir(settings.data_dir),
            max_file_bytes=settings.max_content_bytes,
        ),
        "web": WebFetcher(settings),
    }
    return fetchers


def git_cache_dir(data_dir: Path) -> Path:
    """Where git sources keep their repositories between runs: the data directory, else
    (a read-only one, as in a container) the temporary directory. Only a cache: a lost one
    is fetched again."""
    wanted = data_dir / "sources" / "git"
    try:
        wanted.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        wanted = Path(tempfile.gettempdir()) / f"kbmesh-sources-git-{os.getuid()}"
        wanted.mkdir(parents=True, exist_ok=True, mode=0o700)
    return wanted


def require_store(rt: Runtime) -> VectorStore:
    if rt.store is None:
        raise RuntimeError("embed and search need a vector store")
    return rt.store


async def start_consuming(rt: Runtime) -> None:
    """Load the model(s) the local services need, then start the subscribers (waiting out a
    bus that is failing over: `Bus.start`)."""
    if rt.ingest is not None:
        rt.ingest.extractor.start()
    if "embed" in rt.services or "search" in rt.services:
        embedder = rt.embedders.get(rt.settings.default_model)
        if isinstance(embedder, LocalEmbedder):
            # A search-only process never embeds document batches: no encoder for them.
            await asyncio.to_thread(embedder.load, documents="embed" in rt.services)
    await rt.bus.start()
    if rt.sources is not None:
        rt.tasks.append(asyncio.create_task(rt.sources.schedule()))
    if rt.settings.metrics_port:
        metrics.serve(rt.settings.metrics_port)
        rt.tasks.append(asyncio.create_task(metrics.follow_bus(rt.bus.js)))
    rt.ready.set()


def api_keys(rt: Runtime) -> KeyResolver:
    from services.gateway.auth import KeyResolver

    return KeyResolver(
        rt.registries.keys,
        rt.settings.default_org,
        audit=audit_sink(lambda: rt.bus.js),
        oauth=rt.settings.oauth,
    )


def gateway_app(rt: Runtime) -> FastAPI:
    """The gateway's FastAPI app (REST, tools, MCP over HTTP) over this runtime's parts."""
    from services.gateway.app import create_app
    from services.gateway.mcp import create_mcp

    if rt.gateway is None:
        raise RuntimeError("this runtime does not run the gateway")
    keys = api_keys(rt)
    mcp = create_mcp(rt.gateway, keys=keys) if rt.settings.toolsets else None
    return create_app(
        rt.gateway,
        keys,
        mcp=mcp,
        ready=rt.ready,
        services=rt.services,
        nats_status=rt.nats.status if rt.nats else None,
    )


def stdio_mcp(rt: Runtime, principal: Principal) -> KbmeshMCP:
    """The MCP server that `kbmesh mcp` serves on stdio, as `principal`."""
    from services.gateway.mcp import create_mcp

    if rt.gateway is None:
        raise RuntimeError("this runtime does not run the gateway")
    return create_mcp(rt.gateway, principal=principal)
