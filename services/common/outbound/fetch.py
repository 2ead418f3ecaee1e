"""Fetching a URL a client or a source named, safely: the one rule for every outbound GET that
someone else steers (upload by URL, a web source's crawl).

http(s) only. Every request goes through `EgressTransport`: every address the host resolves to
must be allowed by the egress policy (public, or allow-listed by the operator) and the
connection goes to the vetted address (no second DNS lookup to rebind); redirects are followed
here, hop by hop, each hop a new request vetted again; bodies are read with a size limit while
streaming; the caller holds the deadline (`fetch_url` holds `KBMESH_LIMITS__FETCH_TOTAL_SECONDS`).

No type is guessed here: the server's declared type goes along as a hint, and ingest reads the
type from the bytes and the name, as it does for every upload.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from email.message import Message
from pathlib import PurePosixPath
from urllib.parse import unquote

import httpx

from services.common.domain.errors import InvalidInput, TooLarge
from services.common.domain.formats import clean_mime
from services.common.outbound.egress import (
    EgressPolicy,
    EgressTransport,
    egress_policy,
    egress_scope,
    parse_http_url,
)
from services.common.settings import Settings

MAX_REDIRECTS = 5
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
USER_AGENT = "kbmesh-fetch/0.1"


class FetchFailed(InvalidInput):
    """The URL could not be fetched (connection, HTTP status, redirects)."""

    error_type = "FetchError"


@dataclass(frozen=True)
class Fetched:
    data: bytes
    mime_type: str | None  # as the server declared it: ingest reads the type from the bytes
    name: str
    uri: str


def outbound_client(*, user_agent: str = USER_AGENT) -> httpx.AsyncClient:
    """A client whose every request meets the egress policy of the surrounding `open_url`.
    It follows no redirect itself (`open_url` vets each hop) and ignores proxy variables,
    which would send the request somewhere other than the address that was checked."""
    return httpx.AsyncClient(
        transport=EgressTransport(),
        timeout=TIMEOUT,
        follow_redirects=False,
        trust_env=False,
        headers={"User-Agent": user_agent},
    )


@contextlib.asynccontextmanager
async def open_url(
    client: httpx.AsyncClient,
    url: httpx.URL,
    policy: EgressPolicy,
    *,
    headers: Mapping[str, str] | None = None,
    field: str = "url",
) -> AsyncIterator[httpx.Response]:
    """The streamed answer to GET `url` after at most MAX_REDIRECTS redirects, each hop
    vetted by `policy` (Forbidden names `field`), whatever its status; `response.url` is the
    last hop's URL. FetchFailed when no answer came (connection, too many redirects)."""
    original = url
    for _ in range(MAX_REDIRECTS + 1):
        request = client.build_request("GET", url, headers=headers)
        try:
            with egress_scope(policy, field=field, what="fetch"):
                response = await client.send(request, stream=True)
        except httpx.HTTPError as err:
            raise FetchFailed(
                f"could not fetch {original}: {err or type(err).__name__}", field=field
            ) from err
        if response.is_redirect and "location" in response.headers:
            await response.aclose()
            url = parse_http_url(str(url.join(response.headers["location"])), field)
            continue
        try:
            yield response
        finally:
            await response.aclose()
        return
    raise FetchFailed(f"fetching {original} took more than {MAX_REDIRECTS} redirects", field=field)


async def read_limited(response: httpx.Response, limit: int, *, field: str = "url") -> bytes:
    """The body, refused (TooLarge) as soon as it passes `limit` decoded bytes."""
    too_large = (
        f"the document at {response.url} exceeds the {_mb(limit)} limit (KBMESH_MAX_CONTENT_BYTES)"
    )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{too_large}: it declares {declared} bytes", field=field)
    buf = bytearray()
    try:
        # Decoded bytes: a compressed body cannot smuggle more than the limit past this loop.
        async for chunk in response.aiter_bytes():
            buf += chunk
            if len(buf) > limit:
                raise TooLarge(too_large, field=field)
    except httpx.HTTPError as err:
        raise FetchFailed(
            f"could not read {response.url}: {err or type(err).__name__}", field=field
        ) from err
    return bytes(buf)


# ---- one document by URL ----------------------------------------------------------------------


async def fetch_url(url: str, settings: Settings) -> Fetched:
    """The document at `url` (an upload by URL), within the size limit and the total deadline."""
    # The per-read timeout alone lets a server drip one byte every few seconds for ever; the
    # total deadline bounds what one upload can hold (a connection, a worker, the caller).
    deadline = settings.limits.fetch_total_seconds
    try:
        async with asyncio.timeout(deadline):
            return await _fetch_url(url, settings)
    except TimeoutError as err:
        raise FetchFailed(
            f"fetching {url} took longer than {deadline:g} s (KBMESH_LIMITS__FETCH_TOTAL_SECONDS)",
            field="url",
        ) from err


async def _fetch_url(url: str, settings: Settings) -> Fetched:
    start = parse_http_url(url, "url")
    async with (
        outbound_client() as client,
        open_url(client, start, egress_policy(settings)) as response,
    ):
        if response.status_code >= 400:
            raise FetchFailed(f"fetching {url} returned HTTP {response.status_code}", field="url")
        data = await read_limited(response, settings.max_content_bytes)
        content_type = response.headers.get("content-type")
        name = name_from(response.headers.get("content-disposition"), response.url)
        return Fetched(data=to_utf8(data, content_type), mime_type=content_type, name=name, uri=url)


def _mb(limit: int) -> str:
    return f"{limit / (1024 * 1024):g} MB"


def _header(name: str, value: str) -> Message:
    """A MIME header parsed by the stdlib: its parameters quoted or not, RFC 2231's encoded
    (`filename*=ISO-8859-1''caf%E9.md`) and continued ones decoded."""
    message = Message()
    message[name] = value
    return message


def name_from(disposition: str | None, url: httpx.URL) -> str:
    """A fetched document's name: Content-Disposition's file name, else the URL's last segment."""
    if disposition:
        name = _header("content-disposition", disposition).get_filename() or ""
        name = PurePosixPath(name.strip()).name
        if name:
            return name[:512]
    segment = PurePosixPath(unquote(url.path)).name
    # A site's root is named after its host, with the slash: "docs.python.org" would read
    # as a file with the extension .org.
    return (segment or f"{url.host}/")[:512]


def charset_of(content_type: str | None) -> str | None:
    """The charset a Content-Type declares, if any."""
    if not content_type:
        return None
    return _header("content-type", content_type).get_content_charset()


def to_utf8(data: bytes, content_type: str | None) -> bytes:
    """Text declared in another charset is re-encoded, since extraction reads UTF-8."""
    mime = clean_mime(content_type)
    if not content_type or not (mime.startswith("text/") or mime == "application/json"):
        return data
    charset = charset_of(content_type)
    if not charset:
        return data
    try:
        if codecs.lookup(charset).name in ("utf-8", "ascii"):
            return data
        return data.decode(charset, errors="replace").encode("utf-8")
    except LookupError:
        return data  # no text encoding (unknown, or `base64`): the reader decides
