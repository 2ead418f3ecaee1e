"""Vector store on Qdrant Edge: the Qdrant engine in-process, one shard directory per collection.

Edge (0.9) keeps the interpreter lock while it works: a search, a write or an index build
holds up every other Python thread of the process for as long as it runs, so engine time
is never parallel with Python work (throughput beyond that comes from the Qdrant server,
see `ServerStore`). Searches and point lookups therefore run inline (`_read`); writes,
loads and index builds, which may wait on the disk, run in worker threads. Writes to one
shard are serialized by an asyncio lock, and a write returns once `flush()` has put it on
disk. A flush (an fsync) holds the interpreter lock however little it carries, so writes
that queue up meanwhile are applied together under one flush (group commit; figures in
docs/benchmarks.md, "Figures behind the code"). Its length is the disk's: tens of
milliseconds on a quiet disk, hundreds on a busy one, every search of the process waiting.
A write with `durable=False` (a collection nobody searches yet: a rebuild's) is applied
without one; the engine's write-ahead log keeps it across a crash of the process, and
`flush()` puts it on disk before anyone relies on it.
A shard can be open in one process only (the WAL is locked).

Edge has no background optimiser either: points stay in a plain segment, searched by full
scan, until `optimize()` builds their HNSW index. The store starts that build itself once a
shard holds `index_threshold` vectors outside the index (see `_index_if_due`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import qdrant_edge as qe

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

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Collection names become directory names, so they stay inside a safe set.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_TRASH_PREFIX = ".dropped-"

_INDEX_KINDS: dict[str, qe.PayloadSchemaType] = {
    "keyword": qe.PayloadSchemaType.Keyword,
    "text": qe.PayloadSchemaType.Text,
    "integer": qe.PayloadSchemaType.Integer,
    "float": qe.PayloadSchemaType.Float,
    "datetime": qe.PayloadSchemaType.Datetime,
    "bool": qe.PayloadSchemaType.Bool,
}


# Vectors outside a shard's HNSW index that start a build: a build pauses the process about
# 1-2.5 s per 1,000 of them, and full scans of fewer cost little (docs/benchmarks.md,
# "Figures behind the code": "Edge index built every threshold").
INDEX_THRESHOLD = 10_000

# Largest segment (KiB of vectors) a build merges new points into. Uncapped, the engine lets
# one grow to 256,000 KiB per indexing core and each build re-indexes all of it: 10k new points
# on a 300k-point KB paused the process 145-193 s (2 cores). Capped, a segment fills at ~90k
# 384-dim points: growing a KB to 300k, builds paused 26 s on average, 54 s at most; searching
# 5 segments instead of 2 cost REST p50 hybrid +10 %, dense +27 % (recall@50 0.90 -> 0.975),
# keyword none (docs/benchmarks.md, "Figures behind the code": "Edge segments capped").
MAX_SEGMENT_KB = 150_000


class EdgeStore:
    """`VectorStore` on Qdrant Edge shards under `root` (`root/<collection>`)."""

    def __init__(
        self, root: Path, *, index_threshold: int = INDEX_THRESHOLD, bulk: bool = False
    ) -> None:
        """`index_threshold`: dense vectors outside the HNSW index that start an index build
        (0: never; `optimize` then is the caller's). `bulk`: a bulk load (a restore), where
        nobody searches meanwhile: a build starts only once a full segment's worth of vectors
        waits (`MAX_SEGMENT_KB`), so each segment is built once instead of re-built with every
        `index_threshold` more; shards are still made with `index_threshold`, for later."""
        self._root = Path(root)
        self._bulk = bulk
        self._dims: dict[str, int] = {}
        self._shards: dict[str, qe.EdgeShard] = {}
        self._write_locks: dict[str, asyncio.Lock] = {}
        self._queued: dict[str, list[_Write]] = {}  # per shard, writes not yet committed
        # Serializes opening, creating and dropping shards: a second `load` of an open shard
        # fails on the WAL lock.
        self._registry_lock = asyncio.Lock()
        self._index_threshold = index_threshold
        self._index_builds: dict[str, asyncio.Task[None]] = {}
        # Per shard, the un-indexed count below which no build is tried again: the engine may
        # decline to index (a shard made with its own, larger threshold), and then every
        # write would ask again.
        self._index_floor: dict[str, int] = {}
        self._closing = False

    # ---- collections -----------------------------------------------------------------------

    async def ensure_collection(self, name: str, dim: int) -> None:
        path = self._path(name)
        async with self._registry_lock:
            shard = self._shards.get(name)
            if shard is None:
                shard = await asyncio.to_thread(_open_or_create, path, dim, self._index_threshold)
                self._shards[name] = shard
            self._dims[name] = dim
        async with self._write_lock(name):
            if self._shards.get(name) is not shard:  # dropped meanwhile
                raise NotFound(f"collection {name} was dropped while being created")
            # Also on existing shards: heals a crash between create and indexing, and picks up
            # fields added to PAYLOAD_INDEXES since the shard was made.
            await asyncio.to_thread(_ensure_indexes, shard)

    async def drop_collection(self, name: str) -> None:
        path = self._path(name)
        async with self._registry_lock, self._write_lock(name):
            # The write lock stays: writers queued on it must serialize with those of a
            # collection created again under the same name.
            shard = self._shards.pop(name, None)
            self._dims.pop(name, None)
            await asyncio.to_thread(_close_and_remove, shard, path)

    async def collection_exists(self, name: str) -> bool:
        return await self._shard(name) is not None

    async def flush(self, name: str) -> None:
        shard = await self._shard(name)
        if shard is None:
            return
        async with self._write_lock(name):
            if self._shards.get(name) is shard:
                await asyncio.to_thread(shard.flush)

    async def optimize(self, name: str) -> None:
        """Build HNSW and merge segments; blocks this shard's writes meanwhile (reads go on)."""
        shard = await self._shard(name)
        if shard is not None:
            await self._optimize(name, shard)

    async def settled(self) -> None:
        """Wait for the index builds started so far."""
        await asyncio.gather(*self._index_builds.values(), return_exceptions=True)

    async def close(self) -> None:
        self._closing = True
        # Builds under way are waited for: cancelling their tasks would not stop the engine,
        # and a shard must not be closed under a build. Those not started yet return at once.
        await self.settled()
        async with self._registry_lock:
            for name, shard in list(self._shards.items()):
                async with self._write_lock(name):
                    await asyncio.to_thread(shard.close)
            self._shards.clear()
            self._write_locks.clear()

    # ---- writes ----------------------------------------------------------------------------

    async def replace_document(
        self, name: str, document_id: str, points: list[ChunkPoint], *, durable: bool = True
    ) -> None:
        check_document_points(document_id, points)
        stale = qe.Filter(
            must=[qe.FieldCondition("document_id", match=qe.MatchValue(document_id))],
            must_not=[qe.HasIdCondition({p.id for p in points})] if points else None,
        )
        # Upsert first, then delete the leftovers: readers never see the document empty.
        ops = [qe.UpdateOperation.delete_points_by_filter(stale)]
        if points:
            ops.insert(0, qe.UpdateOperation.upsert_points([_edge_point(p) for p in points]))
        if not await self._write(name, ops, durable=durable):
            raise NotFound(f"collection {name} does not exist")

    async def upsert(self, name: str, points: list[ChunkPoint]) -> None:
        if points and not await self._write(
            name, [qe.UpdateOperation.upsert_points([_edge_point(p) for p in points])]
        ):
            raise NotFound(f"collection {name} does not exist")

    async def delete_document(self, name: str, document_id: str) -> None:
        await self.delete(name, Filter(must=(Match("document_id", document_id),)))

    async def delete(self, name: str, flt: Filter) -> None:
        await self._write(name, [qe.UpdateOperation.delete_points_by_filter(_edge_filter(flt))])

    async def set_payload(self, name: str, flt: Filter, payload: dict[str, Any]) -> None:
        op = qe.UpdateOperation.set_payload_by_filter(_edge_filter(flt), payload)
        if not await self._write(name, [op]):
            raise NotFound(f"collection {name} does not exist")

    # ---- reads -----------------------------------------------------------------------------

    async def query(self, name: str, query: Query) -> list[Hit]:
        return (await self.query_many(name, [query]))[0]

    async def query_many(self, name: str, queries: list[Query]) -> list[list[Hit]]:
        shard = await self._shard(name)
        if shard is None:
            return [[] for _ in queries]
        batch = qe.QueryBatchRequest([_edge_query(q) for q in queries])
        # One pass over the segments for all (a batch is 10-15 % cheaper than one query
        # after another). Called inline: see `_read`.
        results = _read(shard.query_batch, batch)
        return [_hits(points) for points in results]

    async def retrieve(self, name: str, ids: list[str]) -> list[Hit]:
        shard = await self._shard(name)
        if shard is None or not ids:
            return []
        keys = uuid_strings(ids)
        records = _read(shard.retrieve, list(keys), with_payload=True, with_vector=False)
        by_id = {str(r.id): r for r in records}
        # Requested order, so callers can zip results with their ids.
        return [Hit(id=k, score=None, payload=by_id[k].payload or {}) for k in keys if k in by_id]

    async def scroll(self, name: str, flt: Filter, limit: int) -> list[Hit]:
        shard = await self._shard(name)
        if shard is None:
            return []
        request = qe.ScrollRequest(
            limit=limit, filter=_edge_filter(flt), with_payload=True, with_vector=False
        )
        records, _next = _read(shard.scroll, request)
        return [Hit(id=str(r.id), score=None, payload=r.payload or {}) for r in records]

    async def page(
        self, name: str, offset: str | None, limit: int, fields: tuple[str, ...] | None = None
    ) -> tuple[list[Hit], str | None]:
        shard = await self._shard(name)
        if shard is None:
            return [], None
        request = qe.ScrollRequest(
            offset=uuid.UUID(offset) if offset else None,
            limit=limit,
            with_payload=True if fields is None else list(fields),
            with_vector=False,
        )
        records, after = _read(shard.scroll, request)
        hits = [Hit(str(r.id), None, r.payload or {}) for r in records]
        return hits, None if after is None else str(after)

    async def export(
        self, name: str, offset: str | None, limit: int
    ) -> tuple[list[ChunkPoint], str | None]:
        shard = await self._shard(name)
        if shard is None:
            return [], None
        request = qe.ScrollRequest(
            offset=uuid.UUID(offset) if offset else None,
            limit=limit,
            with_payload=True,
            with_vector=True,
        )
        records, after = _read(shard.scroll, request)
        return [_chunk_point(r) for r in records], None if after is None else str(after)

    async def count(self, name: str, flt: Filter | None = None) -> int:
        shard = await self._shard(name)
        if shard is None:
            return 0
        request = qe.CountRequest(exact=True, filter=_edge_filter(flt))
        return _read(shard.count, request)

    async def term_stats(self, name: str, terms: list[int]) -> TermStats:
        shard = await self._shard(name)
        if shard is None:
            return TermStats(0)

        probes = qe.QueryBatchRequest(
            [
                qe.QueryRequest(
                    limit=1,
                    query=qe.Query.Nearest(
                        qe.SparseVector(indices=[t], values=[1.0]), using=SPARSE
                    ),
                    with_vector=[SPARSE],
                    with_payload=False,
                )
                for t in terms
            ]
        )

        def probe() -> tuple[int, dict[int, tuple[float, float] | None]]:
            points = shard.count(qe.CountRequest(exact=True, filter=qe.Filter()))
            best = shard.query_batch(probes) if terms else []
            return points, {
                t: _probe(b[0], t) if b else None for t, b in zip(terms, best, strict=True)
            }

        points, found = _read(probe)
        return probed_term_stats(points, found)

    async def unindexed(self, name: str) -> int:
        """Dense vectors of the collection outside its HNSW index (searched by full scan)."""
        shard = await self._shard(name)
        return 0 if shard is None else _unindexed(_read(shard.info))

    # ---- internals -------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        if not _NAME_RE.match(name):
            raise InvalidInput(
                "collection name must be 1-128 letters, digits, '-' or '_'", field="collection"
            )
        return self._root / name

    def _write_lock(self, name: str) -> asyncio.Lock:
        return self._write_locks.setdefault(name, asyncio.Lock())

    async def _shard(self, name: str) -> qe.EdgeShard | None:
        """The open shard, loading it from disk on first use; None if the collection is missing."""
        shard = self._shards.get(name)
        if shard is not None:
            return shard
        path = self._path(name)
        async with self._registry_lock:
            shard = self._shards.get(name)
            if shard is None and await asyncio.to_thread(path.is_dir):
                shard = await asyncio.to_thread(qe.EdgeShard.load, str(path))
                self._shards[name] = shard
        return shard

    async def _write(
        self, name: str, ops: Sequence[qe.UpdateOperation], *, durable: bool = True
    ) -> bool:
        """Apply `ops` and flush (unless not `durable`); False when the collection is missing
        (or dropped meanwhile).

        Whoever gets the shard's lock commits every write queued by then, its own and those
        of the callers still waiting, in order, under one flush; a waiter whose write went
        in that way finds it done when its turn comes."""
        shard = await self._shard(name)
        if shard is None:
            return False
        write = _Write(shard, ops, asyncio.get_running_loop().create_future(), durable)
        # A caller cancelled after its write was taken into another's commit has nobody to
        # read the outcome, and asyncio would log a failure nobody read.
        write.done.add_done_callback(lambda done: done.cancelled() or done.exception())
        queued = self._queued.setdefault(name, [])
        queued.append(write)
        try:
            async with self._write_lock(name):
                group = self._queued.pop(name, [])
                if group:
                    await self._commit(name, group)
        except asyncio.CancelledError:
            if self._queued.get(name) is queued and write in queued:
                queued.remove(write)  # not taken into a commit yet: it never happens
            raise
        return await write.done

    async def _commit(self, name: str, group: list[_Write]) -> None:
        shard = self._shards.get(name)
        live = [w for w in group if w.shard is shard]
        try:
            for dropped in (w for w in group if w.shard is not shard):
                dropped.done.set_result(False)  # the shard it was meant for is gone
            if shard is None or not live:
                return
            durable = any(w.durable for w in live)
            errors = await asyncio.to_thread(_apply, shard, [w.ops for w in live], durable)
            for w, error in zip(live, errors, strict=True):
                if error is None:
                    w.done.set_result(True)
                else:
                    w.done.set_exception(error)
            self._index_if_due(name, shard)
        except BaseException as err:
            # The flush failed (or this caller was cancelled mid-commit): nobody's write is
            # known to be on disk, so every caller hears it and retries.
            for w in live:
                if not w.done.done():
                    w.done.set_exception(
                        err if isinstance(err, Exception) else Transient("write interrupted")
                    )
            raise

    async def _optimize(self, name: str, shard: qe.EdgeShard) -> int | None:
        """`optimize` under the shard's write lock: the vectors it left outside the index, or
        None when the shard was dropped or the store closed meanwhile."""
        async with self._write_lock(name):
            if self._closing or self._shards.get(name) is not shard:
                return None
            await asyncio.to_thread(shard.optimize)
            return _unindexed(_read(shard.info))

    def _index_if_due(self, name: str, shard: qe.EdgeShard) -> None:
        """Start building the shard's index when enough vectors wait outside it.

        Unindexed points are searched by full scan, several times slower than indexed. A
        build holds the interpreter lock (seconds per thousand new points), so the process
        pauses while it runs; building every `index_threshold` vectors keeps each pause
        bounded instead of one long pause, or none and slow searches forever (figures in
        docs/benchmarks.md, "Figures behind the code")."""
        if not self._index_threshold or self._closing or name in self._index_builds:
            return
        unindexed = _unindexed(_read(shard.info))  # counters only: cheap
        if unindexed < max(self._build_threshold(name), self._index_floor.get(name, 0)):
            return
        self._index_builds[name] = asyncio.create_task(self._build_index(name, shard))

    def _build_threshold(self, name: str) -> int:
        """Vectors outside the index that start a build: `index_threshold`, or in a bulk load
        a full segment of the shard's dimension (a shard it did not make: `index_threshold`)."""
        dim = self._dims.get(name)
        if not self._bulk or dim is None:
            return self._index_threshold
        return max(self._index_threshold, MAX_SEGMENT_KB * 1024 // (dim * 4))

    async def _build_index(self, name: str, shard: qe.EdgeShard) -> None:
        started = time.monotonic()
        try:
            left = await self._optimize(name, shard)
            if left is None:
                return
            # Declined (the shard's own threshold is higher): ask again a threshold later.
            self._index_floor[name] = left + self._index_threshold if left else 0
            log.info(
                "index_built collection=%s seconds=%.1f unindexed=%d",
                name,
                time.monotonic() - started,
                left,
            )
        except Exception:  # a failed build leaves the shard searchable by full scan
            log.exception("index_build_failed collection=%s", name)
        finally:
            self._index_builds.pop(name, None)


def _unindexed(info: qe.ShardInfo) -> int:
    """Dense vectors outside the HNSW index. Every point has two vectors, and the BM25 one is
    indexed as it is written, so the difference is what only a build indexes."""
    return max(0, 2 * info.points_count - info.indexed_vectors_count)


# ---- blocking helpers (run in worker threads) ----------------------------------------------


def _open_or_create(path: Path, dim: int, index_threshold: int = 0) -> qe.EdgeShard:
    if path.is_dir():
        return qe.EdgeShard.load(str(path))
    # The engine's own threshold (in KiB of vectors) set to ours, so a build we start does
    # index; shards made without it keep the engine's default.
    optimizers = qe.EdgeOptimizersConfig(
        indexing_threshold=math.ceil(index_threshold * dim * 4 / 1024) if index_threshold else None,
        max_segment_size=MAX_SEGMENT_KB,
    )
    config = qe.EdgeConfig(
        vectors={
            DENSE: qe.EdgeVectorParams(
                size=dim,
                distance=qe.Distance.Cosine,
                quantization_config=qe.ScalarQuantizationConfig(
                    qe.ScalarType.Int8, quantile=QUANTILE, always_ram=True
                ),
            )
        },
        sparse_vectors={SPARSE: qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf)},
        optimizers=optimizers,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    return qe.EdgeShard.create(str(path), config)


def _ensure_indexes(shard: qe.EdgeShard) -> None:
    existing = shard.info().payload_schema
    missing = [key for key in PAYLOAD_INDEXES if key not in existing]
    for key in missing:
        shard.update(qe.UpdateOperation.create_field_index(key, _INDEX_KINDS[PAYLOAD_INDEXES[key]]))
    if missing:
        shard.flush()


@dataclass(eq=False)
class _Write:
    shard: qe.EdgeShard
    ops: Sequence[qe.UpdateOperation]
    done: asyncio.Future[bool]
    durable: bool = True


def _apply(
    shard: qe.EdgeShard, writes: list[Sequence[qe.UpdateOperation]], flush: bool = True
) -> list[Exception | None]:
    """Each write's operations in order, then one flush (if asked); per write, the error that
    stopped it (one rejected write leaves the others of its group in)."""
    errors: list[Exception | None] = []
    for ops in writes:
        try:
            for op in ops:
                shard.update(op)
        except Exception as err:
            errors.append(err)
        else:
            errors.append(None)
    if flush:
        shard.flush()
    return errors


def _close_and_remove(shard: qe.EdgeShard | None, path: Path) -> None:
    if shard is not None:
        shard.close()
    if not path.is_dir():
        return
    # Rename first (atomic), so a crash mid-delete never leaves a half-removed shard that a
    # later load would trip over.
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex}")
    path.rename(trash)
    shutil.rmtree(trash)


# ---- translation ----------------------------------------------------------------------------


def _edge_point(p: ChunkPoint) -> qe.Point:
    vectors: dict[str, Any] = {
        DENSE: p.dense,
        SPARSE: qe.SparseVector(indices=p.sparse.indices, values=p.sparse.values),
    }
    return qe.Point(p.id, vectors, p.payload)


def _chunk_point(record: qe.Record) -> ChunkPoint:
    return exported_point(record.id, record.vector, record.payload, qe.SparseVector)


# Point ids as strings, by the id's integer. The engine hands out each id as a new
# `uuid.UUID`, and `str()` of one costs about as much as the engine's search of it (a
# hybrid search converts 400; docs/benchmarks.md, "Figures behind the code").
# Cleared when full: a small KB's points stay in it, a large KB's candidates mostly differ
# from search to search anyway.
_ID_STRINGS: dict[int, str] = {}
_ID_STRINGS_MAX = 65_536


def _hits(points: list[qe.ScoredPoint]) -> list[Hit]:
    strings = _ID_STRINGS
    out = []
    for p in points:
        point_id = p.id
        if not isinstance(point_id, uuid.UUID):  # kbmesh writes UUIDs only
            out.append(Hit(str(point_id), p.score, p.payload or {}))
            continue
        key = point_id.int
        text = strings.get(key)
        if text is None:
            if len(strings) >= _ID_STRINGS_MAX:
                strings.clear()
            text = strings[key] = str(point_id)
        out.append(Hit(text, p.score, p.payload or {}))
    return out


def _probe(point: qe.ScoredPoint, term: int) -> tuple[float, float]:
    """(score, the point's own weight of `term`) of a one-term probe's best point."""
    vectors = point.vector
    vector = vectors.get(SPARSE) if isinstance(vectors, dict) else None
    if not isinstance(vector, qe.SparseVector):
        return point.score, 0.0
    return point.score, dict(zip(vector.indices, vector.values, strict=True)).get(term, 0.0)


def _edge_query(q: Query) -> qe.QueryRequest:
    check_signal(q)
    flt = _edge_filter(q.filter)
    payload = payload_selector(q)
    if q.mode is Mode.dense:
        params = qe.SearchParams(hnsw_ef=q.hnsw_ef, quantization=_RESCORED)
        return qe.QueryRequest(
            limit=q.limit, query=_dense(q), filter=flt, params=params, with_payload=payload
        )
    return qe.QueryRequest(limit=q.limit, query=_sparse(q), filter=flt, with_payload=payload)


# Ignored by collections made before they had an int8 copy.
_RESCORED = qe.QuantizationSearchParams(rescore=True, oversampling=OVERSAMPLING)


def _dense(q: Query) -> qe.Query:
    if q.dense is None:
        raise InvalidInput(f"{q.mode} search needs a dense query vector", field="dense")
    return qe.Query.Nearest(q.dense, using=DENSE)


def _sparse(q: Query) -> qe.Query:
    if q.sparse is None:
        raise InvalidInput(f"{q.mode} search needs a sparse query vector", field="sparse")
    return qe.Query.Nearest(
        qe.SparseVector(indices=q.sparse.indices, values=q.sparse.values), using=SPARSE
    )


def _edge_filter(flt: Filter | None) -> qe.Filter:
    if flt is None:
        return qe.Filter()
    return qe.Filter(
        must=[_edge_condition(c) for c in flt.must] or None,
        must_not=[_edge_condition(c) for c in flt.must_not] or None,
    )


def _edge_condition(c: Condition) -> qe.FieldCondition | qe.HasIdCondition:
    match c:
        case Match(key=key, value=bool() as flag):
            # qdrant-edge-py 0.9 reads a Python bool as an integer (MatchValue(True).value == 1)
            # and then matches only the number 1, never a stored true; numpy's bool is read
            # as a bool.
            return qe.FieldCondition(key, match=qe.MatchValue(np.bool_(flag)))  # type: ignore[arg-type]
        case Match(key=key, value=value):
            return qe.FieldCondition(key, match=qe.MatchValue(value))
        case MatchAny(key=key, values=values):
            return qe.FieldCondition(key, match=qe.MatchAny(any_values(values)))
        case MatchText(key=key, text=text):
            return qe.FieldCondition(key, match=qe.MatchText(text))
        case MatchSubstring(key=key, text=text):
            return qe.FieldCondition(key, match=qe.MatchSubstring(text))
        case Range(key=key, gte=gte, lte=lte, gt=gt, lt=lt):
            return qe.FieldCondition(key, range=qe.RangeFloat(gte=gte, gt=gt, lte=lte, lt=lt))
        case DateRange(key=key, gte=gte, lte=lte):
            return qe.FieldCondition(key, range=qe.RangeDateTime(gte=_iso(gte), lte=_iso(lte)))
        case HasIds(ids=ids):
            return qe.HasIdCondition(set(ids))
    raise InvalidInput(f"unsupported filter condition {c!r}")


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    # Naive datetimes are taken as UTC, as the payload's uploaded_at is.
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


def _read(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """A search or point lookup, run on the calling (event loop) thread. Edge keeps the
    interpreter lock for the whole call, so a worker thread would not let the loop run
    meanwhile; it only added two thread switches (docs/benchmarks.md, "Figures behind the code")."""
    return call(*args, **kwargs)
