"""Decoding upload content (text or base64) with the size limit: shared by the gateway, which
rejects bad input before anything is stored, and ingest, which guards upstream publishers."""

from __future__ import annotations

import base64
import binascii
import hashlib
import mimetypes

from services.common.errors import InvalidInput, TooLarge


def decode_content(content: str, encoding: str, max_bytes: int) -> bytes:
    if encoding == "base64":
        # Base64 inflates by 4/3: reject before decoding a huge string.
        if len(content) > (max_bytes * 4) // 3 + 4:
            raise TooLarge(_too_large(max_bytes), field="content")
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as err:
            raise InvalidInput(f"content is not valid base64: {err}", field="content") from err
    else:
        if "\x00" in content:
            raise InvalidInput(
                "text content contains a NUL character; send binary files base64-encoded "
                "(content_encoding=base64) with their mime_type",
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
        raise TooLarge(_too_large(max_bytes, size), field="content")


def _too_large(max_bytes: int, size: int | None = None) -> str:
    got = f" (got {size} bytes)" if size is not None else ""
    mb = 1024 * 1024
    # Whole megabytes read best; any other configured limit is stated exactly (not "0 MB").
    limit = f"{max_bytes // mb} MB" if max_bytes % mb == 0 else f"{max_bytes} bytes"
    return f"content exceeds the {limit} limit{got}"


def checksum(text: str) -> str:
    return content_checksum(text.encode("utf-8"))


def content_checksum(data: bytes) -> str:
    """What clients compare with a local file to skip uploading it again."""
    return hashlib.sha256(data).hexdigest()


TEXT_TYPES = {"text/plain", "text/markdown", "text/x-markdown", "text/csv", "application/json"}
HTML_TYPES = {"text/html", "application/xhtml+xml"}
PDF_TYPE = "application/pdf"
DOCX_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
IMAGE_PREFIX = "image/"
SUPPORTED = sorted(TEXT_TYPES | HTML_TYPES | {PDF_TYPE, DOCX_TYPE, "image/*"})


def normalise_mime(mime_type: str | None, name: str = "") -> str:
    mime = (mime_type or "").split(";")[0].strip().lower()
    if not mime or mime == "application/octet-stream":
        guessed, _ = mimetypes.guess_type(name)
        if name.lower().endswith((".md", ".markdown")):
            guessed = "text/markdown"
        mime = guessed or "text/plain"
    return mime


def is_supported(mime: str) -> bool:
    return (
        mime in TEXT_TYPES
        or mime in HTML_TYPES
        or mime in (PDF_TYPE, DOCX_TYPE)
        or (mime.startswith(IMAGE_PREFIX))
    )


# Where the gateway stages uploads too large to travel inline; ingest deletes them once stored.
STAGING_PREFIX = "uploads/"


def staging_name(org_id: str, event_id: str) -> str:
    # Under the org: ingest reads an upload's object only from the uploading org's names.
    return f"{STAGING_PREFIX}{org_id}/{event_id}"
