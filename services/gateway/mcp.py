"""The MCP server: the tools of `tools/`, and knowledge bases and documents as resources
(`service/resources.py`), over streamable HTTP (mounted at /mcp by the app) and over stdio
(`kbmesh mcp` serves it on the process's stdin/stdout). It speaks every protocol revision the
SDK does: 2026-07-28 (the SDK's newest: one self-contained request per exchange, which the
SDK's session manager routes by its `MCP-Protocol-Version` header) and the revisions of the
initialize handshake before it (2025-11-25 and older: a session per client).

Built on the SDK's `MCPServer`. The tool handlers are ours, so kbmesh validates arguments
itself and every failure comes back as the structured tool error with `isError`; so are the
resource handlers, so a listing is paged and every list and read runs as the caller.
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
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_TIMEOUT,
    StreamableHTTPASGIApp,
    StreamableHTTPSessionManager,
)
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.shared.uri_template import UriTemplate
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    Annotations,
    CallToolResult,
    ContentBlock,
    ListResourcesResult,
    PaginatedRequestParams,
    ResourceLink,
    TextContent,
    ToolAnnotations,
)
from mcp_types import Resource as MCPResource
from mcp_types import ResourceTemplate as MCPResourceTemplate
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
from services.gateway.service.resources import (
    DOCUMENT_TEMPLATE,
    KB_TEMPLATE,
    LIST_PAGE,
    PAGE_CHARS,
    ResourceInfo,
    ResourceText,
)
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
# The addresses `read_resource` answers; the templates list says what each gives.
KB_ADDRESS = UriTemplate.parse(KB_TEMPLATE)
DOCUMENT_ADDRESS = UriTemplate.parse(DOCUMENT_TEMPLATE)
RESOURCE_TEMPLATES = (
    MCPResourceTemplate(
        uri_template=KB_TEMPLATE,
        name="knowledge_base",
        title="Knowledge base",
        description="A knowledge base by name or id: its description, status, settings, "
        "indexed document and chunk counts, and its documents as links, in markdown.",
        mime_type="text/markdown",
    ),
    MCPResourceTemplate(
        uri_template=DOCUMENT_TEMPLATE,
        name="document",
        title="Document",
        description="A document by its document_id (from kb_search, kb_list_documents or the "
        "resource list): its extracted text. Text longer than "
        f"{PAGE_CHARS:,} characters reads in pages: page=1 (the default), 2, ...; each page "
        "ends with a line naming the next page's address.",
    ),
)
# Where a page of a long document says which page it is and which comes next, in `_meta`.
PAGE_META = "kbmesh/page"


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
        resource_page_size: int = LIST_PAGE,
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
        self.resource_page_size = resource_page_size
        self._sessions: StreamableHTTPSessionManager | None = None
        # In place of MCPServer's listing, which has no pages and no caller.
        self._lowlevel_server.add_request_handler(
            "resources/list", PaginatedRequestParams, self.list_resource_page
        )

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

    async def list_resource_page(
        self, ctx: ServerRequestContext[Any], params: PaginatedRequestParams
    ) -> ListResourcesResult:
        """resources/list: the caller's KBs and documents, `resource_page_size` a page."""
        try:
            principal = self.principal_of(ctx.request)
            listing = await self.service.resources.listing(
                principal, params.cursor, self.resource_page_size
            )
        except KbmeshError as err:
            raise resource_error(err) from err
        except BUS_UNAVAILABLE as err:
            raise resource_error(unavailable(err)) from err
        except Exception as err:
            log.exception("resource_list_failed")
            raise internal_error("listing resources") from err
        return ListResourcesResult(
            resources=[listed(info) for info in listing.items], next_cursor=listing.next_cursor
        )

    async def list_resource_templates(self) -> list[MCPResourceTemplate]:
        return list(RESOURCE_TEMPLATES)

    async def read_resource(
        self, uri: Any, context: Context[Any, Any] | None = None
    ) -> list[ReadResourceContents]:
        """resources/read, as the caller: what is outside its reach, or of another org,
        reads as not found, exactly as what does not exist."""
        address = str(uri)
        try:
            found = await self._read(await self.principal_for(context), address)
        except KbmeshError as err:
            raise resource_error(err, address) from err
        except BUS_UNAVAILABLE as err:
            raise resource_error(unavailable(err), address) from err
        except Exception as err:
            log.exception("resource_read_failed uri=%s", address[:200])
            raise internal_error("reading the resource") from err
        meta = None
        if found.page is not None:
            page: dict[str, int | str] = {"page": found.page.page, "pages": found.page.pages}
            if found.page.next_uri is not None:
                page["next"] = found.page.next_uri
            meta = {PAGE_META: page}
        return [ReadResourceContents(content=found.text, mime_type=found.mime_type, meta=meta)]

    async def _read(self, principal: Principal, address: str) -> ResourceText:
        resources = self.service.resources
        if (kb := KB_ADDRESS.match(address)) is not None:
            return await resources.kb(principal, _value(kb["kb"]))
        if (document := DOCUMENT_ADDRESS.match(address)) is not None:
            page = document.get("page")
            return await resources.document(
                principal,
                _value(document["document_id"]),
                _value(page) if page is not None else None,
            )
        raise NotFound(
            f"resource {address[:200]!r} not found; kbmesh's resources are {KB_TEMPLATE} "
            f"and {DOCUMENT_TEMPLATE}"
        )

    async def principal_for(self, context: Context[Any, Any] | None) -> Principal:
        request = None
        if context is not None:
            with contextlib.suppress(ValueError):
                request = context.request_context.request
        return self.principal_of(request)

    def principal_of(self, request: Any) -> Principal:
        """HTTP: the principal of the request's API key, which `SessionOwner` resolved (or
        the gateway's `KeyGate` before it). stdio: the principal the process runs as."""
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
    content: list[ContentBlock] = [TextContent(type="text", text=outcome.text)]
    content += [ResourceLink(**_fields(info)) for info in outcome.links]
    return CallToolResult(
        content=content,
        structured_content=outcome.structured,
        is_error=outcome.is_error,
        _meta=meta,
    )


def listed(info: ResourceInfo) -> MCPResource:
    return MCPResource(**_fields(info))


def _fields(info: ResourceInfo) -> dict[str, Any]:
    """What a resource listing and a resource link both say of a resource."""
    modified = info.updated_at.isoformat() if info.updated_at else None
    return {
        "uri": info.uri,
        "name": info.name,
        "description": info.description,
        "mime_type": info.mime_type,
        "annotations": Annotations(last_modified=modified) if modified else None,
    }


def _value(found: str | list[str]) -> str:
    return found if isinstance(found, str) else ",".join(found)


def resource_error(err: KbmeshError, uri: str | None = None) -> MCPError:
    """A kbmesh error as the JSON-RPC error of a resource request: the caller's fault
    (not found, a bad page or cursor) is invalid params, anything else an internal error;
    the message is the error's own, error_type and the uri travel in `data`."""
    code = INVALID_PARAMS if err.status_code < 500 else INTERNAL_ERROR
    data = {"error_type": err.error_type, **({"uri": uri} if uri is not None else {})}
    return MCPError(code, err.message, data)


def internal_error(doing: str) -> MCPError:
    # Recorded with its traceback where it was caught; the caller sees only that it happened.
    return MCPError(INTERNAL_ERROR, f"internal error while {doing}; the server log has the details")


def create_mcp(
    service: GatewayService,
    *,
    keys: KeyResolver | None = None,
    principal: Principal | None = None,
    toolsets: Sequence[str] | None = None,
    sessions_per_key: int = SESSIONS_PER_KEY,
    resource_page_size: int = LIST_PAGE,
) -> KbmeshMCP:
    """The MCP server with `toolsets` (default: `KBMESH_MCP_TOOLSETS`). Over HTTP, pass the
    app's `KeyResolver`; stdio passes the fixed `principal` it runs as instead. Over HTTP one
    key (or keyless loopback, all together) may hold `sessions_per_key` sessions at once.
    resources/list answers `resource_page_size` resources a page."""
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
        resource_page_size=resource_page_size,
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
