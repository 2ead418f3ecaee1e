"""The egress policy: where kbmesh itself may connect. One policy for every outbound call that
a client can steer — upload by URL, and a KB's `api_base` (embedding, rerank and answer
models) — so no writable key can make the server reach into its own network.

A destination is allowed when every address its host resolves to is public, or when the
operator allows it: `KBMESH_EGRESS__ALLOWLIST` (host names, `*.suffix`, addresses, CIDRs) or
`KBMESH_EGRESS__ALLOW_PRIVATE=true` (every non-public address: self-hosted models on the same
machine or network).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from services.common.errors import Forbidden, InvalidInput
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
    except OSError as err:
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
