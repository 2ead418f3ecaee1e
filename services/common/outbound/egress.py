"""The egress policy: where kbmesh itself may connect. One policy for every outbound call that
a client can steer — upload by URL, and a KB's `api_base` (embedding, rerank and answer
models) — so no writable key can make the server reach into its own network.

A destination is allowed when every address its host resolves to is public, or when the
operator allows it: `KBMESH_EGRESS__ALLOWLIST` (host names, `*.suffix`, addresses, CIDRs) or
`KBMESH_EGRESS__ALLOW_PRIVATE=true` (every non-public address: self-hosted models on the same
machine or network).

Model calls (embedding, rerank, chat through LiteLLM) send every HTTP request through
`EgressTransport`: the policy of the surrounding `egress_scope` is applied to each request where
it is sent — a provider's built-in address (Ollama's localhost:11434) as much as a client's
`api_base` — and the connection goes to the address that was checked. Model calls follow no
redirects: a 3xx is the provider's answer, reported as an error, never a second destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import weakref
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import httpx

from services.common.domain.errors import Forbidden, InvalidInput
from services.common.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
SETTING = "KBMESH_EGRESS__ALLOWLIST"


class Unreachable(InvalidInput):
    """The destination's host does not resolve."""

    error_type = "FetchError"


@dataclass(frozen=True)
class EgressPolicy:
    """Which non-public destinations may be reached; public addresses always may."""

    allow_private: bool = False
    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = field(default=())

    @classmethod
    def parse(cls, entries: Iterable[str], *, allow_private: bool = False) -> EgressPolicy:
        hosts: set[str] = set()
        suffixes: list[str] = []
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower().strip("[]")
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if entry.startswith("*."):
                suffixes.append(entry[1:])
            else:
                hosts.add(entry)
        return cls(allow_private, frozenset(hosts), tuple(suffixes), tuple(networks))

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return host in self.hosts or any(host.endswith(s) for s in self.suffixes)

    def address_allowed(self, address: IPAddress) -> bool:
        if self.allow_private or is_public(address):
            return True
        return any(address in net for net in self.networks if net.version == address.version)

    async def vet(self, url: httpx.URL, *, field: str, what: str) -> list[IPAddress]:
        """The addresses `url` may be connected to. Every address of the host must be
        allowed, so a name resolving to both a public and a private address is refused.
        `what` names the call in the error ("fetch", "call the embedding model at")."""
        host = url.host
        addresses = await resolve(host, url.port or (443 if url.scheme == "https" else 80), field)
        if self.host_allowed(host):
            return addresses
        for address in addresses:
            if not self.address_allowed(address):
                raise Forbidden(
                    f"refusing to {what} {host!r}: it resolves to the non-public address "
                    f"{address}; add the host or its network to {SETTING} to allow it",
                    field=field,
                )
        return addresses

    async def check_url(self, raw: str, *, field: str, what: str) -> None:
        """Refuse a base URL (`api_base`) that is malformed or points where it may not."""
        url = parse_http_url(raw, field)
        await self.vet(url, field=field, what=what)


def egress_policy(settings: Settings) -> EgressPolicy:
    return EgressPolicy.parse(
        settings.egress.allowlist, allow_private=settings.egress.allow_private
    )


def parse_http_url(raw: str, field: str) -> httpx.URL:
    try:
        url = httpx.URL(raw)
    except httpx.InvalidURL as err:
        raise InvalidInput(f"invalid {field} {raw!r}: {err}", field=field) from err
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidInput(f"{field} must be an absolute http:// or https:// URL", field=field)
    return url


async def resolve(host: str, port: int, field: str) -> list[IPAddress]:
    try:
        return [_normalise(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # UnicodeError: no DNS name at all (a label empty or over 63 characters), refused by the
    # IDNA codec before any lookup.
    except (OSError, UnicodeError) as err:
        raise Unreachable(f"cannot resolve host {host!r}: {err}", field=field) from err
    addresses: list[IPAddress] = []
    for info in infos:
        address = _normalise(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise Unreachable(f"host {host!r} has no address", field=field)
    return addresses


def _normalise(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_public(address: IPAddress) -> bool:
    # is_global excludes private, loopback, link-local, shared (CGNAT), reserved, unspecified.
    return address.is_global and not address.is_multicast


# ---- model calls ------------------------------------------------------------------------------


class EgressRefused(Forbidden):
    """A model call's request was stopped by the egress policy before it left."""


@dataclass(frozen=True)
class _Scope:
    policy: EgressPolicy
    field: str
    what: str


# The policy the model calls of the current task are held to. Outside any scope every request
# through `EgressTransport` meets the strictest policy: public addresses only.
_SCOPE: ContextVar[_Scope | None] = ContextVar("kbmesh_egress_scope", default=None)
_STRICT = _Scope(EgressPolicy(), "api_base", "call the model at")


@contextlib.contextmanager
def egress_scope(policy: EgressPolicy, *, field: str, what: str) -> Iterator[None]:
    """Model calls made inside are held to `policy`; a refusal names `field` (the setting or
    request field that chose the destination) and `what` the call was."""
    token = _SCOPE.set(_Scope(policy, field, what))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def refusal_in(err: BaseException) -> EgressRefused | None:
    """The egress refusal behind a provider library's error, if that is what it was: LiteLLM
    wraps whatever its HTTP client raised in its own connection error."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, EgressRefused):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class EgressTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends a request only where the egress policy allows: vetted
    per request (a redirect, if a client follows one, is a new request and vetted again), then
    connected to the vetted address itself, so a second DNS answer cannot re-point it."""

    def __init__(self) -> None:
        # Connection pools belong to one event loop; tests and CLI commands run several.
        self._pools: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, httpx.AsyncHTTPTransport
        ] = weakref.WeakKeyDictionary()

    def _pool(self) -> httpx.AsyncHTTPTransport:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = self._pools[loop] = httpx.AsyncHTTPTransport(retries=0)
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scope = _SCOPE.get() or _STRICT
        url = request.url
        try:
            addresses = await scope.policy.vet(url, field=scope.field, what=scope.what)
        except Forbidden as err:
            raise EgressRefused(err.message, field=err.field) from None
        except InvalidInput as err:
            raise httpx.ConnectError(err.message, request=request) from err
        pool = self._pool()
        error: httpx.ConnectError | None = None
        for address in addresses:
            pinned = httpx.Request(
                request.method,
                url.copy_with(host=str(address)),
                # The Host header still names the host; TLS verifies the name, not the address.
                headers=request.headers,
                stream=request.stream,
                extensions={**request.extensions, "sni_hostname": url.host}
                if url.scheme == "https"
                else request.extensions,
            )
            try:
                return await pool.handle_async_request(pinned)
            except httpx.ConnectError as err:
                error = err  # a name with several addresses: try the next one
        raise error or httpx.ConnectError(f"{url.host} has no address", request=request)

    async def aclose(self) -> None:
        for pool in list(self._pools.values()):
            await pool.aclose()
        self._pools.clear()
