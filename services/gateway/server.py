"""The gateway's HTTP server: uvicorn, with deadlines on what a client sends and a cap on the
connections one client address holds (`KBMESH_HTTP__CONNECTIONS_PER_CLIENT`).

Uvicorn times out only idle keep-alive connections: a client that opens a connection and
never finishes its request line, headers or body holds a socket and a parser for as long as
it likes, and a few thousand of them exhaust the server. The protocol here closes a
connection whose request line and headers have not arrived within `Deadlines.header_seconds`
of the connection (or of the request's first byte) with 408, one whose body has not arrived
within `Deadlines.body_seconds` of its headers (plus its declared length at
`Deadlines.min_bytes_per_second`: a large upload on a slow link is not cut off; but never
more than the largest body the app takes, whatever length a client declares), and answers a
client address past `connections_per_client` open connections with 503 at once. Everything
else is uvicorn's httptools protocol unchanged.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.common.settings import HttpSettings

_CLOSE = b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\n" + _CLOSE + b"content-length: 44\r\n\r\n"
    b"the request did not arrive within its time\r\n"
)
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\n" + _CLOSE + b"retry-after: 2\r\n"
    b"content-length: 43\r\n\r\ntoo many open connections from this client\r\n"
)


@dataclass(frozen=True)
class Deadlines:
    """How long a client may take to send a request. The same for every deployment: a client
    sends its headers in milliseconds and its body far faster than 100 kB/s (a 20 MB body,
    the largest upload in base64, gets 20 s + 200 s); one slower than that is served through
    a proxy that buffers its request."""

    header_seconds: float = 10.0  # the request line and headers
    body_seconds: float = 20.0  # the body, once the headers are in ...
    min_bytes_per_second: int = 100_000  # ... plus its declared length at this rate


DEADLINES = Deadlines()


def guarded_protocol(
    limits: HttpSettings, max_body_bytes: int, deadlines: Deadlines = DEADLINES
) -> type[HttpToolsProtocol]:
    """An httptools protocol class that enforces `limits` and `deadlines` for an app whose
    largest body is `max_body_bytes`; one class (and one count of connections per client
    address) per server."""
    open_connections: Counter[str] = Counter()
    cap = limits.connections_per_client

    class GuardedHttpProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _peer: str | None = None
        _in_headers = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self.client is not None:
                self._peer = self.client[0]
                open_connections[self._peer] += 1
                if cap and open_connections[self._peer] > cap:
                    transport.write(TOO_MANY_CONNECTIONS)
                    transport.close()
                    return
            self._arm(deadlines.header_seconds, headers=True)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._peer is not None:
                open_connections[self._peer] -= 1
                if open_connections[self._peer] <= 0:
                    del open_connections[self._peer]
                self._peer = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a further request on a kept-alive connection
                self._arm(deadlines.header_seconds, headers=True)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_deadline(self.headers, deadlines, max_body_bytes), headers=False)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()  # the response may take as long as the work does

        def _arm(self, seconds: float, *, headers: bool) -> None:
            self._disarm()
            self._in_headers = headers
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self._in_headers:  # no request reached the app: say why before closing
                self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()

    return GuardedHttpProtocol


def body_deadline(
    headers: list[tuple[bytes, bytes]], deadlines: Deadlines, max_body_bytes: int
) -> float:
    """Seconds a request's body may take: a grace, plus its declared length, up to
    `max_body_bytes`, at the slowest rate allowed (a chunked body, of no declared length,
    gets the grace alone). Capped, because a body the app refuses unread may still be
    drained to keep its connection, and a client declares what length it likes."""
    for name, value in headers:
        if name == b"content-length" and value.strip().isdigit():
            length = min(int(value), max_body_bytes)
            return deadlines.body_seconds + length / deadlines.min_bytes_per_second
    return deadlines.body_seconds


def server_config(
    app: Any,
    host: str,
    port: int,
    limits: HttpSettings,
    deadlines: Deadlines = DEADLINES,
    *,
    max_body_bytes: int,
) -> uvicorn.Config:
    """The uvicorn configuration every gateway (and test server) runs with; `max_body_bytes`
    is the largest body `app` takes (the gateway's: `bodylimit.largest_body_bytes`)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        http=guarded_protocol(limits, max_body_bytes, deadlines),
    )
