"""Request bodies are bounded for every caller, over real sockets against the real gateway:
a body over its route's limit is answered 413 and its connection closed with the rest
unread, whether its length is declared (refused from the headers) or not (cut off by
counting), on REST and on /mcp alike; and however large a length a client declares, its
connection is closed within a capped deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from services.gateway.bodylimit import largest_body_bytes
from services.gateway.server import Deadlines
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.mcp_client import serve_http

MAX_BYTES = 1024 * 1024  # the content limit of this stack: its largest body is ~3.6 MB
RATE = 1_000_000
DEADLINES = Deadlines(header_seconds=2.0, body_seconds=3.0, min_bytes_per_second=RATE)
# Seconds a busy machine may add to a deadline.
SLACK = 3.0
HUGE = 300_000_000  # the attack's body
# What a client can push into a connection the server does not read: its own send buffer
# and the server's receive buffer (a few MB on loopback), never the body.
UNREAD = 32_000_000


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """A keyed stack behind uvicorn with a 1 MiB content limit and short body deadlines, and
    a read-only key."""
    async with (
        running_stack(
            tmp_path_factory.mktemp("bodies"),
            embedders=embedders,
            max_content_bytes=MAX_BYTES,
        ) as (rt, _client),
        serve_http(rt, DEADLINES) as (base, _app),
    ):
        reader = await OperatorKeys(rt).create(rt.settings.default_org, "reader", read_only=True)
        yield SimpleNamespace(
            rt=rt, base=base, port=int(base.rsplit(":", 1)[1]), reader=f"Bearer {reader}"
        )


@dataclass
class Exchange:
    answer: bytes  # what the server sent
    sent: int  # body bytes the client got into the connection
    closed: bool  # the server closed the connection
    seconds: float  # from the first byte sent to the close (or to giving up)

    @property
    def status(self) -> int:
        return int(self.answer.split(b" ", 2)[1]) if self.answer.startswith(b"HTTP/1.1 ") else 0

    def json(self) -> dict:
        _head, _, body = self.answer.partition(b"\r\n\r\n")
        return json.loads(body)

    def header(self, name: str) -> str | None:
        head = self.answer.partition(b"\r\n\r\n")[0].decode("latin-1")
        for line in head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name:
                return value.strip()
        return None


async def exchange(
    port: int, head: str, chunks: Iterable[bytes], *, pause: float = 0, timeout: float = 60
) -> Exchange:
    """Send `head`, then `chunks` one after another (`pause` seconds apart, unless the server
    closes first) for as long as the server takes them; read everything the server sends
    until it closes the connection or `timeout` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    sent = 0
    closed = asyncio.Event()

    async def pump() -> None:
        nonlocal sent
        writer.write(head.encode())
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
            if pause:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closed.wait(), pause)
            if closed.is_set():
                return

    pumping = asyncio.create_task(pump())
    answer = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while data := await reader.read(65536):
                answer.extend(data)
            closed.set()
    except ConnectionResetError:
        closed.set()  # the server closed with the client's bytes unread: a reset, not a FIN
    except TimeoutError:
        pass
    seconds = time.monotonic() - started
    pumping.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
        await pumping
    writer.close()
    return Exchange(bytes(answer), sent, closed.is_set(), seconds)


def filler(total: int, size: int = 1024 * 1024) -> Iterator[bytes]:
    """`total` bytes of a JSON string's inside, `size` at a time (the same buffer each time)."""
    block = b"a" * size
    while total > 0:
        yield block[: min(size, total)]
        total -= size


def body(start: bytes, total: int) -> Iterator[bytes]:
    """A body of `total` bytes: `start`, then filler."""
    yield start
    yield from filler(total - len(start))


def chunked(chunks: Iterable[bytes]) -> Iterator[bytes]:
    for chunk in chunks:
        yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
    yield b"0\r\n\r\n"


def request(stack, path: str, *, length: int | None, media: str = "application/json") -> str:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\nAuthorization: {stack.reader}\r\n"
        f"Content-Type: {media}\r\nAccept: application/json, text/event-stream\r\n{framing}\r\n\r\n"
    )


def assert_refused_unread(got: Exchange) -> None:
    assert got.status == 413, got.answer[:300]
    assert got.closed and got.header("connection") == "close", got.answer[:300]
    assert got.sent < UNREAD, f"the server took {got.sent} bytes of the body"


async def test_search_body_over_the_limit_is_refused_from_its_headers(stack):
    """The attack: 300 MB declared to /v1/search with a read-only key is answered 413 with a
    problem body before it is read; the client gets only a few MB into the connection before
    it is closed, and the gateway answers the next request."""
    got = await exchange(
        stack.port, request(stack, "/v1/search", length=HUGE), body(b'{"query": "', HUGE)
    )
    assert_refused_unread(got)
    assert got.header("content-type") == "application/problem+json", got.answer[:300]
    problem = got.json()
    assert problem["error_type"] == "ContentTooLarge" and problem["status"] == 413, problem
    assert "bytes" in problem["detail"], problem
    async with httpx.AsyncClient(base_url=stack.base) as http:
        r = await http.post(
            "/v1/search", json={"query": "anything"}, headers={"Authorization": stack.reader}
        )
    assert r.status_code == 200, r.text


async def test_mcp_body_over_the_limit_is_refused_from_its_headers(stack):
    """300 MB declared to /mcp is answered 413 (a tool error, as every /mcp refusal is) with
    the body unread, not after the MCP SDK's own limit has read it all."""
    got = await exchange(
        stack.port,
        request(stack, "/mcp", length=HUGE),
        body(b'{"jsonrpc": "2.0", "x": "', HUGE),
    )
    assert_refused_unread(got)
    error = got.json()
    assert error["status"] == "error" and error["error_type"] == "ContentTooLarge", error


async def test_chunked_body_over_the_limit_is_cut_off_while_read(stack):
    """A chunked body (no Content-Length) to /v1/search is counted as it arrives: past the
    route's limit it is answered 413 and its connection closed with the rest unread."""
    got = await exchange(
        stack.port,
        request(stack, "/v1/search", length=None),
        chunked([b'{"query": "', *filler(HUGE, 64 * 1024)]),
    )
    assert_refused_unread(got)
    assert got.json()["error_type"] == "ContentTooLarge", got.answer[:300]


async def test_huge_declared_length_sent_slowly_is_closed_at_once(stack):
    """`Content-Length: 10^12` dripped one byte at a time is answered 413 and closed at once,
    where it used to hold the connection for as long as 10^12 bytes take at the slowest
    rate allowed."""
    got = await exchange(
        stack.port,
        request(stack, "/v1/search", length=10**12),
        (b"a" for _ in range(1000)),
        pause=0.5,
        timeout=DEADLINES.body_seconds + SLACK,
    )
    assert got.status == 413, got.answer[:300]
    assert got.closed and got.seconds < DEADLINES.body_seconds, got.seconds


async def test_unread_body_of_a_refused_request_has_a_capped_deadline(stack):
    """A request refused before its body is read but kept alive (a text/plain write: 415)
    whose client declares 10^12 bytes and drips them is closed once the body deadline of the
    largest body the gateway takes has passed, not after 10^12 bytes' worth of time (10^6 s
    at this stack's slowest rate)."""
    capped = DEADLINES.body_seconds + largest_body_bytes(stack.rt.settings) / RATE
    got = await exchange(
        stack.port,
        request(stack, "/v1/search", length=10**12, media="text/plain"),
        (b"a" for _ in range(1000)),
        pause=0.5,
        timeout=capped + 2 * SLACK,
    )
    assert got.status == 415, got.answer[:300]
    assert got.closed, f"still open after {got.seconds:.1f} s"
    assert capped - 0.5 <= got.seconds < capped + SLACK, (got.seconds, capped)
