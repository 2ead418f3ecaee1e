"""The MCP server: the tools of `tools/` over streamable HTTP (mounted at /mcp by the app)
and over stdio (`kbmesh mcp` serves it on the process's stdin/stdout).

Built on the SDK's `MCPServer`; only `list_tools` and `call_tool` are ours, so kbmesh validates
arguments itself and every failure comes back as the structured tool error with `isError`.
Over HTTP each call runs as the principal of its own request's API key, exactly as REST does,
and each session belongs to the key that opened it: the SDK's session manager compares the
request's user (`scope["user"]`, set here from the key) with the session's owner, so another
key gets 404 for it, and a key may hold `SESSIONS_PER_KEY` sessions at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, AuthorizationContext
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_TIMEOUT,
    StreamableHTTPASGIApp,
    StreamableHTTPSessionManager,
)
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from mcp_types import Tool as MCPTool
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.bus.client import BUS_UNAVAILABLE, unavailable
from services.common.domain.errors import KbmeshError, NotFound
from services.common.settings import Settings
from services.gateway.auth import KeyResolver, Principal, Unauthorized
from services.gateway.bodylimit import body_limit
from services.gateway.guard import PRINCIPAL, refusal, resolved_principal
from services.gateway.service import GatewayService
from services.gateway.tools import ToolOutcome, ToolSpec, error_outcome, run_tool, tools_for

log = logging.getLogger("kbmesh.mcp")
VERSION = "0.1.0"
# Where a tool error's error_type, message and field travel in a CallToolResult's `_meta`.
ERROR_META = "kbmesh/error"
# A tenth of the SDK's cap on the server's sessions: no one key (leaked, or a runaway agent
# loop) can take them all, while a fleet of agents sharing a key still has room.
SESSIONS_PER_KEY = DEFAULT_MAX_SESSIONS // 10
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
        sessions_per_key: int = SESSIONS_PER_KEY,
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
        self.sessions_per_key = sessions_per_key
        self._sessions: StreamableHTTPSessionManager | None = None

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
        """HTTP: the principal of the request's API key, which `SessionOwner` resolved (or
        the gateway's `KeyGate` before it). stdio: the principal the process runs as."""
        request = None
        if context is not None:
            with contextlib.suppress(ValueError):
                request = context.request_context.request
        scope = getattr(request, "scope", None)
        resolved = resolved_principal(scope) if scope is not None else None
        if resolved is not None:
            return resolved
        if self.principal is not None:
            return self.principal
        raise Unauthorized("an API key is required ('Authorization: Bearer <key>')")

    def streamable_http_app(self, *, streamable_http_path: str = "/mcp", **fixed: Any) -> Starlette:
        """The SDK's stateful streamable HTTP transport with the gateway's Host rule in place
        of the SDK's, the gateway's body limit in place of the SDK's (`BodyLimit` holds /mcp
        to it before the SDK reads a byte; it lets a maximum-size upload reach the tool, which
        then answers with a clear error past it), API keys checked before the MCP session sees
        the request, and each session bound to, and counted against, the key that opened it.

        Built here rather than by `MCPServer.streamable_http_app` because the session manager
        is ours (`KeyedSessionManager`); the route and lifespan are the SDK's own. The SDK's
        other options are fixed here: passing one is an error, not silently ignored."""
        if fixed:
            raise TypeError(f"the kbmesh MCP app sets {', '.join(sorted(fixed))} itself")
        sessions = KeyedSessionManager(
            self._lowlevel_server,
            security_settings=transport_security(self.gateway_settings),
            max_request_body_size=body_limit(
                self.gateway_settings, "POST", "/mcp", "application/json"
            ),
            sessions_per_key=self.sessions_per_key,
        )
        self._sessions = sessions
        middleware = [Middleware(SessionOwner, keys=self.keys)] if self.keys is not None else []
        return Starlette(
            routes=[Route(streamable_http_path, endpoint=StreamableHTTPASGIApp(sessions))],
            middleware=middleware,
            lifespan=lambda app: sessions.run(),
        )

    @property
    def session_manager(self) -> StreamableHTTPSessionManager:
        """The session manager of `streamable_http_app()` (enter its `run()` in a lifespan)."""
        if self._sessions is None:
            raise RuntimeError("call streamable_http_app() before using the session manager")
        return self._sessions


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
    sessions_per_key: int = SESSIONS_PER_KEY,
) -> KbmeshMCP:
    """The MCP server with `toolsets` (default: `KBMESH_MCP_TOOLSETS`). Over HTTP, pass the
    app's `KeyResolver`; stdio passes the fixed `principal` it runs as instead. Over HTTP one
    key (or keyless loopback, all together) may hold `sessions_per_key` sessions at once."""
    if keys is None and principal is None:
        raise ValueError("create_mcp needs the API keys (HTTP) or a fixed principal (stdio)")
    settings = service.settings
    chosen = tools_for(list(toolsets) if toolsets is not None else settings.toolsets)
    return KbmeshMCP(
        service,
        settings,
        chosen,
        keys=keys,
        principal=principal,
        sessions_per_key=sessions_per_key,
    )


def transport_security(settings: Settings) -> TransportSecuritySettings:
    """The SDK's own Host and Origin checks stay off: the gateway's `HostGuard` and
    `BrowserGuard` hold every route, /mcp included, to one rule (`KBMESH_ALLOWED_HOSTS`)."""
    return TransportSecuritySettings(enable_dns_rebinding_protection=False)


class TooManySessions(KbmeshError):
    """A key already holds the most MCP sessions one key may."""

    status_code = 429
    error_type = "TooManySessions"


class KeyUser(AuthenticatedUser):
    """A request's principal in the form the SDK's session manager checks: it binds a session
    to the `authorization_context` (client id, issuer, subject) of the user that opened it,
    and serves that session to requests of the same user only: an API key's sessions to that
    key, a signed-in user's to that user (the token's issuer and subject, in its org), whatever
    token they come with next."""

    def __init__(self, principal: Principal, token: str, issuer: str | None = None) -> None:
        writer = principal.writer
        if writer.kind == "user":
            # The user's later tokens (refreshed, or from another client) reach its sessions.
            client_id, subject = f"user@{principal.org_id}", writer.subject
        else:
            # The key's id (never the key); every keyless loopback client is one `local`.
            client_id, subject = writer.key_id or writer.kind, principal.org_id
        super().__init__(
            AccessToken(
                token=token,
                client_id=client_id,
                subject=subject,
                # rights are the principal's, checked by every tool
                scopes=sorted(principal.scopes or ()),
                claims={"iss": issuer} if writer.kind == "user" else None,
            )
        )
        self.principal = principal


class KeyedSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager, admitting at most `sessions_per_key` open sessions per owner
    besides its own cap on all of them (`DEFAULT_MAX_SESSIONS`)."""

    def __init__(
        self,
        app: Any,
        *,
        security_settings: TransportSecuritySettings,
        max_request_body_size: int,
        sessions_per_key: int,
    ) -> None:
        super().__init__(
            app,
            security_settings=security_settings,
            max_request_body_size=max_request_body_size,
        )
        self.sessions_per_key = sessions_per_key

    def _admit_session(
        self, requestor: AuthorizationContext | None
    ) -> StreamableHTTPServerTransport | None:
        # The SDK's admission step, run under its session-creation lock: counting here makes
        # concurrent openings by one key unable to pass the cap together.
        if requestor is not None:
            held = sum(1 for owner in self._session_owners.values() if owner == requestor)
            if held >= self.sessions_per_key:
                minutes = int(DEFAULT_SESSION_IDLE_TIMEOUT // 60)
                raise TooManySessions(
                    f"{held} MCP sessions are open with this API key, the most one key may "
                    "hold; end one (DELETE /mcp with its Mcp-Session-Id header) or wait until "
                    f"idle ones expire ({minutes} minutes without a request)"
                )
        return super()._admit_session(requestor)


class SessionOwner:
    """Resolves every /mcp request's API key or access token before any MCP session work and
    hands it to the SDK as the request's user, which binds sessions to keys and users. A
    missing or unknown credential is 401 (with the challenge that starts an OAuth client's
    sign-in), so clients see an authentication error rather than a session that fails call by
    call."""

    def __init__(self, app: ASGIApp, keys: KeyResolver) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization")
        # A POST's key was resolved by the gateway's `KeyGate` already; GET and DELETE's here.
        principal = resolved_principal(scope)
        if principal is None:
            client = scope.get("client")
            try:
                principal = await self.keys.resolve(authorization, client[0] if client else None)
            except KbmeshError as err:
                found = self.keys.challenge_for(err)
                response = refusal(
                    scope, err.status_code, err.error_type, err.message, challenge=found
                )
                await response(scope, receive, send)
                return
            except BUS_UNAVAILABLE as err:
                down = unavailable(err)
                await refusal(scope, 503, down.error_type, down.message)(scope, receive, send)
                return
            scope.setdefault("state", {})[PRINCIPAL] = principal
        issuer = self.keys.oauth.issuer if self.keys.oauth is not None else None
        scope["user"] = KeyUser(principal, (authorization or "").partition(" ")[2], issuer)
        try:
            await self.app(scope, receive, send)
        except TooManySessions as err:
            # Raised while admitting a new session, before anything was sent.
            await refusal(scope, err.status_code, err.error_type, err.message)(scope, receive, send)


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
