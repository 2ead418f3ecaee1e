"""The MCP server: the tools of `tools/` over streamable HTTP (mounted at /mcp by the app)
and over stdio (`kbmesh mcp` serves it on the process's stdin/stdout).

Built on the SDK's `MCPServer`; only `list_tools` and `call_tool` are ours, so kbmesh validates
arguments itself and every failure comes back as the structured tool error with `isError`.
Over HTTP each call runs as the principal of its own request's API key, exactly as REST does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from mcp_types import Tool as MCPTool
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.bus.client import BUS_UNAVAILABLE, unavailable
from services.common.domain.errors import KbmeshError, NotFound
from services.common.settings import Settings
from services.gateway.auth import KeyResolver, Principal, Unauthorized
from services.gateway.bodylimit import body_limit
from services.gateway.guard import resolved_principal
from services.gateway.problems import RETRY_AFTER
from services.gateway.service import GatewayService
from services.gateway.tools import ToolOutcome, ToolSpec, error_outcome, run_tool, tools_for

log = logging.getLogger("kbmesh.mcp")
VERSION = "0.1.0"
# Where a tool error's error_type, message and field travel in a CallToolResult's `_meta`.
ERROR_META = "kbmesh/error"
INSTRUCTIONS = {
    "core": "kbmesh holds knowledge bases of documents. To answer from them, call kb_search "
    "and cite the document names it returns; kb_get_chunk expands a hit and kb_list shows "
    "which knowledge bases exist; kb_ask has a server-side LLM search them and answer, with "
    "citations (and JSON following a schema when asked). kb_upload adds documents (content, "
    "a url, or a server path); kb_delete, kb_update_document and kb_set_collection change them.",
    "compat": "Search with search_docs (one project) or search_knowledge_base (everything); "
    "add documents with upload_document or manageKnowledge, remove them with "
    "delete_document.",
}


class KbmeshMCP(MCPServer):
    """MCPServer whose tools are the kbmesh tool registry."""

    def __init__(
        self,
        service: GatewayService,
        settings: Settings,
        tools: dict[str, ToolSpec],
        *,
        keys: KeyResolver | None,
        principal: Principal | None,
    ) -> None:
        # MCPServer() calls logging.basicConfig; a placeholder handler makes that a no-op, so
        # logging stays configured where the process configures it (the CLI).
        root = logging.getLogger()
        placeholder = logging.NullHandler() if not root.handlers else None
        if placeholder is not None:
            root.addHandler(placeholder)
        try:
            super().__init__(
                name="kbmesh",
                title="kbmesh knowledge bases",
                version=VERSION,
                instructions=" ".join(
                    text for name, text in INSTRUCTIONS.items() if name in settings.toolsets
                ),
            )
        finally:
            if placeholder is not None:
                root.removeHandler(placeholder)
        self.service = service
        self.gateway_settings = settings
        self.tools = tools
        self.keys = keys
        self.principal = principal

    async def list_tools(self) -> list[MCPTool]:
        return [
            MCPTool(
                name=spec.name,
                title=spec.title,
                description=spec.description,
                input_schema=spec.input_schema,
                output_schema=spec.output_schema,
                annotations=ToolAnnotations(
                    title=spec.title,
                    read_only_hint=spec.read_only,
                    destructive_hint=spec.destructive,
                    open_world_hint=spec.open_world,
                ),
            )
            for spec in self.tools.values()
        ]

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult:
        return call_result(await self.dispatch(name, arguments, context))

    async def dispatch(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None
    ) -> ToolOutcome:
        spec = self.tools.get(name)
        if spec is None:
            return error_outcome(NotFound(f"unknown tool {name!r}; call tools/list", field="name"))
        try:
            principal = await self.principal_for(context)
        except KbmeshError as err:
            return error_outcome(err)
        except BUS_UNAVAILABLE as err:
            return error_outcome(unavailable(err))
        return await run_tool(spec, self.service, principal, arguments)

    async def principal_for(self, context: Context[Any, Any] | None) -> Principal:
        """HTTP: the request's API key, like REST. stdio: the principal the process runs as."""
        request = None
        if context is not None:
            with contextlib.suppress(ValueError):
                request = context.request_context.request
        headers = getattr(request, "headers", None)
        scope = getattr(request, "scope", None)
        resolved = resolved_principal(scope) if scope is not None else None
        if resolved is not None:
            return resolved
        if headers is not None and self.keys is not None:
            client = getattr(request, "client", None)
            return await self.keys.resolve(
                headers.get("authorization"), client.host if client else None
            )
        if self.principal is not None:
            return self.principal
        return Principal(org_id=self.gateway_settings.default_org)

    def streamable_http_app(self, **kwargs: Any) -> Starlette:
        """The SDK's app, with the gateway's Host rule in place of the SDK's, the gateway's
        body limit in place of the SDK's (`BodyLimit` holds /mcp to it before the SDK reads
        a byte; it lets a maximum-size upload reach the tool, which then answers with a
        clear error past it), and API keys checked before the MCP session sees the request."""
        kwargs.setdefault("transport_security", transport_security(self.gateway_settings))
        kwargs.setdefault(
            "max_request_body_size",
            body_limit(self.gateway_settings, "POST", "/mcp", "application/json"),
        )
        app = super().streamable_http_app(**kwargs)
        if self.keys is not None:
            app.add_middleware(ApiKeyGuard, keys=self.keys)
        return app


def call_result(outcome: ToolOutcome) -> CallToolResult:
    """The MCP form of a tool outcome. An error is text content flagged `isError`, with no
    structured content (strict clients check it against the output schema even then); its
    error_type and field travel in `_meta` for programs that want them."""
    meta = {ERROR_META: outcome.error.model_dump(exclude_none=True)} if outcome.error else None
    return CallToolResult(
        content=[TextContent(type="text", text=outcome.text)],
        structured_content=outcome.structured,
        is_error=outcome.is_error,
        _meta=meta,
    )


def create_mcp(
    service: GatewayService,
    *,
    keys: KeyResolver | None = None,
    principal: Principal | None = None,
    toolsets: Sequence[str] | None = None,
) -> KbmeshMCP:
    """The MCP server with `toolsets` (default: `KBMESH_MCP_TOOLSETS`). Over HTTP, pass the
    app's `KeyResolver`; stdio passes the fixed `principal` it runs as instead."""
    if keys is None and principal is None:
        raise ValueError("create_mcp needs the API keys (HTTP) or a fixed principal (stdio)")
    settings = service.settings
    chosen = tools_for(list(toolsets) if toolsets is not None else settings.toolsets)
    return KbmeshMCP(service, settings, chosen, keys=keys, principal=principal)


def transport_security(settings: Settings) -> TransportSecuritySettings:
    """The SDK's own Host and Origin checks stay off: the gateway's `HostGuard` and
    `BrowserGuard` hold every route, /mcp included, to one rule (`KBMESH_ALLOWED_HOSTS`)."""
    return TransportSecuritySettings(enable_dns_rebinding_protection=False)


class ApiKeyGuard:
    """Rejects a missing or unknown API key with 401 before any MCP session work, so clients
    see an authentication error rather than a session that fails call by call."""

    def __init__(self, app: ASGIApp, keys: KeyResolver) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A POST's key was resolved by the gateway's `KeyGate` already; GET and DELETE's here.
        if scope["type"] == "http" and resolved_principal(scope) is None:
            client = scope.get("client")
            try:
                await self.keys.resolve(
                    Headers(scope=scope).get("authorization"), client[0] if client else None
                )
            except Unauthorized as err:
                body = {"status": "error", "error_type": err.error_type, "message": err.message}
                response = JSONResponse(
                    body, status_code=401, headers={"WWW-Authenticate": 'Bearer realm="kbmesh"'}
                )
                await response(scope, receive, send)
                return
            except BUS_UNAVAILABLE as err:
                down = unavailable(err)
                body = {"status": "error", "error_type": down.error_type, "message": down.message}
                await JSONResponse(body, status_code=503, headers=RETRY_AFTER)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class MountRoot:
    """Serves `<prefix>` itself with the app mounted at `<prefix>`: a mount alone answers it
    with a redirect to `<prefix>/`, which some MCP clients do not follow on POST."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        root = scope.get("root_path", "")
        path = f"{root}{self.prefix}/"
        scope = {**scope, "path": path, "raw_path": path.encode(), "root_path": root + self.prefix}
        await self.app(scope, receive, send)
