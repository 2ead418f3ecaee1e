"""The gateway's FastAPI application: REST under /v1, tools under /api/v1/tools, MCP at /mcp."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.bus.client import BUS_UNAVAILABLE
from services.common.domain.errors import KbmeshError
from services.common.settings import Settings
from services.gateway.api import (
    answers,
    audit,
    deadletters,
    documents,
    kbs,
    progress,
    search,
    sources,
    tools,
)
from services.gateway.api import types as formats
from services.gateway.api.files import takes_file_bodies, takes_files
from services.gateway.apidocs import mount_api_docs
from services.gateway.auth import KeyResolver
from services.gateway.bodyguard import JsonBodyGuard
from services.gateway.bodylimit import BodyLimit
from services.gateway.console import mount_console
from services.gateway.guard import BrowserGuard, HostGuard, HostRule, KeyGate, is_hook
from services.gateway.mcp import KbmeshMCP, MountRoot
from services.gateway.oauth import SignIn, protected_resource_routes, sign_in, sign_in_origins
from services.gateway.problems import (
    ProblemFieldError,
    bus_problem,
    error_problem,
    http_error_type,
    openapi_document,
    problem,
)
from services.gateway.service import GatewayService

_tracer = trace.get_tracer("kbmesh.gateway")
ROUTERS = (
    kbs.router,
    kbs.defaults_router,
    documents.router,
    search.router,
    progress.router,
    answers.router,
    deadletters.router,
    audit.router,
    formats.router,
    sources.router,
    sources.hook_router,
)


class TracedRequests:
    """One server span per HTTP request, named after the route once routing has run.

    A plain ASGI middleware: Starlette's `@app.middleware("http")` runs every request in an
    extra task and pipes the response through a memory stream, about a millisecond of each
    search on these machines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with _server_span(scope, send) as send_traced:
            await self.app(scope, receive, send_traced)


@contextlib.contextmanager
def _server_span(scope: Scope, send: Send, route: str | None = None) -> Iterator[Send]:
    """The request's server span, and a `send` that records the response's status and the
    route (`route`, else the one routing found)."""
    method = scope.get("method", "")
    with _tracer.start_as_current_span("kbmesh.gateway.request", kind=SpanKind.SERVER) as span:
        span.set_attribute("http.request.method", method)

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                path = route or getattr(scope.get("route"), "path", None)
                if path is not None:
                    span.set_attribute("http.route", path)
                    span.update_name(f"{method} {path}")
            await send(message)

        yield send_traced


def create_app(
    service: GatewayService,
    keys: KeyResolver,
    *,
    mcp: KbmeshMCP | None = None,
    ready: asyncio.Event | None = None,
    services: Sequence[str] = ("gateway",),
    nats_status: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """The gateway over its parts: the service, the API keys, and the MCP server (None: no
    /mcp and no /api/v1/tools). `ready` is set once the process's subscribers run; /readyz
    reports it with the names of the `services` this process runs. `nats_status` reports the
    private server of `kbmesh up` (`{"running": bool, ...}`), whose death /healthz reports."""
    app = FastAPI(
        title="kbmesh",
        version="0.1.0",
        description="Event-driven knowledge base for AI agents: REST, tools and MCP.",
        lifespan=_lifespan(service, mcp),
        middleware=_middleware(service.settings, keys),
        # Served by `mount_api_docs` from packaged assets instead of a CDN.
        docs_url=None,
        redoc_url=None,
        # FastAPI's own OpenTelemetry (0.165+) would wrap `TracedRequests`' span in a second
        # server span of the same name, plus an operation span, for every request, and keep
        # HTTP metrics of its own beside /metrics. (An older FastAPI keeps this as `extra`.)
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = service
    app.state.keys = keys
    _exception_handlers(app, keys)
    _health(app, service, ready=ready, services=services, nats_status=nats_status)
    _routers(app, keys)
    if mcp is not None:
        _mount_mcp(app, mcp)
    mount_api_docs(app)
    mount_console(app, sign_in_origins(keys.oauth))
    return app


def _lifespan(
    service: GatewayService, mcp: KbmeshMCP | None
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start the service (its default KB; its subscribers start with the bus) and the MCP
    session manager, which stops with the app."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        async with contextlib.AsyncExitStack() as stack:
            if mcp is not None:
                await stack.enter_async_context(mcp.session_manager.run())
            yield

    return lifespan


def _middleware(settings: Settings, keys: KeyResolver) -> list[Middleware]:
    """The layers a request passes, outermost first. The order is the security boundary:
    the span sees every request; a foreign Host (DNS rebinding) is refused before CORS
    answers a preflight; browser writes are refused before a key is looked up; the key
    before a byte of the body is read; BodyLimit is the first to read the body and bounds
    it before JsonBodyGuard parses it."""
    cors = (
        [
            Middleware(
                CORSMiddleware,
                allow_origins=settings.cors_origins,
                allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                allow_headers=["Authorization", "Content-Type", "Mcp-Session-Id", "Last-Event-ID"],
                expose_headers=["Mcp-Session-Id", "Retry-After"],
            )
        ]
        if settings.cors_origins
        else []
    )
    file_routes = [r for router in ROUTERS for r in router.routes if takes_files(r)]
    return [
        Middleware(TracedRequests),
        Middleware(HostGuard, rule=HostRule(settings)),
        *cors,
        Middleware(
            BrowserGuard,
            cors_origins=settings.cors_origins,
            takes_files=lambda scope: takes_file_bodies(file_routes, scope) or is_hook(scope),
        ),
        Middleware(KeyGate, keys=keys),
        Middleware(BodyLimit, settings=settings),
        Middleware(JsonBodyGuard),
    ]


def _exception_handlers(app: FastAPI, keys: KeyResolver) -> None:
    """Every error as a problem body: kbmesh's own, the bus being down, the framework's
    refusals, and request validation."""

    @app.exception_handler(KbmeshError)
    async def on_error(request: Request, err: KbmeshError) -> JSONResponse:
        response = error_problem(err)
        found = keys.challenge_for(err)
        if found is not None:
            response.headers["WWW-Authenticate"] = found
        return response

    async def on_bus_unavailable(request: Request, err: Exception) -> JSONResponse:
        return bus_problem(err)

    for error_class in BUS_UNAVAILABLE:
        app.add_exception_handler(error_class, on_bus_unavailable)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # The framework's own refusals (a body that is not JSON, an unknown path or method)
        # in the same problem format as every other error.
        response = problem(err.status_code, http_error_type(err.status_code), str(err.detail))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = [
            ProblemFieldError(
                field=".".join(str(p) for p in e["loc"][1:] or e["loc"]),
                message=str(e["msg"]).removeprefix("Value error, "),
            )
            for e in err.errors()
        ]
        message = "; ".join(f"{e.field}: {e.message}" for e in errors)
        return problem(
            422,
            "ValidationError",
            message,
            field=errors[0].field,
            errors=[e.model_dump() for e in errors],
        )


def _health(
    app: FastAPI,
    service: GatewayService,
    *,
    ready: asyncio.Event | None,
    services: Sequence[str],
    nats_status: Callable[[], dict[str, Any]] | None,
) -> None:
    """/healthz (liveness) and /readyz (readiness); both exempt from the Host check."""

    @app.get("/healthz", tags=["health"], responses={503: {"description": "NATS is down"}})
    async def healthz() -> JSONResponse:
        """Liveness: the process answers and, under `kbmesh up`, its private nats-server
        runs (503 while it is down: it is being restarted, and a probe that keeps failing
        should restart the process)."""
        if nats_status is None:
            return JSONResponse({"status": "ok"})
        status = nats_status()
        alive = status["running"]
        return JSONResponse(
            {"status": "ok" if alive else "nats-server down", "nats_server": status},
            status_code=200 if alive else 503,
        )

    @app.get("/readyz", tags=["health"], responses={503: {"description": "not ready"}})
    async def readyz() -> JSONResponse:
        nc = service.bus.nc
        connected = nc is not None and nc.is_connected
        is_ready = (ready is None or ready.is_set()) and connected
        body = {
            "status": "ready" if is_ready else "starting",
            "nats": connected,
            "services": list(services),
        }
        return JSONResponse(body, status_code=200 if is_ready else 503)


def _routers(app: FastAPI, keys: KeyResolver) -> None:
    """The REST resources under /v1, and the OpenAPI document that describes them."""

    def documented_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = documented_openapi  # type: ignore[method-assign]
    for router in ROUTERS:
        app.include_router(router)

    @app.get("/v1/sign-in", tags=["sign-in"], response_model=SignIn)
    async def sign_in_config() -> SignIn:
        """How people sign in here, asked before anyone has: the identity provider and the
        public client the console and `kbmesh login` use (null: API keys only). Public."""
        return sign_in(keys.oauth)

    if keys.oauth is not None:
        # RFC 9728 metadata: where OAuth clients learn which provider signs kbmesh's tokens.
        app.router.routes.extend(protected_resource_routes(keys.oauth))


def _mount_mcp(app: FastAPI, mcp: KbmeshMCP) -> None:
    """The tools as plain HTTP under /api/v1/tools, and the MCP server at /mcp."""
    app.include_router(tools.create_router(mcp))
    mcp_http = mcp.streamable_http_app(streamable_http_path="/")
    # /mcp itself too, not only /mcp/...: no redirect for clients to follow.
    app.router.routes.append(
        Route("/mcp", MountRoot(mcp_http, "/mcp"), methods=["GET", "POST", "DELETE"])
    )
    app.mount("/mcp", mcp_http)
