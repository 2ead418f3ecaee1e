"""Document ids of candidate chunks: read from the store once, then remembered."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.common.domain.ids import point_id
from services.common.ops import metrics
from services.common.store import ChunkPoint, SparseVector
from services.common.store.edge import EdgeStore
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


async def test_document_ids_remembered_are_bounded_oldest_first(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path)
    await store.ensure_collection("c", 3)
    points = [chunk(f"d{i}", 0) for i in range(5)]
    await store.upsert("c", points)
    ids = DocumentIds(store, max_points=3)
    try:
        found = await ids.get("c", [p.id for p in points])
        assert len(found) == 5  # a search gets all of its answers, whatever the bound
        assert ids.reads == 5
        await ids.get("c", [p.id for p in points[2:]])
        assert ids.reads == 5  # the newest three stayed
        await ids.get("c", [points[0].id])
        assert ids.reads == 6
    finally:
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
        assert len(ids._of) == 300
    finally:
        await ids.close()
        await store.close()
