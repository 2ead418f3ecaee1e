"""The addresses and cursors of KBs and documents as resources (`service/resources.py`): the
addresses kbmesh writes are its published URI templates expanded, and read back to the same
values; a listing cursor reads back to its position, and anything else is refused."""

from __future__ import annotations

import base64
import json

import pytest
from mcp.shared.uri_template import UriTemplate

from services.common.domain.errors import InvalidInput
from services.gateway.service.resources import (
    DOCUMENT_TEMPLATE,
    KB_TEMPLATE,
    _cursor,
    _position,
    document_uri,
    kb_uri,
)

ODD = ["plain", "with space", "a/b", "100%", "ü-ß", "a?b#c", "q=1&r=2", "~._-"]


@pytest.mark.parametrize("value", ODD)
def test_addresses_are_the_templates_expanded_and_read_back(value: str) -> None:
    kb, document = UriTemplate.parse(KB_TEMPLATE), UriTemplate.parse(DOCUMENT_TEMPLATE)
    assert kb_uri(value) == kb.expand({"kb": value})
    assert kb.match(kb_uri(value)) == {"kb": value}
    assert document_uri(value) == document.expand({"document_id": value})
    assert document.match(document_uri(value)) == {"document_id": value}
    paged = document_uri(value, 7)
    assert paged == document.expand({"document_id": value, "page": "7"})
    assert document.match(paged) == {"document_id": value, "page": "7"}


def test_a_cursor_reads_back_to_its_position() -> None:
    position = (1, "2026-01-02T03:04:05.678901+00:00", "0f" * 16)
    assert _position(_cursor(position)) == position


def encoded(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "not-a-cursor",
        "%%%",
        encoded({"a": 1, "b": 2, "c": 3}),
        encoded([2, "x", "y"]),
        encoded([0, 1, "y"]),
        encoded([0, "x"]),
        encoded("[" * 5000),
        base64.urlsafe_b64encode(b"[" * 100_000).decode(),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
    ],
)
def test_anything_but_a_cursor_is_refused_naming_the_cursor(cursor: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _position(cursor)
    assert caught.value.field == "cursor" and "list again" in caught.value.message
