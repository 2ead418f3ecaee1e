"""What a request must be before any route sees it: addressed to this server, not sent by a
foreign web page, and from a known caller — checked from its headers alone, before a byte
of its body is read.

- `HostGuard`: a `Host` outside loopback names and `KBMESH_ALLOWED_HOSTS` is refused (421)
  on every route: a page whose DNS name an attacker re-points at 127.0.0.1 (DNS rebinding)
  gets nothing. Health probes are exempt (they change and reveal nothing, and orchestrators
  send the pod's address).
- `BrowserGuard`: a state-changing request (POST, PUT, PATCH, DELETE) with a body must say
  it is JSON (415 otherwise), and one whose `Origin` is neither the server's own nor in
  `KBMESH_CORS_ORIGINS` is refused (403). Browsers send a cross-site `text/plain` or
  form body without asking the server first; a JSON body they send only after a CORS
  preflight, which the gateway answers only for configured origins. The document upload
  routes take file bodies too (a form, a raw file), which a page may send anywhere without
  a preflight: for them the Origin check (a foreign or `null` one is refused) and, where a
  browser sends no Origin, the `Sec-Fetch-Site` check (cross-site and same-site are
  refused) are the whole protection.
- `KeyGate`: the API key or access token of a state-changing request is resolved from its
  headers first; an unauthenticated request is answered 401 with its body unread. The
  principal rides on in the request's state, so routes do not resolve it again. A source's
  webhook (`POST /v1/sources/<id>/hook`) is the one write without a key: git hosts prove it
  with the source's secret over the body (services/gateway/service/sources.py), and send it
  as JSON or as a form, so BrowserGuard holds it to the Origin checks of file bodies.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.bus.client import BUS_UNAVAILABLE, unavailable
from services.common.domain.errors import KbmeshError
from services.common.settings import Settings
from services.gateway.auth import KeyResolver, Principal, Unauthorized
from services.gateway.problems import RETRY_AFTER, TOOLS_PATH, problem

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
# The Host that Starlette's and httpx's in-process test clients send.
TEST_HOSTS = ("testserver",)
# Liveness and readiness probes: orchestrators address them by the pod's IP.
PROBE_PATHS = ("/healthz", "/readyz")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
PRINCIPAL = "principal"
MCP_PATH = "/mcp"
HOOK_PATH = re.compile(r"/v1/sources/[^/]+/hook/?")


def is_hook(scope: Scope) -> bool:
    """A call of a source's webhook: no API key; the source's secret signs its body."""
    return scope.get("method") == "POST" and HOOK_PATH.fullmatch(scope.get("path", "")) is not None


class HostRule:
    """Which `Host` headers this server answers: loopback names and the test client's on any
    port, the bound address when it is a specific one, and `KBMESH_ALLOWED_HOSTS` (`name`
    or `name:*` for any port, `name:port` for one; `*` turns the check off)."""

    def __init__(self, settings: Settings) -> None:
        extra = [h.strip().lower() for h in settings.allowed_hosts if h.strip()]
        self.off = "*" in extra
        names = [*LOOPBACK_HOSTS, *TEST_HOSTS, *extra]
        bound = settings.host.strip().lower()
        if bound not in ("0.0.0.0", "::", "", *LOOPBACK_HOSTS):
            names.append(f"[{bound}]" if ":" in bound else bound)
        self.any_port: set[str] = set()
        self.exact: set[str] = set()
        for entry in names:
            name, port = split_host(entry)
            if port in (None, "*"):
                self.any_port.add(name)
            else:
                self.exact.add(f"{name}:{port}")

    def allows(self, host: str | None) -> bool:
        if self.off or host is None:  # no Host at all: HTTP/1.0, never a browser
            return True
        host = host.strip().lower()
        name, port = split_host(host)
        return name in self.any_port or (port is not None and f"{name}:{port}" in self.exact)

    def patterns(self) -> list[str]:
        """The rule as `name:*` / `name:port` patterns (the MCP SDK's form)."""
        return sorted({*(f"{n}:*" for n in self.any_port), *self.any_port, *self.exact})


def split_host(host: str) -> tuple[str, str | None]:
    """`name[:port]` or `[v6]:port` → (name, port or None)."""
    if host.startswith("["):
        name, _, rest = host.partition("]")
        return name + "]", rest[1:] if rest.startswith(":") else None
    name, colon, port = host.rpartition(":")
    return (name, port) if colon else (host, None)


def refusal(
    scope: Scope, status: int, error_type: str, message: str, *, challenge: str | None = None
) -> Response:
    """A refusal in the format of the route it stops: a tool error under /api/v1/tools and
    /mcp, a problem body elsewhere. `challenge`: its `WWW-Authenticate` (a 401 always has one)."""
    path = scope.get("path", "")
    headers = dict(RETRY_AFTER) if status == 503 else {}
    if status == 401 or challenge is not None:
        headers["WWW-Authenticate"] = challenge or 'Bearer realm="kbmesh"'
    if path.startswith((TOOLS_PATH, MCP_PATH)):
        body = {"status": "error", "error_type": error_type, "message": message}
        return JSONResponse(body, status_code=status, headers=headers)
    response = problem(status, error_type, message)
    response.headers.update(headers)
    return response


class HostGuard:
    # Not Starlette's TrustedHostMiddleware: it drops the port (no `name:port` rules), has
    # no exempt paths for probes, and refuses with a plain-text 400, not a 421 problem body.

    def __init__(self, app: ASGIApp, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path") not in PROBE_PATHS:
            host = Headers(scope=scope).get("host")
            if not self.rule.allows(host):
                message = (
                    f"this server does not answer for host {host!r}; add it to "
                    "KBMESH_ALLOWED_HOSTS to serve it"
                )
                await refusal(scope, 421, "MisdirectedRequest", message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BrowserGuard:
    def __init__(
        self,
        app: ASGIApp,
        cors_origins: Iterable[str] = (),
        takes_files: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        self.app = app
        self.cors_origins = {o.strip().rstrip("/").lower() for o in cors_origins if o.strip()}
        self.takes_files = takes_files

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in WRITE_METHODS:
            found = self.inspect(Headers(scope=scope), lambda: self.takes_files(scope))
            if found is not None:
                await refusal(scope, *found)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def inspect(
        self, headers: Headers, takes_files: Callable[[], bool] = lambda: False
    ) -> tuple[int, str, str] | None:
        """(status, error_type, message) of a refused state-changing request, or None.
        `takes_files` says whether its route takes file bodies (asked only for one)."""
        origin = headers.get("origin")
        if origin is not None:
            if not self.same_or_allowed(origin, headers.get("host")):
                return (
                    403,
                    "Forbidden",
                    f"requests from web pages at {origin!r} may not change anything here "
                    "(KBMESH_CORS_ORIGINS lists the origins that may)",
                )
        elif headers.get("sec-fetch-site") in ("cross-site", "same-site"):
            return 403, "Forbidden", "requests from other web sites may not change anything here"
        media = headers.get("content-type")
        if media is not None:
            kind = media.split(";")[0].strip().lower()
            json_body = kind == "application/json" or kind.endswith("+json")
            if not json_body and not (kind and takes_files()):
                return (
                    415,
                    "UnsupportedMediaType",
                    f"send the body as application/json, not {kind or 'an empty type'!r}",
                )
        elif has_body(headers):
            return 415, "UnsupportedMediaType", "send the body as application/json"
        return None

    def same_or_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if origin in self.cors_origins:
            return True
        parts = urlsplit(origin)
        return (
            parts.scheme in ("http", "https")
            and host is not None
            and parts.netloc == host.strip().lower()
        )


def has_body(headers: Headers) -> bool:
    if "transfer-encoding" in headers:
        return True
    length = headers.get("content-length", "0").strip()
    return length not in ("", "0")


class KeyGate:
    def __init__(self, app: ASGIApp, keys: KeyResolver) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WRITE_METHODS or is_hook(scope):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        headers = Headers(scope=scope)
        try:
            principal = await self.keys.resolve(
                headers.get("authorization"), client[0] if client else None
            )
        except Unauthorized as err:
            response = refusal(scope, 401, err.error_type, err.message, challenge=err.challenge)
            if has_body(headers):
                # Not worth reading to keep the connection: the body of a stranger.
                response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        except KbmeshError as err:
            found = self.keys.challenge_for(err)
            response = refusal(scope, err.status_code, err.error_type, err.message, challenge=found)
            await response(scope, receive, send)
            return
        except BUS_UNAVAILABLE as err:
            down = unavailable(err)
            await refusal(scope, 503, down.error_type, down.message)(scope, receive, send)
            return
        scope.setdefault("state", {})[PRINCIPAL] = principal
        await self.app(scope, receive, send)


def resolved_principal(scope: Scope) -> Principal | None:
    """The principal `KeyGate` resolved for this request, if it did."""
    state = scope.get("state")
    found = state.get(PRINCIPAL) if isinstance(state, dict) else None
    return found if isinstance(found, Principal) else None
