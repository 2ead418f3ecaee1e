"""Serving an ASGI app over real HTTP in the test's event loop (clients that need a socket:
the MCP client, URL ingest)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from services.common.bus.nats_server import free_port
from services.common.settings import HttpSettings
from services.gateway.bodylimit import JSON_BODY_BYTES
from services.gateway.server import DEADLINES, Deadlines, server_config


@contextlib.asynccontextmanager
async def serve_app(
    app: Any,
    *,
    lifespan: str = "on",
    limits: HttpSettings | None = None,
    deadlines: Deadlines = DEADLINES,
    max_body_bytes: int = JSON_BODY_BYTES,
    port: int | None = None,
) -> AsyncIterator[str]:
    """`app` behind uvicorn on 127.0.0.1:<free port>, with the gateway's client deadlines and
    connection cap (`limits`, default the settings' defaults) for an app whose largest body
    is `max_body_bytes`; yields the base URL."""
    port = port or free_port()
    config = server_config(
        app, "127.0.0.1", port, limits or HttpSettings(), deadlines, max_body_bytes=max_body_bytes
    )
    config.lifespan = lifespan
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
