"""The vector store interface: what kbmesh needs from Qdrant, independent of how it runs.

Filters are a small typed tree translated by each adapter into engine filters; callers never
build engine objects or strings.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, Protocol, runtime_checkable

from services.common.domain.errors import InvalidInput
from services.common.messages.queries import Mode

DENSE = "dense"
SPARSE = "bm25"

# Collections keep their dense vectors also in int8 (scalar quantization over the 99 %
# quantile): the HNSW walk compares those, a quarter of the bytes, and the best
# `OVERSAMPLING` x limit candidates are then rescored on the float vectors, so the cosines a
# search reports stay exact (docs/benchmarks.md, "Figures behind the code"). The engine
# builds the int8 copy with the HNSW index: small, unindexed collections are searched as
# before.
QUANTILE = 0.99
OVERSAMPLING = 1.5


@dataclass(frozen=True)
class SparseVector:
    indices: list[int]
    values: list[float]


@dataclass(frozen=True)
class ChunkPoint:
    id: str
    dense: list[float]
    sparse: SparseVector
    payload: dict[str, Any]


def exported_point(point_id: Any, vectors: Any, payload: Any, sparse_type: type[Any]) -> ChunkPoint:
    """A stored point as both adapters export it: `vectors` the engine's named vectors, the
    sparse one an instance of the engine's `sparse_type` (indices and values)."""
    named: dict[str, Any] = vectors if isinstance(vectors, dict) else {}
    sparse, dense = named.get(SPARSE), named.get(DENSE)
    return ChunkPoint(
        id=str(point_id),
        # A named dense vector: kbmesh's collections hold no multivectors.
        dense=list(dense) if isinstance(dense, list) else [],
        sparse=SparseVector(list(sparse.indices), list(sparse.values))
        if isinstance(sparse, sparse_type)
        else SparseVector([], []),
        payload=payload or {},
    )


class Hit(NamedTuple):
    """A point as a store returns it. A tuple, not a dataclass: a hybrid search builds
    hundreds of these per KB and the construction showed in profiles."""

    id: str
    score: float | None
    payload: dict[str, Any]


# ---- filters -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    """key == value (for list payloads: the list contains value)."""

    key: str
    value: str | int | bool


@dataclass(frozen=True)
class MatchAny:
    key: str
    values: tuple[str | int, ...]


@dataclass(frozen=True)
class MatchText:
    """Full-text match on a text-indexed field: every word of `text` occurs in the value
    (whole words, case-insensitive; not a substring match)."""

    key: str
    text: str


@dataclass(frozen=True)
class MatchSubstring:
    """The value of a keyword field contains `text` anywhere (byte-wise, case-sensitive:
    fold both sides beforehand for a case-insensitive match)."""

    key: str
    text: str


@dataclass(frozen=True)
class Range:
    key: str
    gte: float | None = None
    lte: float | None = None
    gt: float | None = None
    lt: float | None = None


@dataclass(frozen=True)
class DateRange:
    key: str
    gte: datetime | None = None
    lte: datetime | None = None


@dataclass(frozen=True)
class HasIds:
    ids: tuple[str, ...]


Condition = Match | MatchAny | MatchText | MatchSubstring | Range | DateRange | HasIds


@dataclass(frozen=True)
class Filter:
    must: tuple[Condition, ...] = ()
    must_not: tuple[Condition, ...] = ()

    def and_(self, *conditions: Condition) -> Filter:
        return Filter(must=self.must + conditions, must_not=self.must_not)


# HNSW search breadth: recall against latency. 64 saves ~2 ms of a search at 100k chunks,
# a quality default not given up for it (docs/benchmarks.md, "Figures behind the code").
HNSW_EF = 128


@dataclass(frozen=True)
class Query:
    """One candidate list: the `limit` best chunks by the dense vector or by BM25."""

    mode: Mode
    limit: int
    filter: Filter
    dense: list[float] | None = None
    sparse: SparseVector | None = None
    hnsw_ef: int = HNSW_EF
    # The payload fields each hit carries; None: all. Candidate lists of a search name the
    # few they rank by: converting whole payloads (chunk text, metadata) of hundreds of
    # candidates costs more than the engine's search.
    payload: tuple[str, ...] | None = None


def check_signal(q: Query) -> None:
    """A store query is one candidate list: dense or keyword. Hybrid results are fused by
    the search service (services/search/fusion.py), across KBs, not by the engine."""
    if q.mode is Mode.hybrid:
        raise InvalidInput("a store query is dense or keyword; the search service fuses them")


def payload_selector(q: Query) -> bool | list[str]:
    """The engines' `with_payload` for a query: everything, nothing, or the named fields."""
    if q.payload is None:
        return True
    return list(q.payload) if q.payload else False


def lead_filter(flt: Filter) -> Filter:
    return flt.and_(Match("chunk_index", 0))


# Payload fields with an index, and their kind. Everything a filter can name outside
# `metadata.*` is listed here.
PAYLOAD_INDEXES: dict[str, str] = {
    "org_id": "keyword",
    "kb_id": "keyword",
    "document_id": "keyword",
    "source_id": "keyword",
    "tags": "keyword",
    "collection": "keyword",
    "uri": "keyword",
    "document_name": "text",
    # The same name under a keyword index, for exact-name filters, and casefolded, for
    # case-insensitive substring filters.
    "document_name_exact": "keyword",
    "document_name_folded": "keyword",
    "chunk_index": "integer",
    "uploaded_at": "datetime",
}


@dataclass(frozen=True)
class TermStats:
    """What a collection's BM25 IDF is computed from, for some terms: its number of points
    and, per term id, how many of them hold the term (terms held by none are absent)."""

    points: int
    df: dict[int, int] = field(default_factory=dict)


def idf(points: int, df: int) -> float:
    """Qdrant's IDF modifier, `ln((N − df + 0.5) / (df + 0.5) + 1)`."""
    return math.log((points - df + 0.5) / (df + 0.5) + 1.0)


def probed_term_stats(points: int, probes: Mapping[int, tuple[float, float] | None]) -> TermStats:
    """Term stats from one-term probes: a probe with term t alone (query weight 1) scores its
    best point `idf(t) · w`, w being the point's own weight for t, so `score / w` is the
    collection's IDF of t, and `idf` inverted gives its document frequency. The engine keeps
    no other account of it: this reads the statistics it ranks with, so they can never
    disagree with them. `probes`: term → (best score, that point's weight), None: no point."""
    df = {}
    for term, probe in probes.items():
        if probe is None or probe[1] <= 0:
            continue
        r = math.exp(probe[0] / probe[1]) - 1.0
        df[term] = min(points, max(1, round((points + 0.5 - 0.5 * r) / (r + 1.0))))
    return TermStats(points, df)


@dataclass
class CollectionInfo:
    name: str
    dim: int
    points: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class VectorStore(Protocol):
    """One Qdrant collection per KB; named dense vector `dense` and sparse `bm25` (IDF)."""

    async def ensure_collection(self, name: str, dim: int) -> None:
        """Create the collection (and payload indexes) if missing; idempotent."""

    async def drop_collection(self, name: str) -> None:
        """Remove the collection and all its points; no error if missing."""

    async def collection_exists(self, name: str) -> bool: ...

    async def replace_document(
        self, name: str, document_id: str, points: list[ChunkPoint], *, durable: bool = True
    ) -> None:
        """Upsert `points`, then delete the document's other points. Never leaves the
        document with no points between the two, and is idempotent. `durable=False`: for a
        collection nobody reads yet, the write may return before it is flushed to disk
        (kept across a crash of the process, not of the machine) until `flush`."""

    async def upsert(self, name: str, points: list[ChunkPoint]) -> None:
        """Bulk insert/overwrite by id, without per-document cleanup (bulk loads)."""

    async def delete_document(self, name: str, document_id: str) -> None: ...

    async def delete(self, name: str, flt: Filter) -> None: ...

    async def set_payload(self, name: str, flt: Filter, payload: dict[str, Any]) -> None:
        """Overwrite the given payload keys on every matching point (no re-embedding)."""

    async def query(self, name: str, query: Query) -> list[Hit]: ...

    async def query_many(self, name: str, queries: list[Query]) -> list[list[Hit]]:
        """Several queries on one collection at once (one engine call where it can)."""

    async def retrieve(self, name: str, ids: list[str]) -> list[Hit]: ...

    async def scroll(self, name: str, flt: Filter, limit: int) -> list[Hit]: ...

    async def page(
        self, name: str, offset: str | None, limit: int, fields: tuple[str, ...] | None = None
    ) -> tuple[list[Hit], str | None]:
        """Every point in id order, a page at a time: up to `limit` from `offset` (None: the
        start) with the named payload fields (None: all), and where the next page starts
        (None: none left; also for a missing collection)."""

    async def export(
        self, name: str, offset: str | None, limit: int
    ) -> tuple[list[ChunkPoint], str | None]:
        """Every point with its vectors and payload, in id order, a page at a time (as
        `page`): what a backup takes, and `upsert` writes back without embedding anything.
        Dense vectors come back as the engine keeps them (cosine: normalised)."""

    async def count(self, name: str, flt: Filter | None = None) -> int: ...

    async def term_stats(self, name: str, terms: list[int]) -> TermStats:
        """The collection's BM25 statistics for these term ids, exactly as its IDF uses
        them (missing collection: no points)."""

    async def optimize(self, name: str) -> None:
        """Compact/index after bulk loads where the engine needs it (Edge); else no-op."""

    async def flush(self, name: str) -> None:
        """Put every write to the collection on disk, those made with `durable=False` too
        (no error if the collection is missing)."""

    async def close(self) -> None: ...


# ---- shared by the adapters -------------------------------------------------------------


def check_document_points(document_id: str, points: list[ChunkPoint]) -> None:
    # The delete half of replace_document finds old points by payload document_id; a point
    # without it would never be cleaned up.
    for p in points:
        if p.payload.get("document_id") != document_id:
            raise InvalidInput(
                f"point {p.id} has payload document_id {p.payload.get('document_id')!r}, "
                f"expected {document_id!r}",
                field="document_id",
            )


def uuid_strings(ids: list[str]) -> list[str]:
    try:
        return [str(uuid.UUID(i)) for i in ids]
    except ValueError as err:
        raise InvalidInput(f"point ids must be UUIDs: {err}", field="ids") from err


def any_values(values: tuple[str | int, ...]) -> list[str] | list[int]:
    strings = [v for v in values if isinstance(v, str)]
    if len(strings) == len(values):
        return strings
    ints = [v for v in values if isinstance(v, int)]
    if len(ints) == len(values):
        return ints
    raise InvalidInput("MatchAny values must be all strings or all integers")
