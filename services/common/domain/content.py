"""Decoding upload content (text or base64) with the size limit: shared by the gateway, which
rejects bad input before anything is stored, and ingest, which guards upstream publishers."""

from __future__ import annotations

import base64
import binascii
import hashlib

from services.common.domain.errors import InvalidInput, TooLarge
from services.common.domain.formats import (
    FORMATS,
    GENERIC_TYPES,
    GZIP_TYPE,
    by_mime,
    by_name,
    clean_mime,
)


def decode_content(content: str, encoding: str, max_bytes: int) -> bytes:
    if encoding == "base64":
        # Base64 inflates by 4/3: reject before decoding a huge string.
        if len(content) > (max_bytes * 4) // 3 + 4:
            raise too_large(max_bytes)
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as err:
            raise InvalidInput(f"content is not valid base64: {err}", field="content") from err
    else:
        if "\x00" in content:
            raise InvalidInput(
                "text content contains a NUL character; send a binary file as a file (a "
                "multipart form or the raw body), or base64-encoded (content_encoding=base64)",
                field="content",
            )
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidInput(
                f"content is not valid Unicode: a lone surrogate at position {err.start}",
                field="content",
            ) from err
    check_size(len(data), max_bytes)
    return data


def check_size(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise too_large(max_bytes, size)


def too_large(max_bytes: int, size: int | None = None, field: str = "content") -> TooLarge:
    """The refusal of content over `max_bytes` (`size`: its size, when known)."""
    got = f" (got {size} bytes)" if size is not None else ""
    mb = 1024 * 1024
    # Whole megabytes read best; any other configured limit is stated exactly (not "0 MB").
    limit = f"{max_bytes // mb} MB" if max_bytes % mb == 0 else f"{max_bytes} bytes"
    return TooLarge(f"content exceeds the {limit} limit{got}", field=field)


def checksum(text: str) -> str:
    return content_checksum(text.encode("utf-8"))


def content_checksum(data: bytes) -> str:
    """What clients compare with a local file to skip uploading it again."""
    return hashlib.sha256(data).hexdigest()


# Every format kbmesh reads is in `formats.FORMATS`; these are views of it.
TEXT_TYPES = {m for f in FORMATS if not f.binary and f.kind != "image" for m in f.mime_types}
HTML_TYPES = {"text/html", "application/xhtml+xml"}
PDF_TYPE = "application/pdf"
DOCX_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
IMAGE_PREFIX = "image/"
# One media type per format, for descriptions and error messages.
SUPPORTED = [f.mime_type for f in FORMATS if f.kind != "image"] + [GZIP_TYPE, "image/*"]


def normalise_mime(mime_type: str | None, name: str = "") -> str:
    """The media type text content is recorded with: the declared one, else what the name
    says, else text/plain. Ingest sniffs the bytes again: a declared type is a hint, not the
    truth."""
    declared = declared_mime(mime_type)
    if declared is not None:
        return declared
    named = by_name(name)
    return named.mime_type if named is not None else "text/plain"


def declared_mime(mime_type: str | None) -> str | None:
    """A declared media type as documents are recorded with it (an alias such as
    text/x-markdown becomes its format's usual name), or None when it says nothing about the
    content (absent, or generic such as application/octet-stream)."""
    mime = clean_mime(mime_type)
    if not mime or mime in GENERIC_TYPES:
        return None
    known = by_mime(mime)
    if known is None or known.kind == "image":
        return mime
    return known.mime_type


def is_supported(mime: str) -> bool:
    return mime == GZIP_TYPE or by_mime(mime) is not None


# Where the gateway stages uploads too large to travel inline; ingest deletes them once stored.
STAGING_PREFIX = "uploads/"


def staging_name(org_id: str, event_id: str) -> str:
    # Under the org: ingest reads an upload's object only from the uploading org's names.
    return f"{STAGING_PREFIX}{org_id}/{event_id}"
