"""The request-size rule: routes that carry a document's content take the upload limit (a
maximum-size document fits in any encoding), every other body a small JSON one."""

from __future__ import annotations

import base64
import json

import pytest

from services.common.domain.limits import TAG_LENGTH, TAGS_PER_DOCUMENT
from services.common.settings import Settings
from services.gateway.bodylimit import (
    JSON_BODY_BYTES,
    body_limit,
    json_body_bytes,
    largest_body_bytes,
    upload_body_bytes,
)

SETTINGS = Settings(max_content_bytes=1024 * 1024)
JSON = "application/json"
MULTIPART = "multipart/form-data; boundary=x"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/search"),
        ("POST", "/v1/ask"),
        ("POST", "/v1/kbs"),
        ("PATCH", "/v1/documents/doc-1"),
        ("POST", "/api/v1/tools/kb_search"),
        ("POST", "/v1/documents/doc-1/anything"),
        ("GET", "/v1/documents"),
        ("PUT", "/v1/documents"),
    ],
)
def test_bodies_without_content_are_small_json(method, path):
    assert body_limit(SETTINGS, method, path, JSON) == JSON_BODY_BYTES
    assert body_limit(SETTINGS, method, path, MULTIPART) == JSON_BODY_BYTES


@pytest.mark.parametrize(
    "path",
    [
        "/v1/documents",
        "/v1/kbs/manuals/documents",
        "/api/v1/tools/kb_upload",
        "/api/v1/tools/upload_document",
        "/api/v1/tools/manageKnowledge",
        "/mcp",
        "/mcp/",
    ],
)
def test_routes_that_carry_content_take_the_upload_limit(path):
    assert body_limit(SETTINGS, "POST", path, JSON) == upload_body_bytes(SETTINGS, JSON)
    assert body_limit(SETTINGS, "POST", path, None) == upload_body_bytes(SETTINGS, JSON)


def test_an_upload_not_in_json_is_allowed_its_content_and_framing_alone():
    """Multipart or raw bytes carry the content as it is: the limit plus room for the other
    fields, about half of what JSON (base64 or escaped text) needs."""
    for media in (MULTIPART, "application/pdf", "text/plain"):
        limit = body_limit(SETTINGS, "POST", "/v1/kbs/k/documents", media)
        assert SETTINGS.max_content_bytes < limit < SETTINGS.max_content_bytes * 1.5
    assert upload_body_bytes(SETTINGS, JSON) > SETTINGS.max_content_bytes * 3


def test_a_maximum_document_fits_in_json_whatever_its_encoding():
    """The largest content in base64, or as text whose every character JSON escapes (a
    quote; "é" written as \\u00e9 by clients that escape all but ASCII), with the largest
    metadata and 100 tags of 200 characters escaped alike: every such body is within."""
    limits = SETTINGS.limits
    metadata = {"blob": "é" * (limits.metadata_bytes // 2 - 20)}
    assert len(json.dumps(metadata, ensure_ascii=False).encode()) <= limits.metadata_bytes
    tags = ["é" * TAG_LENGTH] * TAGS_PER_DOCUMENT
    most = SETTINGS.max_content_bytes
    for content in (base64.b64encode(b"\xff" * most).decode(), '"' * most, "é" * (most // 2)):
        body = {"name": "é" * 512, "content": content, "metadata": metadata, "tags": tags}
        assert len(json.dumps(body).encode()) <= upload_body_bytes(SETTINGS, JSON)


def test_a_larger_metadata_limit_raises_the_small_limit_too():
    """A PATCH carries metadata: the small limit grows with `limits.metadata_bytes`."""
    big = Settings(limits={"metadata_bytes": 4 * 1024 * 1024})
    assert json_body_bytes(big) > 8 * 1024 * 1024
    assert body_limit(big, "PATCH", "/v1/documents/d", JSON) == json_body_bytes(big)


def test_the_largest_body_is_the_json_upload():
    assert largest_body_bytes(SETTINGS) == upload_body_bytes(SETTINGS, JSON)
    assert largest_body_bytes(Settings()) > 30 * 1024 * 1024  # a 10 MiB document, escaped
