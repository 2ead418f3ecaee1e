"""Vector store on a Qdrant server (or cluster) through the async qdrant-client.

The same calls run against qdrant-client's local mode (`location=":memory:"`), the stand-in
for a server in tests; local mode builds no payload indexes, so none are requested there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from qdrant_client import AsyncQdrantClient, models
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from services.common.domain.errors import InvalidInput, NotFound, Transient
from services.common.store.base import (
    DENSE,
    OVERSAMPLING,
    PAYLOAD_INDEXES,
    QUANTILE,
    SPARSE,
    ChunkPoint,
    Condition,
    DateRange,
    Filter,
    HasIds,
    Hit,
    Match,
    MatchAny,
    MatchSubstring,
    MatchText,
    Mode,
    Query,
    Range,
    TermStats,
    any_values,
    check_document_points,
    check_signal,
    exported_point,
    payload_selector,
    probed_term_stats,
    uuid_strings,
)

_INDEX_KINDS: dict[str, models.PayloadSchemaType] = {
    "keyword": models.PayloadSchemaType.KEYWORD,
    "text": models.PayloadSchemaType.TEXT,
    "integer": models.PayloadSchemaType.INTEGER,
    "float": models.PayloadSchemaType.FLOAT,
    "datetime": models.PayloadSchemaType.DATETIME,
    "bool": models.PayloadSchemaType.BOOL,
}


class ServerStore:
    """`VectorStore` on a Qdrant server: one collection per KB."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        location: str | None = None,
        client: AsyncQdrantClient | None = None,
    ) -> None:
        self._client = client or AsyncQdrantClient(url=url, api_key=api_key, location=location)
        options = self._client.init_options
        self._local = options.get("location") == ":memory:" or options.get("path") is not None

    # ---- collections -----------------------------------------------------------------------

    async def ensure_collection(self, name: str, dim: int) -> None:
        with _classified(name):
            if not await self._client.collection_exists(name):
                try:
                    await self._client.create_collection(
                        name,
                        vectors_config={
                            DENSE: models.VectorParams(
                                size=dim,
                                distance=models.Distance.COSINE,
                                quantization_config=_INT8,
                            )
                        },
                        sparse_vectors_config={
                            SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)
                        },
                    )
                except (UnexpectedResponse, ValueError):
                    # Another service may have created it between the check and the create.
                    if not await self._client.collection_exists(name):
                        raise
            if self._local:
                return
            # Also on existing collections: heals a crash between create and indexing, and
            # picks up fields added to PAYLOAD_INDEXES since the collection was made.
            info = await self._client.get_collection(name)
            for key, kind in PAYLOAD_INDEXES.items():
                if key not in info.payload_schema:
                    await self._client.create_payload_index(
                        name, key, field_schema=_INDEX_KINDS[kind], wait=True
                    )

    async def drop_collection(self, name: str) -> None:
        with _classified(name):
            await self._client.delete_collection(name)

    async def collection_exists(self, name: str) -> bool:
        with _classified(name):
            return await self._client.collection_exists(name)

    async def flush(self, name: str) -> None:
        """Writes were waited for (`wait=True`): nothing is left to put on disk."""

    async def optimize(self, name: str) -> None:
        """The server optimizes in the background."""

    async def close(self) -> None:
        await self._client.close()

    # ---- writes ----------------------------------------------------------------------------

    async def replace_document(
        self, name: str, document_id: str, points: list[ChunkPoint], *, durable: bool = True
    ) -> None:
        # Every write waits for the server's own write-ahead log: `durable` costs this
        # process nothing here (the server's disk work holds up none of our searches).
        check_document_points(document_id, points)
        stale = models.Filter(
            must=[_field("document_id", models.MatchValue(value=document_id))],
            must_not=[models.HasIdCondition(has_id=[p.id for p in points])] if points else None,
        )
        with _classified(name):
            # Upsert first, then delete the leftovers: readers never see the document empty.
            if points:
                await self._client.upsert(name, [_server_point(p) for p in points], wait=True)
            await self._client.delete(name, models.FilterSelector(filter=stale), wait=True)

    async def upsert(self, name: str, points: list[ChunkPoint]) -> None:
        if points:
            with _classified(name):
                await self._client.upsert(name, [_server_point(p) for p in points], wait=True)

    async def delete_document(self, name: str, document_id: str) -> None:
        await self.delete(name, Filter(must=(Match("document_id", document_id),)))

    async def delete(self, name: str, flt: Filter) -> None:
        selector = models.FilterSelector(filter=_server_filter(flt))
        try:
            with _classified(name):
                await self._client.delete(name, selector, wait=True)
        except NotFound:
            return

    async def set_payload(self, name: str, flt: Filter, payload: dict[str, Any]) -> None:
        with _classified(name):
            await self._client.set_payload(name, payload, points=_server_filter(flt), wait=True)

    # ---- reads -----------------------------------------------------------------------------

    async def query(self, name: str, query: Query) -> list[Hit]:
        return (await self.query_many(name, [query]))[0]

    async def query_many(self, name: str, queries: list[Query]) -> list[list[Hit]]:
        requests = [_server_request(q, local=self._local) for q in queries]
        try:
            with _classified(name):
                responses = await self._client.query_batch_points(name, requests)
        except NotFound:
            return [[] for _ in queries]
        return [[Hit(str(p.id), p.score, p.payload or {}) for p in r.points] for r in responses]

    async def retrieve(self, name: str, ids: list[str]) -> list[Hit]:
        if not ids:
            return []
        keys = uuid_strings(ids)
        try:
            with _classified(name):
                records = await self._client.retrieve(
                    name, keys, with_payload=True, with_vectors=False
                )
        except NotFound:
            return []
        by_id = {str(r.id): r for r in records}
        # Requested order, so callers can zip results with their ids.
        return [Hit(id=k, score=None, payload=by_id[k].payload or {}) for k in keys if k in by_id]

    async def scroll(self, name: str, flt: Filter, limit: int) -> list[Hit]:
        try:
            with _classified(name):
                records, _next = await self._client.scroll(
                    name,
                    scroll_filter=_server_filter(flt),
                    limit=limit,
                    with_payload=True,
                    with_vectors=False,
                )
        except NotFound:
            return []
        return [Hit(id=str(r.id), score=None, payload=r.payload or {}) for r in records]

    async def page(
        self, name: str, offset: str | None, limit: int, fields: tuple[str, ...] | None = None
    ) -> tuple[list[Hit], str | None]:
        try:
            with _classified(name):
                records, after = await self._client.scroll(
                    name,
                    offset=offset,
                    limit=limit,
                    with_payload=True if fields is None else list(fields),
                    with_vectors=False,
                )
        except NotFound:
            return [], None
        hits = [Hit(str(r.id), None, r.payload or {}) for r in records]
        return hits, None if after is None else str(after)

    async def export(
        self, name: str, offset: str | None, limit: int
    ) -> tuple[list[ChunkPoint], str | None]:
        try:
            with _classified(name):
                records, after = await self._client.scroll(
                    name, offset=offset, limit=limit, with_payload=True, with_vectors=True
                )
        except NotFound:
            return [], None
        return [_chunk_point(r) for r in records], None if after is None else str(after)

    async def count(self, name: str, flt: Filter | None = None) -> int:
        try:
            with _classified(name):
                result = await self._client.count(
                    name, count_filter=_server_filter(flt), exact=True
                )
        except NotFound:
            return 0
        return result.count

    async def term_stats(self, name: str, terms: list[int]) -> TermStats:
        probes = [
            models.QueryRequest(
                query=models.SparseVector(indices=[t], values=[1.0]),
                using=SPARSE,
                limit=1,
                with_payload=False,
                with_vector=[SPARSE],
            )
            for t in terms
        ]
        try:
            with _classified(name):
                points = (await self._client.count(name, exact=True)).count
                found = await self._client.query_batch_points(name, probes) if terms else []
        except NotFound:
            return TermStats(0)
        return probed_term_stats(
            points,
            {
                t: _probe(r.points[0], t) if r.points else None
                for t, r in zip(terms, found, strict=True)
            },
        )


@contextmanager
def _classified(name: str) -> Iterator[None]:
    """Map client errors onto kbmesh's classes: missing collection, transient, or as is."""
    try:
        yield
    except UnexpectedResponse as err:
        if err.status_code == 404:
            raise NotFound(f"collection {name} does not exist") from err
        if err.status_code == 429 or (err.status_code or 0) >= 500:
            raise Transient(f"qdrant answered {err.status_code} for {name}") from err
        raise
    except ResponseHandlingException as err:  # connection refused, timeout, broken response
        raise Transient(f"qdrant unreachable for {name}: {err}") from err
    except ValueError as err:
        # Local mode signals a missing collection with a plain ValueError.
        if f"Collection {name} not found" in str(err):
            raise NotFound(f"collection {name} does not exist") from err
        raise


# ---- translation ----------------------------------------------------------------------------


def _server_point(p: ChunkPoint) -> models.PointStruct:
    return models.PointStruct(
        id=p.id,
        vector={
            DENSE: p.dense,
            SPARSE: models.SparseVector(indices=p.sparse.indices, values=p.sparse.values),
        },
        payload=p.payload,
    )


def _chunk_point(record: models.Record) -> ChunkPoint:
    return exported_point(record.id, record.vector, record.payload, models.SparseVector)


_INT8 = models.ScalarQuantization(
    scalar=models.ScalarQuantizationConfig(
        type=models.ScalarType.INT8, quantile=QUANTILE, always_ram=True
    )
)
_RESCORED = models.QuantizationSearchParams(rescore=True, oversampling=OVERSAMPLING)


def _server_request(q: Query, *, local: bool) -> models.QueryRequest:
    check_signal(q)
    flt = _server_filter(q.filter)
    payload = payload_selector(q)
    if q.mode is Mode.dense:
        # Local mode searches exhaustively and warns about HNSW parameters it would ignore.
        params = None if local else models.SearchParams(hnsw_ef=q.hnsw_ef, quantization=_RESCORED)
        return models.QueryRequest(
            query=_dense(q),
            using=DENSE,
            filter=flt,
            params=params,
            limit=q.limit,
            with_payload=payload,
        )
    return models.QueryRequest(
        query=_sparse(q), using=SPARSE, filter=flt, limit=q.limit, with_payload=payload
    )


def _probe(point: models.ScoredPoint, term: int) -> tuple[float, float]:
    """(score, the point's own weight of `term`) of a one-term probe's best point."""
    vector = point.vector.get(SPARSE) if isinstance(point.vector, dict) else None
    if not isinstance(vector, models.SparseVector):
        return point.score, 0.0
    return point.score, dict(zip(vector.indices, vector.values, strict=True)).get(term, 0.0)


def _dense(q: Query) -> list[float]:
    if q.dense is None:
        raise InvalidInput(f"{q.mode} search needs a dense query vector", field="dense")
    return q.dense


def _sparse(q: Query) -> models.SparseVector:
    if q.sparse is None:
        raise InvalidInput(f"{q.mode} search needs a sparse query vector", field="sparse")
    return models.SparseVector(indices=q.sparse.indices, values=q.sparse.values)


def _server_filter(flt: Filter | None) -> models.Filter:
    if flt is None:
        return models.Filter()
    return models.Filter(
        must=[_server_condition(c) for c in flt.must] or None,
        must_not=[_server_condition(c) for c in flt.must_not] or None,
    )


def _server_condition(c: Condition) -> models.Condition:
    match c:
        case Match(key=key, value=value):
            return _field(key, models.MatchValue(value=value))
        case MatchAny(key=key, values=values):
            return _field(key, models.MatchAny(any=any_values(values)))
        case MatchText(key=key, text=text):
            return _field(key, models.MatchText(text=text))
        case MatchSubstring(key=key, text=text):
            return _field(key, models.MatchSubstring(substring=text))
        case Range(key=key, gte=gte, lte=lte, gt=gt, lt=lt):
            return models.FieldCondition(
                key=key, range=models.Range(gte=gte, lte=lte, gt=gt, lt=lt)
            )
        case DateRange(key=key, gte=gte, lte=lte):
            return models.FieldCondition(
                key=key, range=models.DatetimeRange(gte=_utc(gte), lte=_utc(lte))
            )
        case HasIds(ids=ids):
            return models.HasIdCondition(has_id=list(ids))
    raise InvalidInput(f"unsupported filter condition {c!r}")


def _field(key: str, match: models.Match) -> models.FieldCondition:
    return models.FieldCondition(key=key, match=match)


def _utc(value: datetime | None) -> datetime | None:
    # Naive datetimes are taken as UTC, as the payload's uploaded_at is.
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
