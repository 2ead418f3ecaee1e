"""Points as backups carry them: one JSON line per point (its id, the dense vector as base64 of
little-endian float32, the sparse vector, the payload). The same bytes travel in the replies
of `vectors.export` (embed answers it: the store is embed's) and in an archive's `vectors/`
parts, and `PointRow` reads them back for `upsert`, so a restore writes the vectors it was
given and computes none.

A reply to `vectors.export` is a header line (`{"next": <offset or null>, "points": n}`, or
`{"error": {...}}`) followed by its n point lines.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from services.common.domain.errors import InvalidInput, KbmeshError
from services.common.domain.ids import UUID_PATTERN
from services.common.store.base import ChunkPoint, SparseVector, VectorStore

# Points the engine is asked for per page; a reply holds fewer when they would not fit in one
# bus message (the rest come with the next page).
EXPORT_PAGE_POINTS = 256
# What a reply leaves of the bus's message size for its header line and the message headers.
REPLY_MARGIN = 4096
_COLLECTION = r"^kb_[A-Za-z0-9_-]{1,124}$"
_FLOAT32 = np.dtype("<f4")
_TERM_IDS = 1 << 32


class ExportFailed(Exception):
    """The store could not give a page of points; the message says why."""


class ExportRequest(BaseModel):
    """One page of a KB collection's points, from `offset` (None: the first)."""

    model_config = ConfigDict(extra="forbid")

    collection: str = Field(pattern=_COLLECTION)
    offset: str | None = Field(None, pattern=UUID_PATTERN)
    limit: int = Field(EXPORT_PAGE_POINTS, ge=1, le=4096)


@dataclass
class ExportPage:
    rows: list[bytes]  # one encoded point each
    next: str | None  # where the next page starts; None: this was the last


def encode_point(point: ChunkPoint) -> bytes:
    dense = np.asarray(point.dense, dtype=_FLOAT32).tobytes()
    row = {
        "id": point.id,
        "dense": base64.b64encode(dense).decode("ascii"),
        "sparse": {"indices": point.sparse.indices, "values": point.sparse.values},
        "payload": point.payload,
    }
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode()


class SparseRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    indices: list[Annotated[int, Field(ge=0, lt=_TERM_IDS)]]
    values: list[float]

    @model_validator(mode="after")
    def _pairs(self) -> SparseRow:
        if len(self.indices) != len(self.values):
            raise ValueError("sparse indices and values differ in length")
        if len(set(self.indices)) != len(self.indices):
            raise ValueError("a sparse term id occurs twice")
        if not all(math.isfinite(v) for v in self.values):
            raise ValueError("a sparse value is not a finite number")
        return self


class PointRow(BaseModel):
    """One point of an archive or an export reply, checked: a UUID id, a dense vector of
    finite float32 numbers, a well-formed sparse vector and a JSON object for payload."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=UUID_PATTERN)
    dense: str = Field(description="base64 of the dense vector as little-endian float32")
    sparse: SparseRow
    payload: dict[str, Any]
    _vector: np.ndarray = PrivateAttr()

    @model_validator(mode="after")
    def _dense(self) -> PointRow:
        try:
            raw = base64.b64decode(self.dense, validate=True)
        except binascii.Error as err:
            raise ValueError(f"dense is not base64: {err}") from None
        if not raw or len(raw) % _FLOAT32.itemsize:
            raise ValueError("dense does not hold a whole number of float32 values")
        vector = np.frombuffer(raw, dtype=_FLOAT32)
        if not np.isfinite(vector).all():
            raise ValueError("dense holds a value that is not a finite number")
        self._vector = vector
        return self

    @property
    def dim(self) -> int:
        return int(self._vector.shape[0])

    def point(self) -> ChunkPoint:
        return ChunkPoint(
            id=self.id,
            dense=self._vector.tolist(),
            sparse=SparseVector(self.sparse.indices, self.sparse.values),
            payload=self.payload,
        )


async def export_page(store: VectorStore, request: ExportRequest, max_bytes: int) -> ExportPage:
    """Up to `request.limit` points of the collection as rows, at most `max_bytes` of them."""
    points, after = await store.export(request.collection, request.offset, request.limit)
    rows: list[bytes] = []
    size = 0
    for point in points:
        row = encode_point(point)
        if size + len(row) + 1 > max_bytes:
            if not rows:
                raise InvalidInput(
                    f"point {point.id} of {request.collection} is {len(row)} bytes encoded, "
                    f"more than the {max_bytes} a reply holds"
                )
            return ExportPage(rows, point.id)
        rows.append(row)
        size += len(row) + 1
    return ExportPage(rows, after)


async def answer_export(store: VectorStore, body: bytes, max_bytes: int) -> bytes:
    """The reply to a `vectors.export` request: a page, or the error that stopped it."""
    try:
        request = ExportRequest.model_validate_json(body)
        page = await export_page(store, request, max_bytes - REPLY_MARGIN)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return _error("ValidationError", f"{where}: {first['msg']}")
    except KbmeshError as err:
        return _error(err.error_type, err.message)
    header = json.dumps({"next": page.next, "points": len(page.rows)}).encode()
    return b"\n".join([header, *page.rows])


def read_reply(reply: bytes) -> ExportPage:
    """The page in a `vectors.export` reply; ExportFailed for an error or a broken reply."""
    header, *rows = reply.split(b"\n")
    try:
        head = json.loads(header)
    except ValueError:
        raise ExportFailed("the reply is no export page") from None
    if not isinstance(head, dict) or "error" in head:
        error = head.get("error") if isinstance(head, dict) else None
        raise ExportFailed(str(error.get("message") if isinstance(error, dict) else head))
    if head.get("points") != len(rows):
        raise ExportFailed(f"the reply holds {len(rows)} points, its header says {head}")
    after = head.get("next")
    return ExportPage(rows, after if isinstance(after, str) else None)


def _error(error_type: str, message: str) -> bytes:
    return json.dumps({"error": {"error_type": error_type, "message": message}}).encode()
