"""Identifiers: the shape every id must have to be a registry key segment, and how new ones
are made. Below models and settings, which both use it."""

from __future__ import annotations

import re
import uuid

from services.common.domain.errors import InvalidInput

# NATS KV keys allow [-/_=.a-zA-Z0-9]; ids become key segments, so they stay inside that set.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_ID_RE = re.compile(ID_PATTERN)
# A UUID, with or without dashes (chunk ids are UUIDs; KB ids are, since clients check that).
UUID_PATTERN = r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
_UUID_RE = re.compile(UUID_PATTERN)
# Namespace for deterministic point ids: the same (kb, document, chunk) always maps to one point.
POINT_NAMESPACE = uuid.UUID("6f1d2c1e-7a43-4c8e-9a59-4f3b2e0d9a11")


def new_id() -> str:
    """A new document or event id (32 hex digits)."""
    return uuid.uuid4().hex


def new_kb_id() -> str:
    """A new KB id: a UUID in its standard dashed form, which clients may validate as one."""
    return str(uuid.uuid4())


def uuid_forms(value: str) -> tuple[str, ...]:
    """The spellings of a UUID that ids may be stored under (dashed and 32 hex digits), or
    () when `value` is no UUID."""
    if not _UUID_RE.match(value):
        return ()
    parsed = uuid.UUID(value)
    return (str(parsed), parsed.hex)


def check_id(value: str, field: str) -> str:
    if not _ID_RE.match(value):
        raise InvalidInput(
            f"{field} must be 1-64 characters of letters, digits, '-' or '_'", field=field
        )
    return value


def is_id(value: str) -> bool:
    """Whether `value` can be a registry key segment (else it names nothing stored)."""
    return bool(_ID_RE.match(value))


def point_id(kb_id: str, document_id: str, chunk_index: int) -> str:
    return str(uuid.uuid5(POINT_NAMESPACE, f"{kb_id}/{document_id}/{chunk_index}"))
