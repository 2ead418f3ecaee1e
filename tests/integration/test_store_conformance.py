"""One conformance suite for every VectorStore adapter: Edge (embedded), the server adapter on
qdrant-client's local mode, and the server adapter on a real Qdrant container when Docker is
reachable. Each test runs through the public interface only, on a fresh uuid-named collection.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
import qdrant_edge as qe

from services.common.domain.errors import InvalidInput, NotFound
from services.common.store import (
    ChunkPoint,
    DateRange,
    Filter,
    HasIds,
    Hit,
    Match,
    MatchAny,
    MatchText,
    Mode,
    Query,
    Range,
    SparseVector,
    TermStats,
    VectorStore,
    edge,
)
from services.common.store.base import DENSE, idf
from services.common.store.edge import EdgeStore
from services.common.store.server import ServerStore

DIM = 8
_POINT_NS = uuid.UUID("0b9f8a51-3c0e-4d51-9f3e-6f2f4f1f7a20")
# Newest server by default: qdrant-client warns (an error here) when the server is more than
# one minor version away from it.
QDRANT_IMAGE = os.environ.get("KBMESH_TEST_QDRANT_IMAGE", "qdrant/qdrant:latest")
ROOT = Path(__file__).resolve().parents[2]


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qdrant_server_url() -> Iterator[str]:
    """A Qdrant container for the whole session; skipped when no Docker engine answers."""
    import docker
    from testcontainers.community.qdrant import QdrantContainer

    try:
        with docker.from_env(timeout=5) as engine:
            engine.ping()
    except Exception as err:  # no socket, refused or timed out: all mean "no Docker here"
        pytest.skip(f"no Docker engine reachable: {err}")
    container = QdrantContainer(image=QDRANT_IMAGE)
    container.start()
    try:
        host = container.get_container_host_ip()
        yield f"http://{host}:{container.get_exposed_port(6333)}"
    finally:
        container.stop()


@pytest.fixture(
    params=["edge", "server-local", pytest.param("server-docker", marks=pytest.mark.docker)]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[VectorStore]:
    adapter: VectorStore
    if request.param == "edge":
        adapter = EdgeStore(tmp_path / "shards")
    elif request.param == "server-local":
        adapter = ServerStore(location=":memory:")
    else:
        adapter = ServerStore(url=request.getfixturevalue("qdrant_server_url"))
    yield adapter
    await adapter.close()


@pytest.fixture
async def kb(store: VectorStore) -> AsyncIterator[str]:
    """A fresh, empty collection; dropped afterwards (a real server outlives the test)."""
    name = f"kb_{uuid.uuid4().hex}"
    await store.ensure_collection(name, DIM)
    yield name
    await store.drop_collection(name)


# ---- data helpers ------------------------------------------------------------------------------


def dense(*values: float) -> list[float]:
    return [*values, *([0.0] * (DIM - len(values)))]


def sparse(terms: dict[int, float]) -> SparseVector:
    keys = sorted(terms)
    return SparseVector(indices=keys, values=[terms[k] for k in keys])


def point_id(document_id: str, index: int) -> str:
    return str(uuid.uuid5(_POINT_NS, f"{document_id}:{index}"))


def chunk(
    document_id: str,
    index: int = 0,
    *,
    vector: list[float] | None = None,
    terms: dict[int, float] | None = None,
    **payload: object,
) -> ChunkPoint:
    body: dict[str, object] = {
        "org_id": "org-a",
        "kb_id": "kb-1",
        "document_id": document_id,
        "document_name": f"{document_id}.txt",
        "chunk_index": index,
        "tags": [],
        "uploaded_at": "2024-01-01T00:00:00+00:00",
        "metadata": {},
        "content": f"chunk {index} of {document_id}",
    }
    body.update(payload)
    return ChunkPoint(
        id=point_id(document_id, index),
        dense=vector or dense(1.0),
        sparse=sparse(terms or {1: 1.0}),
        payload=body,
    )


async def load(store: VectorStore, name: str, points: list[ChunkPoint]) -> None:
    by_document: dict[str, list[ChunkPoint]] = {}
    for p in points:
        by_document.setdefault(p.payload["document_id"], []).append(p)
    for document_id, document_points in by_document.items():
        await store.replace_document(name, document_id, document_points)


def of_document(document_id: str) -> Filter:
    return Filter(must=(Match("document_id", document_id),))


# ---- collections -------------------------------------------------------------------------------


async def test_ensure_collection_is_idempotent(store: VectorStore) -> None:
    """ensure_collection creates once and then leaves the collection and its points alone;
    drop_collection removes it and tolerates a second drop."""
    name = f"kb_{uuid.uuid4().hex}"
    assert not await store.collection_exists(name)
    await store.ensure_collection(name, DIM)
    await store.ensure_collection(name, DIM)
    assert await store.collection_exists(name)
    await load(store, name, [chunk("doc-1")])
    await store.ensure_collection(name, DIM)
    assert await store.count(name) == 1
    await store.drop_collection(name)
    assert not await store.collection_exists(name)
    assert await store.count(name) == 0
    await store.drop_collection(name)


async def test_missing_collection_reads_empty_and_deletes_are_no_ops(store: VectorStore) -> None:
    """On a collection that does not exist, reads return nothing and deletes do nothing,
    while writes that need the collection raise NotFound."""
    name = f"kb_{uuid.uuid4().hex}"
    query = Query(mode=Mode.dense, limit=5, filter=Filter(), dense=dense(1.0))
    assert await store.count(name) == 0
    assert await store.count(name, of_document("doc-1")) == 0
    assert await store.query(name, query) == []
    assert await store.scroll(name, Filter(), 10) == []
    assert await store.retrieve(name, [point_id("doc-1", 0)]) == []
    await store.delete_document(name, "doc-1")
    await store.delete(name, of_document("doc-1"))
    await store.drop_collection(name)
    with pytest.raises(NotFound):
        await store.replace_document(name, "doc-1", [chunk("doc-1")])
    with pytest.raises(NotFound):
        await store.set_payload(name, of_document("doc-1"), {"tags": ["x"]})
    assert not await store.collection_exists(name)


# ---- documents ---------------------------------------------------------------------------------


async def test_replace_document_removes_extra_chunks_and_is_idempotent(
    store: VectorStore, kb: str
) -> None:
    """Replacing a document with fewer chunks deletes the extras, re-running the same
    replacement changes nothing, and other documents are untouched."""
    await load(store, kb, [chunk("doc-1", i) for i in range(3)] + [chunk("doc-2", 0)])
    assert await store.count(kb, of_document("doc-1")) == 3

    fewer = [chunk("doc-1", i, content=f"v2 chunk {i}") for i in range(2)]
    await store.replace_document(kb, "doc-1", fewer)
    assert await store.count(kb, of_document("doc-1")) == 2
    assert await store.retrieve(kb, [point_id("doc-1", 2)]) == []
    hits = await store.retrieve(kb, [p.id for p in fewer])
    assert [h.payload["content"] for h in hits] == ["v2 chunk 0", "v2 chunk 1"]

    await store.replace_document(kb, "doc-1", fewer)
    assert await store.count(kb, of_document("doc-1")) == 2
    assert {h.id for h in await store.scroll(kb, of_document("doc-1"), 10)} == {p.id for p in fewer}
    assert await store.count(kb, of_document("doc-2")) == 1


async def test_a_write_not_waiting_for_the_disk_is_read_at_once_and_kept_by_flush(
    store: VectorStore, kb: str
) -> None:
    """`durable=False` (a collection nobody searches yet) changes nothing a reader sees:
    the document is replaced at once, and `flush` keeps it; flushing a missing collection
    is a no-op."""
    await load(store, kb, [chunk("doc-1", i) for i in range(3)])
    fewer = [chunk("doc-1", i, content=f"v2 chunk {i}") for i in range(2)]
    await store.replace_document(kb, "doc-1", fewer, durable=False)
    assert await store.count(kb, of_document("doc-1")) == 2
    await store.flush(kb)
    hits = await store.retrieve(kb, [p.id for p in fewer])
    assert [h.payload["content"] for h in hits] == ["v2 chunk 0", "v2 chunk 1"]
    await store.flush(f"kb_{uuid.uuid4().hex}")


async def test_bulk_upsert_overwrites_by_id_across_documents(store: VectorStore, kb: str) -> None:
    """`upsert` loads points of many documents at once; the same ids overwrite, never
    duplicate."""
    points = [chunk(f"doc-{d}", i) for d in range(3) for i in range(4)]
    await store.upsert(kb, points)
    await store.upsert(kb, [chunk("doc-0", 0, content="rewritten")])
    assert await store.count(kb) == 12
    (hit,) = await store.retrieve(kb, [point_id("doc-0", 0)])
    assert hit.payload["content"] == "rewritten"


async def test_replace_document_with_no_points_empties_the_document(
    store: VectorStore, kb: str
) -> None:
    """Replacing a document with an empty chunk list leaves it with no points."""
    await load(store, kb, [chunk("doc-1", i) for i in range(2)] + [chunk("doc-2", 0)])
    await store.replace_document(kb, "doc-1", [])
    assert await store.count(kb, of_document("doc-1")) == 0
    assert await store.count(kb) == 1


async def test_replace_document_rejects_points_of_another_document(
    store: VectorStore, kb: str
) -> None:
    """A point whose payload names another document is refused: replace_document could never
    clean it up later."""
    with pytest.raises(InvalidInput):
        await store.replace_document(kb, "doc-1", [chunk("doc-2")])
    assert await store.count(kb) == 0


async def test_delete_document_and_delete_by_filter(store: VectorStore, kb: str) -> None:
    """delete_document removes exactly one document's points; delete removes what the filter
    matches."""
    await load(
        store,
        kb,
        [chunk("doc-1", i) for i in range(3)]
        + [chunk("doc-2", 0, tags=["old"]), chunk("doc-3", 0, tags=["new"])],
    )
    await store.delete_document(kb, "doc-1")
    assert await store.count(kb, of_document("doc-1")) == 0
    assert await store.count(kb) == 2
    await store.delete(kb, Filter(must=(Match("tags", "old"),)))
    assert [h.payload["document_id"] for h in await store.scroll(kb, Filter(), 10)] == ["doc-3"]


async def test_concurrent_replacements_all_land(store: VectorStore, kb: str) -> None:
    """Many replace_document calls in flight at once, mixed with reads, all take effect."""
    documents = [f"doc-{i}" for i in range(10)]
    await asyncio.gather(
        *(store.replace_document(kb, d, [chunk(d, i) for i in range(3)]) for d in documents),
        *(store.count(kb) for _ in documents),
    )
    assert await store.count(kb) == 30


# ---- search modes ------------------------------------------------------------------------------

# Crafted so each mode has a different best point for the query dense=e0, sparse={42: 1}:
# "dense-best" is nearest but lacks term 42; "sparse-only" has the most of term 42 but is
# orthogonal; "both" is second in each list, which RRF puts first.
MODE_POINTS = [
    chunk("dense-best", vector=dense(1.0), terms={1: 1.0}),
    chunk("both", vector=dense(0.95, 0.31), terms={1: 1.0, 42: 1.0}),
    chunk("filler-1", vector=dense(0.6, 0.8), terms={1: 1.0}),
    chunk("filler-2", vector=dense(0.5, 0.866), terms={1: 1.0}),
    chunk("filler-3", vector=dense(0.4, 0.917), terms={1: 1.0}),
    chunk("sparse-only", vector=dense(*([0.0] * (DIM - 1)), 1.0), terms={42: 2.0}),
]


# What a store query can be: one candidate list (the search service fuses them).
LIST_MODES = [Mode.dense, Mode.keyword]


def mode_query(mode: Mode, flt: Filter | None = None) -> Query:
    return Query(
        mode=mode, limit=10, filter=flt or Filter(), dense=dense(1.0), sparse=sparse({42: 1.0})
    )


def documents(hits: list[Hit]) -> list[str]:
    return [h.payload["document_id"] for h in hits]


async def test_dense_mode_ranks_by_the_dense_vector_only(store: VectorStore, kb: str) -> None:
    """Dense mode returns every point by cosine similarity, ignoring the sparse terms."""
    await load(store, kb, MODE_POINTS)
    hits = await store.query(kb, mode_query(Mode.dense))
    assert documents(hits) == [
        "dense-best",
        "both",
        "filler-1",
        "filler-2",
        "filler-3",
        "sparse-only",
    ]
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)


async def test_keyword_mode_uses_only_the_sparse_vector(store: VectorStore, kb: str) -> None:
    """Keyword mode finds only points that share a sparse term with the query, best first;
    the nearest dense point is not among them."""
    await load(store, kb, MODE_POINTS)
    hits = await store.query(kb, mode_query(Mode.keyword))
    assert documents(hits) == ["sparse-only", "both"]
    assert hits[0].score is not None and hits[1].score is not None
    assert hits[0].score > hits[1].score > 0


async def test_a_hybrid_store_query_is_invalid_input(store: VectorStore, kb: str) -> None:
    """The store answers one candidate list per query; fusing them is the search service's
    (across KBs), so a hybrid store query is refused as invalid input."""
    await load(store, kb, MODE_POINTS)
    with pytest.raises(InvalidInput):
        await store.query(kb, mode_query(Mode.hybrid))


async def test_limit_bounds_a_candidate_list(store: VectorStore, kb: str) -> None:
    """`limit` is the depth of the list: the best that many, in order."""
    await load(store, kb, MODE_POINTS)
    assert documents(await store.query(kb, replace(mode_query(Mode.dense), limit=2))) == [
        "dense-best",
        "both",
    ]
    assert documents(await store.query(kb, replace(mode_query(Mode.keyword), limit=1))) == [
        "sparse-only"
    ]


@pytest.mark.parametrize("mode", LIST_MODES)
async def test_query_returns_ids_payloads_and_scores(
    store: VectorStore, kb: str, mode: Mode
) -> None:
    """Every mode returns the point id as a UUID string, the full payload and a score."""
    await load(store, kb, MODE_POINTS)
    hits = await store.query(kb, mode_query(mode))
    both = next(h for h in hits if h.payload["document_id"] == "both")
    assert both.id == point_id("both", 0)
    assert both.payload == MODE_POINTS[1].payload
    assert all(isinstance(h.score, float) for h in hits)


@pytest.mark.parametrize("mode", LIST_MODES)
async def test_query_returns_only_the_payload_fields_asked_for(
    store: VectorStore, kb: str, mode: Mode
) -> None:
    """`payload` names the fields each hit carries (none when empty); the ranking is the
    same as with whole payloads."""
    await load(store, kb, MODE_POINTS)
    whole = await store.query(kb, mode_query(mode))
    slim = await store.query(kb, replace(mode_query(mode), payload=("document_id",)))
    bare = await store.query(kb, replace(mode_query(mode), payload=()))
    assert [h.id for h in slim] == [h.id for h in bare] == [h.id for h in whole]
    assert [h.payload for h in slim] == [{"document_id": h.payload["document_id"]} for h in whole]
    assert all(h.payload == {} for h in bare)


async def test_query_many_answers_each_query_as_query_does(store: VectorStore, kb: str) -> None:
    """Several queries at once answer in order, each exactly as alone; none on a missing
    collection."""
    await load(store, kb, MODE_POINTS)
    queries = [mode_query(mode) for mode in LIST_MODES]
    alone = [await store.query(kb, q) for q in queries]
    together = await store.query_many(kb, queries)
    assert [[h.id for h in hits] for hits in together] == [[h.id for h in hits] for hits in alone]
    assert await store.query_many("kb_missing", queries) == [[], []]


async def test_edge_point_ids_stay_exact_when_its_id_memo_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edge remembers the string of each point id it hands out; when that memo is full it
    starts over, and every id is still the point's own."""
    from services.common.store import edge

    monkeypatch.setattr(edge, "_ID_STRINGS", {})
    monkeypatch.setattr(edge, "_ID_STRINGS_MAX", 2)
    store = EdgeStore(tmp_path / "edge")
    try:
        await store.ensure_collection("kb_memo", DIM)
        await load(store, "kb_memo", MODE_POINTS)
        want = {p.id for p in MODE_POINTS}
        for _ in range(3):  # fills the memo, clears it, fills it again
            for mode in LIST_MODES:
                hits = await store.query("kb_memo", mode_query(mode))
                assert hits and {h.id for h in hits} <= want
                assert all(h.id == point_id(h.payload["document_id"], 0) for h in hits)
        assert len(edge._ID_STRINGS) <= 2
    finally:
        await store.close()


@pytest.mark.parametrize("mode", LIST_MODES)
async def test_query_needs_the_vectors_its_mode_uses(
    store: VectorStore, kb: str, mode: Mode
) -> None:
    """A query without the vector its mode needs is invalid input, not an engine error."""
    needs_dense = mode is Mode.dense
    query = Query(
        mode=mode,
        limit=5,
        filter=Filter(),
        dense=None if needs_dense else dense(1.0),
        sparse=sparse({1: 1.0}) if needs_dense else None,
    )
    with pytest.raises(InvalidInput):
        await store.query(kb, query)


@pytest.mark.parametrize("mode", LIST_MODES)
async def test_org_filter_isolates_in_every_mode(store: VectorStore, kb: str, mode: Mode) -> None:
    """The filter applies inside the search, not after it: with limit 2 and five better
    org-a points, org-b's only point is still found, and nothing of org-a leaks."""
    await load(
        store,
        kb,
        [
            chunk(f"a-{i}", vector=dense(1.0, 0.01 * i), terms={42: 3.0}, org_id="org-a")
            for i in range(5)
        ]
        + [chunk("b-0", vector=dense(0.5, 0.5), terms={42: 0.5, 7: 1.0}, org_id="org-b")],
    )
    only_b = Filter(must=(Match("org_id", "org-b"),))
    hits = await store.query(kb, replace(mode_query(mode, only_b), limit=2))
    assert documents(hits) == ["b-0"]
    only_a = Filter(must=(Match("org_id", "org-a"),))
    hits = await store.query(kb, mode_query(mode, only_a))
    assert {h.payload["org_id"] for h in hits} == {"org-a"}
    assert len(hits) == 5


# ---- filters -----------------------------------------------------------------------------------

FILTER_POINTS = [
    chunk(
        "A",
        0,
        tags=["finance", "q1"],
        document_name="Employee Handbook 2024.pdf",
        uploaded_at="2024-01-10T08:00:00+00:00",
        metadata={"price": 9.5},
    ),
    chunk(
        "B",
        1,
        tags=["finance"],
        document_name="Travel Policy.docx",
        uploaded_at="2024-03-05T12:30:00+00:00",
        metadata={"price": 20},
    ),
    chunk(
        "C",
        2,
        tags=["hr"],
        document_name="handbook-appendix.md",
        uploaded_at="2024-06-01T00:00:00+00:00",
        metadata={"price": 35.25},
    ),
    chunk(
        "D",
        3,
        tags=[],
        document_name="Notes.txt",
        uploaded_at="2025-01-01T00:00:00+00:00",
        metadata={},
    ),
]

FILTER_CASES = {
    "match-list-field": (Filter(must=(Match("tags", "finance"),)), {"A", "B"}),
    "match-int": (Filter(must=(Match("chunk_index", 2),)), {"C"}),
    "match-any": (Filter(must=(MatchAny("tags", ("hr", "q1")),)), {"A", "C"}),
    "match-any-ids": (Filter(must=(MatchAny("document_id", ("B", "D")),)), {"B", "D"}),
    # A word of the name, any case; a text index matches whole words, not arbitrary substrings.
    "match-text": (Filter(must=(MatchText("document_name", "HANDBOOK"),)), {"A", "C"}),
    "range-int": (Filter(must=(Range("chunk_index", gte=1, lt=3),)), {"B", "C"}),
    "range-metadata": (Filter(must=(Range("metadata.price", gt=9.5, lte=35.25),)), {"B", "C"}),
    "date-range": (
        Filter(
            must=(
                DateRange(
                    "uploaded_at",
                    gte=datetime.fromisoformat("2024-03-01T00:00:00+00:00"),
                    lte=datetime.fromisoformat("2024-12-31T23:59:59+00:00"),
                ),
            )
        ),
        {"B", "C"},
    ),
    "date-range-naive-is-utc": (
        Filter(must=(DateRange("uploaded_at", lte=datetime(2024, 1, 10, 8, 0, 0)),)),
        {"A"},
    ),
    "has-ids": (Filter(must=(HasIds((point_id("A", 0), point_id("D", 3))),)), {"A", "D"}),
    "must-not": (Filter(must_not=(Match("tags", "finance"),)), {"C", "D"}),
    "must-and-must-not": (
        Filter(
            must=(Range("metadata.price", gte=0),),
            must_not=(HasIds((point_id("B", 1),)),),
        ),
        {"A", "C"},
    ),
}


@pytest.mark.parametrize(("flt", "expected"), FILTER_CASES.values(), ids=FILTER_CASES.keys())
async def test_filter_kinds(store: VectorStore, kb: str, flt: Filter, expected: set[str]) -> None:
    """Each filter kind selects the same points in count, scroll, delete and every query mode."""
    await load(store, kb, FILTER_POINTS)
    assert await store.count(kb, flt) == len(expected)
    assert set(documents(await store.scroll(kb, flt, 10))) == expected
    assert set(documents(await store.query(kb, mode_query(Mode.dense, flt)))) == expected
    # Every filter point carries term 1, so keyword search sees all of them too.
    keyword = Query(mode=Mode.keyword, limit=10, filter=flt, sparse=sparse({1: 1.0}))
    assert set(documents(await store.query(kb, keyword))) == expected
    await store.delete(kb, flt)
    assert await store.count(kb) == len(FILTER_POINTS) - len(expected)


async def test_set_payload_sets_keys_and_is_visible_to_filters(store: VectorStore, kb: str) -> None:
    """set_payload overwrites only the given keys on matching points, and filters see the new
    values at once."""
    await load(store, kb, FILTER_POINTS)
    await store.set_payload(kb, Filter(must=(Match("tags", "finance"),)), {"tags": ["archived"]})
    archived = Filter(must=(Match("tags", "archived"),))
    assert set(documents(await store.scroll(kb, archived, 10))) == {"A", "B"}
    assert await store.count(kb, Filter(must=(Match("tags", "finance"),))) == 0
    [a] = await store.retrieve(kb, [point_id("A", 0)])
    assert a.payload["document_name"] == "Employee Handbook 2024.pdf"
    assert a.payload["metadata"] == {"price": 9.5}

    await store.set_payload(kb, Filter(), {"collection": "manuals"})
    assert await store.count(kb, Filter(must=(Match("collection", "manuals"),))) == 4


# ---- reads -------------------------------------------------------------------------------------


async def test_retrieve_scroll_and_count(store: VectorStore, kb: str) -> None:
    """retrieve returns the existing ids in the order asked, without scores; scroll honours
    its limit and has no scores; count is exact with and without a filter."""
    await load(store, kb, FILTER_POINTS)
    wanted = [point_id("C", 2), str(uuid.uuid4()), point_id("A", 0)]
    hits = await store.retrieve(kb, wanted)
    assert [h.id for h in hits] == [point_id("C", 2), point_id("A", 0)]
    assert [h.payload["document_id"] for h in hits] == ["C", "A"]
    assert all(h.score is None for h in hits)
    assert await store.retrieve(kb, []) == []

    page = await store.scroll(kb, Filter(), 3)
    assert len(page) == 3
    assert all(h.score is None and h.payload for h in page)
    assert len(await store.scroll(kb, Filter(), 10)) == 4

    assert await store.count(kb) == 4
    assert await store.count(kb, None) == 4
    assert await store.count(kb, Filter(must=(Match("tags", "finance"),))) == 2


async def test_pages_cover_every_point_once_with_the_fields_asked(
    store: VectorStore, kb: str
) -> None:
    points = [chunk(d, i) for d in "ABC" for i in range(3)]
    await store.upsert(kb, points)
    seen: list[str] = []
    offset: str | None = None
    pages = 0
    while True:
        hits, offset = await store.page(kb, offset, 4, ("document_id",))
        pages += 1
        seen += [h.id for h in hits]
        assert all(h.score is None and set(h.payload) == {"document_id"} for h in hits)
        assert {h.payload["document_id"] for h in hits} <= set("ABC")
        if offset is None:
            break
    assert sorted(seen) == sorted(p.id for p in points) and pages == 3
    whole, after = await store.page(kb, None, 100)
    assert len(whole) == 9 and after is None and whole[0].payload["content"]
    assert await store.page(f"{kb}-missing", None, 10) == ([], None)


async def test_exported_points_written_back_are_the_same_points_and_answers(
    store: VectorStore, kb: str
) -> None:
    """`export` pages through every point with its dense and sparse vectors and payload;
    `upsert` of those pages into a new collection (a restore) gives back the same points,
    term statistics and rankings, scores included, without the vectors being computed again."""
    # No two at the same distance from the query: ties may come back in either order.
    more = (chunk(f"more-{i}", vector=dense(0.3, 0.1 * i + 0.05)) for i in range(5))
    points = [*MODE_POINTS, *more]
    await load(store, kb, points)
    exported: list[ChunkPoint] = []
    offset: str | None = None
    pages = 0
    while True:
        page, offset = await store.export(kb, offset, 4)
        exported += page
        pages += 1
        if offset is None:
            break
    assert pages == 3 and sorted(p.id for p in exported) == sorted(p.id for p in points)
    by_id = {p.id: p for p in points}
    for p in exported:
        assert p.payload == by_id[p.id].payload and p.sparse == by_id[p.id].sparse
        norm = sum(x * x for x in by_id[p.id].dense) ** 0.5  # cosine: kept normalised
        assert p.dense == pytest.approx([x / norm for x in by_id[p.id].dense], abs=1e-6)

    copy = f"kb_{uuid.uuid4().hex}"
    await store.ensure_collection(copy, DIM)
    try:
        await store.upsert(copy, exported)
        assert await store.count(copy) == len(points)
        assert await store.term_stats(copy, [1, 42]) == await store.term_stats(kb, [1, 42])
        for mode in LIST_MODES:
            before, after = (
                await store.query(kb, mode_query(mode)),
                await store.query(copy, mode_query(mode)),
            )
            assert [h.id for h in after] == [h.id for h in before]
            assert [h.score for h in after] == pytest.approx([h.score for h in before], abs=1e-6)
        again = {p.id: p for p in (await store.export(copy, None, 100))[0]}
        for p in exported:
            assert again[p.id].dense == pytest.approx(p.dense, abs=1e-6)
    finally:
        await store.drop_collection(copy)
    assert await store.export(f"{kb}-missing", None, 10) == ([], None)


async def test_term_stats_are_what_the_idf_ranks_with(store: VectorStore, kb: str) -> None:
    """term_stats reports the collection's points and each term's document frequency, read
    from the engine's own scoring: a one-term keyword query scores `idf(points, df) · w`."""
    # Term 1 in 5 of 7 points, term 2 in 2, term 3 in 1, term 4 in none; weights differ.
    held = {
        ("A", 0): {1: 0.4, 2: 1.3},
        ("A", 1): {1: 0.9},
        ("B", 0): {1: 1.7, 3: 0.2},
        ("B", 1): {5: 1.0},
        ("C", 0): {1: 0.1, 2: 0.6},
        ("C", 1): {1: 2.0},
        ("C", 2): {5: 0.3},
    }
    await load(store, kb, [chunk(d, i, terms=t) for (d, i), t in held.items()])
    stats = await store.term_stats(kb, [1, 2, 3, 4])
    assert stats == TermStats(points=7, df={1: 5, 2: 2, 3: 1})

    query = Query(mode=Mode.keyword, limit=10, filter=Filter(), sparse=sparse({2: 1.0}))
    scores = {h.id: h.score for h in await store.query(kb, query)}
    assert scores == pytest.approx(
        {point_id("A", 0): idf(7, 2) * 1.3, point_id("C", 0): idf(7, 2) * 0.6}, rel=1e-5
    )
    # Deleting a document is seen at once.
    await store.delete_document(kb, "C")
    assert await store.term_stats(kb, [1, 2]) == TermStats(points=4, df={1: 3, 2: 1})
    assert await store.term_stats(f"kb_{uuid.uuid4().hex}", [1]) == TermStats(points=0)


async def test_optimize_keeps_results(store: VectorStore, kb: str) -> None:
    """optimize (a no-op on a server) leaves points and rankings as they were."""
    await load(store, kb, MODE_POINTS)
    before = await store.query_many(kb, [mode_query(m) for m in LIST_MODES])
    await store.optimize(kb)
    after = await store.query_many(kb, [mode_query(m) for m in LIST_MODES])
    assert [[h.id for h in hits] for hits in after] == [[h.id for h in hits] for hits in before]
    assert await store.count(kb) == len(MODE_POINTS)
    await store.optimize(f"kb_{uuid.uuid4().hex}")


# ---- Edge persistence --------------------------------------------------------------------------


async def test_edge_data_survives_close_and_reopen(tmp_path: Path) -> None:
    """An Edge shard reopened by a new EdgeStore on the same root has its points, payload
    indexes (text filter) and search."""
    root = tmp_path / "shards"
    name = f"kb_{uuid.uuid4().hex}"
    first = EdgeStore(root)
    await first.ensure_collection(name, DIM)
    await load(first, name, FILTER_POINTS)
    await first.optimize(name)
    await first.close()

    second = EdgeStore(root)
    try:
        assert await second.collection_exists(name)
        assert await second.count(name) == 4
        text = Filter(must=(MatchText("document_name", "handbook"),))
        assert set(documents(await second.scroll(name, text, 10))) == {"A", "C"}
        hits = await second.query(name, mode_query(Mode.dense))
        assert len(hits) == 4
        await second.drop_collection(name)
        assert not (root / name).exists()
    finally:
        await second.close()


# Runs in a child process that kills itself with SIGKILL right after its writes return.
_KILLED_WRITER = """
import asyncio, os, signal, sys
from pathlib import Path
from services.common.store import ChunkPoint, Filter, Match, SparseVector
from services.common.store import edge
from services.common.store.edge import EdgeStore

async def main() -> None:
    root, name, dim = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = EdgeStore(root)
    await store.ensure_collection(name, dim)
    points = [
        ChunkPoint(
            id=f"00000000-0000-4000-8000-00000000000{i}",
            dense=[1.0] * dim,
            sparse=SparseVector(indices=[1], values=[1.0]),
            payload={"document_id": "doc-1", "chunk_index": i},
        )
        for i in range(3)
    ]
    await store.replace_document(name, "doc-1", points)
    await store.set_payload(name, Filter(must=(Match("chunk_index", 0),)), {"tags": ["x"]})
    # Concurrent writes are committed together: each returned only once on disk.
    others = [
        ChunkPoint(
            id=f"00000000-0000-4000-8000-0000000001{i:02d}",
            dense=[1.0] * dim,
            sparse=SparseVector(indices=[1], values=[1.0]),
            payload={"document_id": f"doc-{i + 2}", "chunk_index": 0},
        )
        for i in range(10)
    ]
    writes = (store.replace_document(name, p.payload["document_id"], [p]) for p in others)
    await asyncio.gather(*writes)
    # Not waiting for the disk: the engine's write-ahead log keeps it across a kill.
    late = ChunkPoint(
        id="00000000-0000-4000-8000-000000000200",
        dense=[1.0] * dim,
        sparse=SparseVector(indices=[1], values=[1.0]),
        payload={"document_id": "doc-late", "chunk_index": 0},
    )
    await store.replace_document(name, "doc-late", [late], durable=False)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_edge_writes_survive_kill_9(tmp_path: Path) -> None:
    """Writes that returned are on disk: a process killed with SIGKILL right after them
    leaves a shard that reopens with every point and payload change, a write made without
    waiting for the disk included (only the machine going down could lose that one)."""
    root = tmp_path / "shards"
    name = f"kb_{uuid.uuid4().hex}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _KILLED_WRITER, str(root), name, str(DIM), cwd=ROOT
    )
    assert await proc.wait() == -signal.SIGKILL

    store = EdgeStore(root)
    try:
        assert await store.count(name) == 14
        assert await store.count(name, Filter(must=(Match("tags", "x"),))) == 1
    finally:
        await store.close()


class _CountingShard:
    """An Edge shard that counts its flushes."""

    def __init__(self, shard: object) -> None:
        self._shard = shard
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        self._shard.flush()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._shard, name)


async def test_edge_commits_concurrent_writes_together(tmp_path: Path) -> None:
    """Writes that queue while one is being flushed go to disk together under one flush
    (a flush holds the process for ~20 ms whatever it carries); a write the engine rejects
    fails alone and its group's other writes land."""
    store = EdgeStore(tmp_path / "shards")
    name = f"kb_{uuid.uuid4().hex}"
    await store.ensure_collection(name, DIM)
    counting = _CountingShard(store._shards[name])
    store._shards[name] = counting  # type: ignore[assignment]
    try:
        good = [f"doc-{i}" for i in range(20)]
        bad = replace(chunk("bad"), dense=[1.0] * (DIM - 1))
        results = await asyncio.gather(
            *(store.replace_document(name, d, [chunk(d, i) for i in range(3)]) for d in good),
            store.replace_document(name, "bad", [bad]),
            return_exceptions=True,
        )
        assert all(r is None for r in results[:-1])
        assert isinstance(results[-1], Exception)
        assert await store.count(name) == 60
        assert counting.flushes < 10  # 21 writes
    finally:
        await store.close()


async def test_edge_writes_not_waiting_for_the_disk_skip_the_flush(tmp_path: Path) -> None:
    """A flush holds the whole process for as long as the disk takes: writes made with
    `durable=False` are applied without one, `flush` puts them on disk with one, and a
    durable write committed with them flushes the group."""
    store = EdgeStore(tmp_path / "shards")
    name = f"kb_{uuid.uuid4().hex}"
    await store.ensure_collection(name, DIM)
    counting = _CountingShard(store._shards[name])
    store._shards[name] = counting  # type: ignore[assignment]
    try:
        for d in (f"doc-{i}" for i in range(10)):
            await store.replace_document(name, d, [chunk(d, 0)], durable=False)
        assert counting.flushes == 0 and await store.count(name) == 10
        await store.flush(name)
        assert counting.flushes == 1
        await asyncio.gather(
            store.replace_document(name, "doc-a", [chunk("doc-a", 0)], durable=False),
            store.replace_document(name, "doc-b", [chunk("doc-b", 0)]),
        )
        assert counting.flushes == 2 and await store.count(name) == 12
    finally:
        await store.close()


async def test_edge_write_cancelled_while_queued_never_happens(tmp_path: Path) -> None:
    """A write whose caller goes away while it waits behind another's flush is dropped from
    the queue: the next commit does not apply it."""
    store = EdgeStore(tmp_path / "shards")
    name = f"kb_{uuid.uuid4().hex}"
    await store.ensure_collection(name, DIM)
    try:
        first = asyncio.create_task(store.replace_document(name, "first", [chunk("first")]))
        await asyncio.sleep(0)  # first holds the shard's lock, flushing
        gone = asyncio.create_task(store.replace_document(name, "gone", [chunk("gone")]))
        await asyncio.sleep(0)  # queued behind it
        gone.cancel()
        await first
        with pytest.raises(asyncio.CancelledError):
            await gone
        await store.replace_document(name, "later", [chunk("later")])
        assert set(documents(await store.scroll(name, Filter(), 10))) == {"first", "later"}
    finally:
        await store.close()


# ---- Edge index builds -------------------------------------------------------------------------


def _spread_points(first: int, count: int, dim: int = DIM) -> list[ChunkPoint]:
    """Points with distinct unit vectors, one document each."""
    points = []
    for i in range(first, first + count):
        rng = random.Random(i)
        raw = [rng.gauss(0.0, 1.0) for _ in range(dim)]
        norm = sum(x * x for x in raw) ** 0.5
        points.append(
            ChunkPoint(
                id=str(uuid.uuid5(_POINT_NS, f"spread-{i}")),
                dense=[x / norm for x in raw],
                sparse=SparseVector(indices=[i % 50], values=[1.0]),
                payload={"document_id": f"d{i}", "chunk_index": 0},
            )
        )
    return points


def _nearest(points: list[ChunkPoint], query: Query) -> list[str]:
    assert query.dense is not None
    cosine = {p.id: sum(a * b for a, b in zip(p.dense, query.dense, strict=True)) for p in points}
    return sorted(cosine, key=cosine.__getitem__, reverse=True)[: query.limit]


async def test_edge_builds_the_index_once_enough_vectors_wait(tmp_path: Path) -> None:
    """Written points stay outside the HNSW index (searched by full scan) until a shard holds
    `index_threshold` of them; then the store builds the index by itself, searches answer the
    same, and later points again wait for the next threshold."""
    store = EdgeStore(tmp_path / "shards", index_threshold=200)
    name = f"kb_{uuid.uuid4().hex}"
    points = _spread_points(0, 400)
    try:
        await store.ensure_collection(name, DIM)
        await store.upsert(name, points[:150])
        await store.settled()
        assert await store.unindexed(name) == 150
        probe = Query(mode=Mode.dense, limit=5, filter=Filter(), dense=points[42].dense)
        assert [h.id for h in await store.query(name, probe)] == _nearest(points[:150], probe)

        await store.upsert(name, points[150:250])  # 250 waiting: a build starts
        await store.settled()
        assert await store.unindexed(name) == 0
        assert await store.count(name) == 250
        assert [h.id for h in await store.query(name, probe)] == _nearest(points[:250], probe)

        await store.upsert(name, points[250:350])
        await store.settled()
        assert await store.unindexed(name) == 100
    finally:
        await store.close()


async def test_edge_index_walks_int8_vectors_and_searches_report_exact_cosines(
    tmp_path: Path,
) -> None:
    """An indexed shard also holds its vectors in int8, which the engine's own scores show
    when it is not asked to rescore; the store's searches rescore on the float vectors, so
    they find the exact nearest points and report their exact cosines."""
    dim = 64
    store = EdgeStore(tmp_path / "shards", index_threshold=200)
    name = f"kb_{uuid.uuid4().hex}"
    points = _spread_points(0, 400, dim)
    try:
        await store.ensure_collection(name, dim)
        await store.upsert(name, points)
        await store.settled()
        assert await store.unindexed(name) == 0
        rng = random.Random(7)
        for _ in range(20):
            query = [rng.gauss(0.0, 1.0) for _ in range(dim)]
            probe = Query(mode=Mode.dense, limit=10, filter=Filter(), dense=query)
            norm = sum(x * x for x in query) ** 0.5
            cosine = {
                p.id: sum(a * b for a, b in zip(p.dense, query, strict=True)) / norm for p in points
            }
            hits = await store.query(name, probe)
            assert [h.id for h in hits] == _nearest(points, probe)
            assert all(abs((h.score or 0.0) - cosine[h.id]) < 1e-5 for h in hits)
        # The engine walking the int8 copies without rescoring: approximate scores.
        unrescored = store._shards[name].query(
            qe.QueryRequest(
                limit=10,
                query=qe.Query.Nearest(query, using=DENSE),
                params=qe.SearchParams(quantization=qe.QuantizationSearchParams(rescore=False)),
            )
        )
        assert max(abs(p.score - cosine[str(p.id)]) for p in unrescored) > 1e-4
    finally:
        await store.close()


async def _write_and_close(
    root: Path, name: str, index_threshold: int, points: list[ChunkPoint]
) -> None:
    store = EdgeStore(root, index_threshold=index_threshold)
    await store.ensure_collection(name, DIM)
    await store.upsert(name, points)
    await store.close()


async def test_edge_without_index_threshold_never_builds(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    name = f"kb_{uuid.uuid4().hex}"
    await _write_and_close(root, name, 100, [])  # a shard the engine would index
    store = EdgeStore(root, index_threshold=0)
    try:
        await store.upsert(name, _spread_points(0, 300))
        await store.settled()
        assert await store.unindexed(name) == 300
    finally:
        await store.close()


async def test_edge_close_during_an_index_build_keeps_every_point(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    name = f"kb_{uuid.uuid4().hex}"
    await _write_and_close(root, name, 100, _spread_points(0, 300))  # closes mid-build
    reopened = EdgeStore(root, index_threshold=100)
    try:
        assert await reopened.count(name) == 300
        await reopened.upsert(name, _spread_points(300, 10))
        await reopened.settled()  # the reopened shard builds what was left
        assert await reopened.unindexed(name) == 0
        assert await reopened.count(name) == 310
    finally:
        await reopened.close()


async def test_edge_shards_cap_their_segments(tmp_path: Path) -> None:
    """A shard the store makes records the segment cap in its engine config, so every later
    load (and every build) keeps it."""
    store = EdgeStore(tmp_path / "shards")
    name = f"kb_{uuid.uuid4().hex}"
    try:
        await store.ensure_collection(name, DIM)
    finally:
        await store.close()
    config = json.loads((tmp_path / "shards" / name / "edge_config.json").read_text())
    assert config["optimizers"]["max_segment_size"] == edge.MAX_SEGMENT_KB


async def test_edge_builds_leave_full_segments_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a segment holds the cap's worth of vectors, a later build indexes new points in a
    segment of their own instead of re-indexing the full one with them; searches still see
    every point."""
    monkeypatch.setattr(edge, "MAX_SEGMENT_KB", 4)  # 128 vectors of 8 floats
    store = EdgeStore(tmp_path / "shards", index_threshold=100)
    name = f"kb_{uuid.uuid4().hex}"
    points = _spread_points(0, 450)
    try:
        await store.ensure_collection(name, DIM)
        for start in range(0, 450, 150):
            await store.upsert(name, points[start : start + 150])
            await store.settled()
            assert await store.unindexed(name) == 0
        assert store._shards[name].info().segments_count >= 3
        assert await store.count(name) == 450
        probe = Query(mode=Mode.dense, limit=10, filter=Filter(), dense=points[321].dense)
        assert [h.id for h in await store.query(name, probe)] == _nearest(points, probe)
    finally:
        await store.close()


async def test_edge_bulk_load_builds_each_segment_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bulk load (a restore) leaves new points outside the index until a full segment's
    worth waits, then builds it once; the shards it makes keep the usual threshold, so the
    stack that serves them later builds every `index_threshold` again."""
    monkeypatch.setattr(edge, "MAX_SEGMENT_KB", 4)  # 128 vectors of 8 floats
    root = tmp_path / "shards"
    name = f"kb_{uuid.uuid4().hex}"
    points = _spread_points(0, 400)
    bulk = EdgeStore(root, index_threshold=100, bulk=True)
    try:
        await bulk.ensure_collection(name, DIM)
        await bulk.upsert(name, points[:120])
        await bulk.settled()
        assert await bulk.unindexed(name) == 120  # past the threshold, short of a segment
        await bulk.upsert(name, points[120:140])
        await bulk.settled()
        assert await bulk.unindexed(name) == 0
    finally:
        await bulk.close()
    served = EdgeStore(root, index_threshold=100)
    try:
        await served.upsert(name, points[140:300])
        await served.settled()
        assert await served.unindexed(name) == 0
        assert await served.count(name) == 300
        probe = Query(mode=Mode.dense, limit=10, filter=Filter(), dense=points[201].dense)
        assert [h.id for h in await served.query(name, probe)] == _nearest(points[:300], probe)
    finally:
        await served.close()
