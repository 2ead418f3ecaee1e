"""Document ids of candidate chunks: read from the store once, then remembered."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest

from services.common.domain.ids import point_id
from services.common.ops import metrics
from services.common.store import ChunkPoint, SparseVector
from services.common.store.edge import EdgeStore
from services.search import documents
from services.search.documents import DocumentIds

KB = "kb-1"


def chunk(document: str, index: int) -> ChunkPoint:
    return ChunkPoint(
        id=point_id(KB, document, index),
        dense=[1.0, float(index), 0.5],
        sparse=SparseVector(indices=[index + 1], values=[1.0]),
        payload={"document_id": document, "chunk_index": index, "content": "text"},
    )


async def test_document_ids_are_read_once_and_gone_points_left_out(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path)
    await store.ensure_collection("c", 3)
    points = [chunk("a", 0), chunk("a", 1), chunk("b", 0)]
    await store.upsert("c", points)
    ids = DocumentIds(store)
    gone = point_id(KB, "c", 0)
    try:
        wanted = [p.id for p in points] + [gone, points[0].id]
        assert await ids.get("c", wanted) == {
            points[0].id: "a",
            points[1].id: "a",
            points[2].id: "b",
        }
        assert ids.reads == 4  # each distinct id once, the missing one included
        assert await ids.get("c", [points[2].id, points[1].id]) == {
            points[2].id: "b",
            points[1].id: "a",
        }
        assert ids.reads == 4  # all remembered
        await store.upsert("c", [chunk("c", 0)])
        assert await ids.get("c", [gone]) == {gone: "c"}  # stored now: read again
    finally:
        await store.close()


async def test_document_ids_remembered_are_bounded_and_start_over(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path)
    await store.ensure_collection("c", 3)
    points = [chunk(f"d{i}", 0) for i in range(5)]
    await store.upsert("c", points)
    ids = DocumentIds(store, max_points=3)
    try:
        found = await ids.get("c", [p.id for p in points])
        assert found == {p.id: p.payload["document_id"] for p in points}  # whatever the bound
        assert ids.reads == 5
        assert len(ids) <= 3
        await ids.get("c", [p.id for p in points[:2]])
        assert len(ids) <= 3
    finally:
        await store.close()


async def test_remembered_ids_answer_from_the_merged_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Points remembered in several merges are all answered without a read, and a point
    written since (never seen) is read once."""
    monkeypatch.setattr(documents, "MERGE_EVERY", 4)
    store = EdgeStore(tmp_path)
    await store.ensure_collection("c", 3)
    points = [chunk(f"d{i // 2}", i % 2) for i in range(11)]
    await store.upsert("c", points)
    ids = DocumentIds(store)
    try:
        for start in range(0, 11, 3):
            await ids.get("c", [p.id for p in points[start : start + 3]])
        assert ids.reads == 11
        found = await ids.get("c", reversed([p.id for p in points]))
        assert found == {p.id: p.payload["document_id"] for p in points}
        assert ids.reads == 11
        new = chunk("e", 0)
        await store.upsert("c", [new])
        assert await ids.get("c", [new.id, points[3].id]) == {new.id: "e", points[3].id: "d1"}
        assert ids.reads == 12
    finally:
        await store.close()


async def test_a_large_collection_is_remembered_in_few_bytes_a_point(tmp_path: Path) -> None:
    """Every chunk of a collection is remembered, at under 48 bytes a chunk (documents of
    ten chunks): a million-chunk KB fits in a replica's memory, not a bounded share of it."""
    store = EdgeStore(tmp_path, index_threshold=0)
    await store.ensure_collection("c", 3)
    n = 40_000
    points = [chunk(f"document-{i // 10:08d}", i % 10) for i in range(n)]
    for start in range(0, n, 5000):
        await store.upsert("c", points[start : start + 5000])
    ids = DocumentIds(store)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ids.read_all("c")
        await ids._reading["c"]
        held = tracemalloc.get_traced_memory()[0] - before
        assert metrics.DOCUMENT_IDS._value.get() == n
        assert held / n < 48, f"{held / n:.0f} bytes a chunk"
        sample = points[::997]
        assert await ids.get("c", [p.id for p in sample]) == {
            p.id: p.payload["document_id"] for p in sample
        }
        assert ids.reads == 0
    finally:
        tracemalloc.stop()
        await ids.close()
        await store.close()


async def test_a_collection_is_read_in_the_background_once(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path)
    await store.ensure_collection("c", 3)
    points = [chunk(f"d{i // 3}", i % 3) for i in range(600)]  # more than one page
    await store.upsert("c", points)
    ids = DocumentIds(store)
    try:
        reads = metrics.DOCUMENT_ID_READS._value.get()
        ids.read_all("c")
        ids.read_all("c")  # already under way: not started twice
        assert len(ids._reading) == 1
        await asyncio.sleep(0)  # the read has begun: operators see it under way
        assert metrics.DOCUMENT_ID_READS._value.get() == reads + 1
        await ids._reading["c"]
        assert metrics.DOCUMENT_ID_READS._value.get() == reads
        assert metrics.DOCUMENT_IDS._value.get() == 600
        found = await ids.get("c", [p.id for p in points])
        assert ids.reads == 0
        assert found == {p.id: p.payload["document_id"] for p in points}
        ids.read_all("missing")  # a collection that does not exist ends its read quietly
        await ids._reading["missing"]
        assert metrics.DOCUMENT_ID_READS._value.get() == reads
    finally:
        await ids.close()
        await store.close()


async def test_background_reads_stop_at_the_bound_and_end_with_close(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path)
    await store.ensure_collection("c", 3)
    await store.upsert("c", [chunk(f"d{i}", 0) for i in range(600)])
    ids = DocumentIds(store, max_points=300)
    try:
        ids.read_all("c")
        await ids._reading["c"]
        assert 0 < len(ids) <= 300
    finally:
        await ids.close()
        await store.close()
