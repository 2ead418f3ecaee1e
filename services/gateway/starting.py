"""The gateway's HTTP side while its process starts: the port answers from the first moment,
the probes included, also while the start waits out a NATS failover (which may take minutes:
`START_DEADLINE_SECONDS` in services/common/bus/client.py); the gateway's app takes over once
the process is connected."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.problems import problem

STARTING_MESSAGE = "kbmesh is starting (waiting for the message bus); retry in a few seconds"


class StartingGateway:
    """The ASGI app that uvicorn serves. Until `open(app)` it answers `/healthz` 200 (the
    process lives), `/readyz` 503 "starting", and anything else 503 `Unavailable` with
    `Retry-After`; from then on every request goes to `app`. Uvicorn's lifespan events reach
    this object: `app`'s own lifespan runs from `open` to the server's shutdown, in a task of
    its own as uvicorn would run it (MCP's session manager must end in the task it began)."""

    def __init__(self, services: Sequence[str]) -> None:
        self.services = list(services)
        self._app: ASGIApp | None = None
        self._events: asyncio.Queue[Message] = asyncio.Queue()
        self._replies: asyncio.Queue[Message] = asyncio.Queue()
        self._lifespan: asyncio.Task[None] | None = None

    async def open(self, app: ASGIApp) -> None:
        """Run `app`'s startup, then serve it; its startup's error is raised as it is."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}

        async def lifespan() -> None:
            await app(scope, self._events.get, self._replies.put)

        self._lifespan = asyncio.create_task(lifespan())
        await self._events.put({"type": "lifespan.startup"})
        reply = asyncio.create_task(self._replies.get())
        task = self._lifespan
        try:
            await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the process stops while the startup waits for the bus
            reply.cancel()
            task.cancel()
            self._lifespan = None
            raise
        if not reply.done() or reply.result()["type"] != "lifespan.startup.complete":
            reply.cancel()
            self._lifespan = None
            await task  # Starlette re-raises the startup's error after reporting it
            raise RuntimeError("the gateway's startup ended without completing")
        self._app = app

    async def close(self) -> None:
        """Run `app`'s shutdown (nothing when it was never opened)."""
        self._app = None
        if self._lifespan is None:
            return
        task, self._lifespan = self._lifespan, None
        await self._events.put({"type": "lifespan.shutdown"})
        await task

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_events(receive, send)
        elif self._app is not None:
            await self._app(scope, receive, send)
        elif scope["type"] == "http":
            await self._starting(scope)(scope, receive, send)

    async def _lifespan_events(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _starting(self, scope: Scope) -> JSONResponse:
        if scope["path"] == "/healthz":
            return JSONResponse({"status": "ok"})
        if scope["path"] == "/readyz":
            body = {"status": "starting", "nats": False, "services": self.services}
            return JSONResponse(body, status_code=503)
        return problem(503, "Unavailable", STARTING_MESSAGE)
