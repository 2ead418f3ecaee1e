"""Ingest by URL or by server-side path: turning a reference into bytes, safely, before the
bytes become an ordinary upload.

URL: http(s) only. Every address the host resolves to must be allowed by the egress policy
(`services.common.outbound.egress`: public, or allow-listed by the operator); the connection
then goes to the vetted address (no second DNS lookup to rebind), redirects are re-checked hop
by hop, the size limit is enforced while streaming, and the whole fetch has a deadline
(`KBMESH_LIMITS__FETCH_TOTAL_SECONDS`). Path: only regular files under `KBMESH_UPLOAD_ROOT`
once every symlink is resolved.

No type is guessed here: the server's declared type goes along as a hint, and ingest reads
the type from the bytes and the name, as it does for every upload.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import stat
from dataclasses import dataclass
from email.message import Message
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

import httpx

from services.common.domain.errors import Forbidden, InvalidInput, NotFound, TooLarge
from services.common.domain.formats import clean_mime
from services.common.outbound.egress import IPAddress, egress_policy, parse_http_url
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


# ---- URL ------------------------------------------------------------------------------------


async def fetch_url(url: str, settings: Settings) -> Fetched:
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
    policy = egress_policy(settings)
    limit = settings.max_content_bytes
    current = _parse_url(url)
    async with httpx.AsyncClient(
        timeout=TIMEOUT, follow_redirects=False, trust_env=False
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            response = await _connect(
                client, current, await policy.vet(current, field="url", what="fetch"), url
            )
            try:
                if response.is_redirect and "location" in response.headers:
                    current = _parse_url(str(current.join(response.headers["location"])))
                    continue
                if response.status_code >= 400:
                    raise FetchFailed(
                        f"fetching {url} returned HTTP {response.status_code}", field="url"
                    )
                data = await _read_limited(response, limit, url)
            except httpx.HTTPError as err:
                raise FetchFailed(
                    f"could not fetch {url}: {err or type(err).__name__}", field="url"
                ) from err
            finally:
                await response.aclose()
            content_type = response.headers.get("content-type")
            name = _name_from(response.headers.get("content-disposition"), current)
            return Fetched(
                data=_to_utf8(data, content_type), mime_type=content_type, name=name, uri=url
            )
    raise FetchFailed(f"fetching {url} took more than {MAX_REDIRECTS} redirects", field="url")


async def _connect(
    client: httpx.AsyncClient, url: httpx.URL, addresses: list[IPAddress], original: str
) -> httpx.Response:
    """GET from the vetted addresses in turn (a name may resolve to ::1 and 127.0.0.1 while
    the server listens on one): the connection never goes anywhere that was not checked."""
    error: httpx.HTTPError | None = None
    for address in addresses:
        request = client.build_request(
            "GET",
            url.copy_with(host=str(address)),
            headers={"Host": url.netloc.decode("ascii"), "User-Agent": USER_AGENT},
            # TLS still verifies the certificate against the name, not the address.
            extensions={"sni_hostname": url.host} if url.scheme == "https" else {},
        )
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as err:
            error = err
        except httpx.HTTPError as err:
            error = err
            break
    raise FetchFailed(
        f"could not fetch {original}: {error or 'no address'}", field="url"
    ) from error


def _parse_url(raw: str) -> httpx.URL:
    return parse_http_url(raw, "url")


async def _read_limited(response: httpx.Response, limit: int, url: str) -> bytes:
    too_large = f"the document at {url} exceeds the {_mb(limit)} limit (KBMESH_MAX_CONTENT_BYTES)"
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{too_large}: it declares {declared} bytes", field="url")
    buf = bytearray()
    # Decoded bytes: a compressed body cannot smuggle more than the limit past this loop.
    async for chunk in response.aiter_bytes():
        buf += chunk
        if len(buf) > limit:
            raise TooLarge(too_large, field="url")
    return bytes(buf)


def _mb(limit: int) -> str:
    return f"{limit / (1024 * 1024):g} MB"


def _header(name: str, value: str) -> Message:
    """A MIME header parsed by the stdlib: its parameters quoted or not, RFC 2231's encoded
    (`filename*=ISO-8859-1''caf%E9.md`) and continued ones decoded."""
    message = Message()
    message[name] = value
    return message


def _name_from(disposition: str | None, url: httpx.URL) -> str:
    if disposition:
        name = _header("content-disposition", disposition).get_filename() or ""
        name = PurePosixPath(name.strip()).name
        if name:
            return name[:512]
    segment = PurePosixPath(unquote(url.path)).name
    # A site's root is named after its host, with the slash: "docs.python.org" would read
    # as a file with the extension .org.
    return (segment or f"{url.host}/")[:512]


def _to_utf8(data: bytes, content_type: str | None) -> bytes:
    """Text declared in another charset is re-encoded, since extraction reads UTF-8."""
    mime = clean_mime(content_type)
    if not content_type or not (mime.startswith("text/") or mime == "application/json"):
        return data
    charset = _header("content-type", content_type).get_content_charset()
    if not charset:
        return data
    try:
        if codecs.lookup(charset).name in ("utf-8", "ascii"):
            return data
        return data.decode(charset, errors="replace").encode("utf-8")
    except LookupError:
        return data  # no text encoding (unknown, or `base64`): the reader decides


# ---- path -----------------------------------------------------------------------------------


async def read_path(path: str, settings: Settings) -> Fetched:
    return await asyncio.to_thread(_read_path, path, settings)


def _read_path(path: str, settings: Settings) -> Fetched:
    if settings.upload_root is None:
        raise Forbidden(
            "ingest by path is disabled on this server (set KBMESH_UPLOAD_ROOT)", field="path"
        )
    if not path.strip() or "\x00" in path:
        raise InvalidInput("path must be a file path under the upload root", field="path")
    try:
        root = settings.upload_root.resolve(strict=True)
    except OSError as err:
        raise Forbidden(
            "the upload root (KBMESH_UPLOAD_ROOT) does not exist", field="path"
        ) from err
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root / candidate
    # resolve() follows every symlink, so containment is checked on the real target; a
    # missing file is reported only inside the root, never outside it.
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise Forbidden(f"path {path!r} is outside the upload root", field="path")
    limit = settings.max_content_bytes
    try:
        # O_NOFOLLOW: the checked path cannot be swapped for a symlink before it is opened.
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as err:
        raise NotFound(f"no file at {path!r} under the upload root", field="path") from err
    except OSError as err:
        raise Forbidden(f"cannot open {path!r}: {err.strerror}", field="path") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(f"{path!r} is not a regular file", field="path")
        if info.st_size > limit:
            raise TooLarge(
                f"{path!r} has {info.st_size} bytes, over the {_mb(limit)} limit "
                "(KBMESH_MAX_CONTENT_BYTES)",
                field="path",
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(f"{path!r} is over the {_mb(limit)} limit", field="path")
    return Fetched(data=data, mime_type=None, name=resolved.name, uri=path)
