"""What an HNSW index build buys and costs in the embedded engine (Qdrant Edge).

Loads `--points` random unit vectors (384 dimensions, one BM25 term each) into a fresh
shard without building its index, times a hybrid search's four candidate lists (dense and
BM25, each also over first chunks, one batch), builds the index at once, times the lists
again, then adds `--tail` more points and times the build that takes only them in.

    .venv/bin/python -m benchmarks.edge_indexing --points 100000 --tail 10000
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from services.common.store import ChunkPoint, Filter, Mode, Query, SparseVector
from services.common.store.base import lead_filter
from services.common.store.edge import EdgeStore

DIM = 384
COLLECTION = "kb_bench"


def terms(rng: np.random.Generator, n: int) -> SparseVector:
    indices = sorted({int(t) for t in rng.integers(0, 30_000, n)})
    return SparseVector(indices=indices, values=[1.0] * len(indices))


def points(rng: np.random.Generator, first: int, count: int) -> list[ChunkPoint]:
    vectors = rng.normal(size=(count, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return [
        ChunkPoint(
            id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"edge-indexing-{i}")),
            dense=vectors[i - first].tolist(),
            sparse=terms(rng, 20),
            payload={"document_id": f"d{i // 10}", "chunk_index": i % 10},
        )
        for i in range(first, first + count)
    ]


async def four_lists_ms(store: EdgeStore, rng: np.random.Generator, n: int = 200) -> float:
    times = []
    for _ in range(n):
        dense = rng.normal(size=DIM)
        dense /= np.linalg.norm(dense)
        sparse = terms(rng, 5)
        queries = []
        for where in (Filter(), lead_filter(Filter())):
            queries.append(
                Query(Mode.dense, 100, where, dense=dense.tolist(), payload=("document_id",))
            )
            queries.append(Query(Mode.keyword, 100, where, sparse=sparse, payload=("document_id",)))
        started = time.perf_counter()
        await store.query_many(COLLECTION, queries)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[n // 4 :])


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="edge-indexing-"))
    rng = np.random.default_rng(7)
    # A threshold of 0: this benchmark starts the builds itself, to time them.
    store = EdgeStore(root, index_threshold=0)
    try:
        await store.ensure_collection(COLLECTION, DIM)
        started = time.perf_counter()
        for first in range(0, args.points, 1000):
            await store.upsert(COLLECTION, points(rng, first, min(1000, args.points - first)))
        print(
            f"loaded {args.points} points in {time.perf_counter() - started:.0f} s, "
            f"{await store.unindexed(COLLECTION)} outside the index"
        )
        print(f"four candidate lists, full scan: p50 {await four_lists_ms(store, rng):.2f} ms")
        started = time.perf_counter()
        await store.optimize(COLLECTION)
        print(f"index build of all {args.points}: {time.perf_counter() - started:.1f} s")
        print(f"four candidate lists, indexed:   p50 {await four_lists_ms(store, rng):.2f} ms")
        for first in range(args.points, args.points + args.tail, 1000):
            await store.upsert(COLLECTION, points(rng, first, 1000))
        started = time.perf_counter()
        await store.optimize(COLLECTION)
        print(f"index build of {args.tail} more: {time.perf_counter() - started:.1f} s")
    finally:
        await store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--tail", type=int, default=10_000)
    asyncio.run(main(parser.parse_args()))
