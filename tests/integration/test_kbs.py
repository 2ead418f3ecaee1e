"""Knowledge bases over REST against the real stack: listing, settings validation, reindex on
a chunking change while search keeps answering, stats, the KB's documents, and deletion."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from services.common.messages.events import OcrDone
from services.common.messages.names import Subject
from tests.conftest import running_stack
from tests.support.domain import (
    LONG_DOCS,
    LONG_QUERIES,
    create_kb,
    embed_count,
    expected_chunks,
    registry_counts,
    settled,
    stored_chunks,
    uid,
    upload,
    vector_count,
    wait_until,
)

ORG = "local"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(tmp_path_factory.mktemp("kbs"), embedders=embedders) as s:
        yield s


def names_field(r, field: str) -> None:
    """A 4xx problem that names `field`: in `field`, or in the validation `errors`, and in
    the human-readable detail."""
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    fields = {body.get("field")} | {e["field"] for e in body.get("errors", [])}
    assert field in fields, body
    if r.status_code == 422:
        assert field in body["detail"], body


async def test_list_paginates_and_searches_by_name(stack):
    """GET /v1/kbs pages with skip/limit in creation order, reports the total, and
    name_search matches a case-insensitive substring of the name."""
    _rt, client = stack
    prefix = f"Page-{uid()}"
    made = [await create_kb(client, name=f"{prefix}-{i}") for i in range(5)]
    seen = []
    for skip in (0, 2, 4):
        r = await client.get(
            "/v1/kbs", params={"skip": skip, "limit": 2, "name_search": prefix.lower()}
        )
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["total"] == 5 and page["skip"] == skip and page["limit"] == 2
        seen += [kb["kb_id"] for kb in page["items"]]
    assert seen == [kb["kb_id"] for kb in made]
    r = await client.get("/v1/kbs", params={"name_search": f"{prefix}-3"})
    assert [kb["name"] for kb in r.json()["items"]] == [f"{prefix}-3"]
    everything = (await client.get("/v1/kbs", params={"limit": 200})).json()
    assert {kb["kb_id"] for kb in made} <= {kb["kb_id"] for kb in everything["items"]}
    # Get by id and by name.
    assert (await client.get(f"/v1/kbs/{made[1]['kb_id']}")).json()["name"] == f"{prefix}-1"
    assert (await client.get(f"/v1/kbs/{prefix}-1")).json()["kb_id"] == made[1]["kb_id"]


async def test_invalid_settings_get_422_naming_the_field_and_change_nothing(stack):
    """Each KB settings rule — chunk_size within 50-2000, chunk_size within the local
    model's 254-token input, overlap below the chunk size, a known local model,
    coalesce_neighbors 0-5, a known chunker, no collection tags in tag_ids, a name — gets a
    422 naming the field, on create and on update; registries and vectors are unchanged,
    and so is the KB that an update tried to change. An unknown KB is a 404."""
    rt, client = stack
    kb = await create_kb(client, chunk_size=100, tag_ids=["x"])
    await settled(rt)
    before = await registry_counts(rt)
    create_cases = [
        ({"chunk_size": 49}, "chunk_size"),
        ({"chunk_size": 2001}, "chunk_size"),
        ({"chunk_size": 300}, "chunk_size"),  # above all-MiniLM-L6-v2's 254 tokens
        ({"chunk_size": 100, "chunk_overlap": 100}, "chunk_overlap"),
        ({"chunk_overlap": -1}, "chunk_overlap"),
        ({"embedding_model": "local/no-such-model"}, "embedding_model"),
        ({"coalesce_neighbors": 6}, "coalesce_neighbors"),
        ({"coalesce_neighbors": -1}, "coalesce_neighbors"),
        ({"chunker": "semantic"}, "chunker"),
        ({"tag_ids": ["collection:reports"]}, "tag_ids"),
        ({"name": ""}, "name"),
    ]
    for settings, field in create_cases:
        body = {"name": f"bad-{uid()}", **settings}
        r = await client.post("/v1/kbs", json=body)
        assert r.status_code == 422, (settings, r.text)
        names_field(r, field)
    r = await client.post("/v1/kbs", json={"name": "x", "chunk_size": 300})
    assert "254" in r.json()["detail"], r.text

    update_cases = [
        ({"chunk_size": 300}, "chunk_size"),
        ({"chunk_size": 10}, "chunk_size"),
        ({"chunk_overlap": 100}, "chunk_overlap"),  # == the KB's chunk_size
        ({"embedding_model": "local/no-such-model"}, "embedding_model"),
        ({"coalesce_neighbors": 9}, "coalesce_neighbors"),
        ({"name": None}, "name"),
    ]
    for settings, field in update_cases:
        r = await client.patch(f"/v1/kbs/{kb['kb_id']}", json=settings)
        assert r.status_code == 422, (settings, r.text)
        names_field(r, field)
    r = await client.patch("/v1/kbs/no-such-kb", json={"chunk_size": 100})
    assert r.status_code == 404
    names_field(r, "kb_id")

    await settled(rt)
    assert await registry_counts(rt) == before
    after = (await client.get(f"/v1/kbs/{kb['kb_id']}")).json()
    assert {
        k: after[k]
        for k in (
            "chunk_size",
            "chunk_overlap",
            "embedding_model",
            "coalesce_neighbors",
            "settings_version",
            "name",
        )
    } == {
        k: kb[k]
        for k in (
            "chunk_size",
            "chunk_overlap",
            "embedding_model",
            "coalesce_neighbors",
            "settings_version",
            "name",
        )
    }


async def test_chunk_size_change_reindexes_everything_while_search_keeps_answering(stack):
    """PATCH chunk_size 120 → 50 bumps the settings version and marks the KB
    pending_reindex; every member document is re-chunked and re-embedded once, the chunk
    counts converge to what chunking at 50 produces, and the KB turns active. Searches
    issued all along — before, during and after — each answer with the right document
    first; none fails or comes back empty."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=120, tag_ids=[t])
    docs = {}
    for name, text in LONG_DOCS.items():
        up = await upload(client, name, text, tags=[t])
        assert up["status"] == "complete", up
        docs[name] = up["document_id"]
    for name, doc in docs.items():
        assert await stored_chunks(rt, kb["kb_id"], doc) == expected_chunks(
            rt, kb, LONG_DOCS[name], name
        )

    results: list[tuple[float, float, int, str | None, str]] = []
    stop = asyncio.Event()

    async def search_round() -> None:
        for name, query in LONG_QUERIES.items():
            started = time.monotonic()
            r = await client.post("/v1/search", json={"query": query, "kb_ids": [kb["kb_id"]]})
            hits = r.json().get("hits", []) if r.status_code == 200 else []
            top = hits[0]["document_id"] if hits else None
            results.append((started, time.monotonic(), r.status_code, top, docs[name]))

    async def searcher() -> None:
        while not stop.is_set():
            await search_round()

    await search_round()  # warms the query cache, so embed_count counts documents only
    base = embed_count(rt)
    task = asyncio.create_task(searcher())
    patched_at = time.monotonic()
    r = await client.patch(f"/v1/kbs/{kb['kb_id']}", json={"chunk_size": 50})
    assert r.status_code == 200, r.text
    assert r.json()["settings_version"] == kb["settings_version"] + 1
    assert r.json()["status"] == "pending_reindex"

    small = {**kb, "chunk_size": 50}
    want = {doc: expected_chunks(rt, small, LONG_DOCS[name], name) for name, doc in docs.items()}

    async def converged() -> bool:
        entries = [await rt.registries.index.get(f"{kb['kb_id']}.{d}") for d in docs.values()]
        return all(
            e is not None
            and e.settings_version == kb["settings_version"] + 1
            and e.chunk_count == len(want[e.document_id])
            for e in entries
        )

    await wait_until(converged, what="reindex at chunk_size 50")
    converged_at = time.monotonic()
    await search_round()
    stop.set()
    await task

    for doc, chunks in want.items():
        assert await stored_chunks(rt, kb["kb_id"], doc) == chunks
    assert embed_count(rt) - base == sum(len(c) for c in want.values()), "each chunk once"
    during = [res for res in results if res[0] >= patched_at and res[1] <= converged_at]
    assert during, "no search ran while the KB was reindexing"
    failed = [res for res in results if res[2] != 200 or res[3] != res[4]]
    assert not failed, failed
    view = await wait_until(
        lambda: _kb_if_status(client, kb["kb_id"], "active"), what="KB active again"
    )
    assert view["chunk_count"] == sum(len(c) for c in want.values())
    assert view["document_count"] == len(docs)


async def _kb_if_status(client, kb_id: str, status: str) -> dict | None:
    view = (await client.get(f"/v1/kbs/{kb_id}")).json()
    return view if view["status"] == status else None


async def test_reindex_endpoint_rebuilds_and_retry_failed_leaves_healthy_documents(stack):
    """POST /reindex re-embeds every member once under a new settings version;
    POST /retry-failed re-embeds nothing when nothing failed."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=120, tag_ids=[t])
    up = await upload(client, "raft.md", LONG_DOCS["raft.md"], tags=[t])
    chunks = up["chunk_count"]
    base = embed_count(rt)
    r = await client.post(f"/v1/kbs/{kb['kb_id']}/reindex")
    assert r.status_code == 202 and r.json()["documents"] == 1, r.text
    await settled(rt)
    entry = await rt.registries.index.get(f"{kb['kb_id']}.{up['document_id']}")
    assert entry.settings_version == kb["settings_version"] + 1
    assert embed_count(rt) - base == chunks

    base = embed_count(rt)
    r = await client.post(f"/v1/kbs/{kb['kb_id']}/retry-failed")
    assert r.status_code == 202, r.text
    await settled(rt)
    assert embed_count(rt) == base
    assert await vector_count(rt, kb["kb_id"], up["document_id"]) == chunks


async def test_stats_and_kb_documents_listing(stack):
    """Stats count indexed documents and their chunks, every document whose tags match
    (awaiting OCR and failed ones included), and the failed ones. The KB's document
    listing pages, searches by name, and shows each document's status, chunk count and
    indexing time."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=50, tag_ids=[t])
    a = await upload(client, "glaciers.md", LONG_DOCS["glaciers.md"], tags=[t])
    b = await upload(client, "espresso.md", LONG_DOCS["espresso.md"], tags=[t])
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    c = await upload(
        client, "scan-one.png", png, content_encoding="base64", mime_type="image/png", tags=[t]
    )
    d = await upload(
        client, "scan-two.png", png, content_encoding="base64", mime_type="image/png", tags=[t]
    )
    await upload(client, "unrelated.md", "not in this knowledge base", tags=["other"])
    assert c["status"] == d["status"] == "awaiting_ocr"
    await rt.bus.publish(
        Subject.OCR_DONE,
        OcrDone(org_id=ORG, document_id=d["document_id"], ok=False, error="page unreadable"),
    )
    await settled(rt)

    r = await client.get(f"/v1/kbs/{kb['kb_id']}/stats")
    assert r.status_code == 200, r.text
    stats = r.json()
    assert stats["document_count"] == 2
    assert stats["chunk_count"] == a["chunk_count"] + b["chunk_count"]
    assert stats["chunk_count"] == (await vector_count(rt, kb["kb_id"]))
    assert stats["total_documents_with_tags"] == 4
    assert stats["failed_count"] == 1
    assert stats["pending_count"] == 0

    r = await client.get(f"/v1/kbs/{kb['kb_id']}/documents", params={"limit": 3})
    page = r.json()
    assert page["total"] == 4 and len(page["items"]) == 3
    r = await client.get(f"/v1/kbs/{kb['kb_id']}/documents", params={"skip": 3, "limit": 3})
    rest = r.json()["items"]
    listing = {item["document_id"]: item for item in page["items"] + rest}
    assert len(listing) == 4
    assert listing[a["document_id"]]["status"] == "complete"
    assert listing[a["document_id"]]["chunk_count"] == a["chunk_count"]
    assert listing[a["document_id"]]["indexed_at"] is not None
    assert listing[c["document_id"]]["status"] == "awaiting_ocr"
    assert listing[c["document_id"]]["chunk_count"] == 0
    assert listing[d["document_id"]]["status"] == "failed"
    assert listing[d["document_id"]]["indexed_at"] is None
    r = await client.get(f"/v1/kbs/{kb['kb_id']}/documents", params={"name_search": "SCAN"})
    assert {i["document_id"] for i in r.json()["items"]} == {c["document_id"], d["document_id"]}


async def test_delete_kb_drops_its_vectors_and_entries_documents_stay(stack):
    """Deleting a KB drops its collection and index entries and takes it out of every
    document's membership; the documents stay, and stay searchable in other KBs."""
    rt, client = stack
    t = f"t-{uid()}"
    doomed = await create_kb(client, chunk_size=50, tag_ids=[t])
    kept = await create_kb(client, chunk_size=120, tag_ids=[t])
    up = await upload(client, "espresso.md", LONG_DOCS["espresso.md"], tags=[t])
    doc = up["document_id"]
    assert await vector_count(rt, doomed["kb_id"], doc) > 0

    r = await client.delete(f"/v1/kbs/{doomed['kb_id']}")
    assert r.status_code == 200 and r.json()["status"] == "deleted", r.text
    await settled(rt)
    assert (await client.get(f"/v1/kbs/{doomed['kb_id']}")).status_code == 404
    assert not await rt.store.collection_exists(f"kb_{doomed['kb_id']}")
    assert await rt.registries.index.list(f"{doomed['kb_id']}.") == []
    view = (await client.get(f"/v1/documents/{doc}")).json()
    assert view["kb_ids"] == [kept["kb_id"]] and view["status"] == "complete"
    r = await client.post(
        "/v1/search", json={"query": LONG_QUERIES["espresso.md"], "kb_ids": [kept["kb_id"]]}
    )
    assert r.json()["hits"][0]["document_id"] == doc
    # Across every KB of the org, the document's chunks now come from the kept KB only.
    r = await client.post(
        "/v1/search",
        json={
            "query": LONG_QUERIES["espresso.md"],
            "top_k": 50,
            "filters": {"document_ids": [doc]},
        },
    )
    hits = r.json()["hits"]
    assert hits and {h["kb_id"] for h in hits} == {kept["kb_id"]}
    r = await client.post("/v1/search", json={"query": "espresso", "kb_ids": [doomed["kb_id"]]})
    assert r.status_code == 404


async def test_concurrent_kb_updates_each_bump_the_settings_version(stack):
    """Concurrent PATCHes of one KB's chunk size are all applied in some order: the
    settings version counts every change (none overwrites another unseen), and the index
    converges to the chunking of the final settings."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=120, tag_ids=[t])
    up = await upload(client, "raft.md", LONG_DOCS["raft.md"], tags=[t])
    sizes = [50, 60, 70, 80, 90, 100]
    replies = await asyncio.gather(
        *(client.patch(f"/v1/kbs/{kb['kb_id']}", json={"chunk_size": size}) for size in sizes)
    )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert sorted(r.json()["settings_version"] for r in replies) == [
        kb["settings_version"] + i for i in range(1, len(sizes) + 1)
    ]
    final = (await client.get(f"/v1/kbs/{kb['kb_id']}")).json()
    assert final["settings_version"] == kb["settings_version"] + len(sizes)
    await settled(rt)
    entry = await rt.registries.index.get(f"{kb['kb_id']}.{up['document_id']}")
    assert entry.settings_version == final["settings_version"]
    assert await stored_chunks(rt, kb["kb_id"], up["document_id"]) == expected_chunks(
        rt, final, LONG_DOCS["raft.md"], "raft.md"
    )


async def test_a_kb_on_the_bundled_int8_model_indexes_and_searches(stack):
    """Every bundled model id is a valid KB model: a KB on the opt-in int8 model indexes a
    document with it and finds it by meaning."""
    _rt, client = stack
    kb = await create_kb(client, embedding_model="local/all-MiniLM-L6-v2-int8")
    assert kb["embedding_model"] == "local/all-MiniLM-L6-v2-int8"
    r = await client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
        json={"name": "tides.txt", "content": "The moon's gravity raises the ocean tides."},
    )
    assert r.status_code == 200 and r.json()["status"] == "complete", r.text
    r = await client.post(
        "/v1/search",
        json={"query": "why does the sea rise and fall", "kb_ids": [kb["kb_id"]], "mode": "dense"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["hits"][0]["document_name"] == "tides.txt"


async def test_defaults_are_published_and_a_kb_made_of_them_works(stack):
    """GET /v1/defaults gives the settings a KB gets when none are named, within the default
    model's input limit; a KB created with exactly those values is accepted, and one created
    with no settings at all gets the same ones."""
    _rt, client = stack
    r = await client.get("/v1/defaults")
    assert r.status_code == 200, r.text
    defaults = r.json()
    kb = defaults["kb"]
    model = next(m for m in defaults["models"] if m["embedding_model"] == kb["embedding_model"])
    assert kb["chunk_size"] == model["chunk_size"] <= model["max_chunk_size"]
    assert defaults["limits"]["chunk_size_min"] <= kb["chunk_size"]
    assert 0 <= kb["chunk_overlap"] < kb["chunk_size"]

    r = await client.post("/v1/kbs", json={"name": f"as-published-{uid()}", **kb})
    assert r.status_code == 201, r.text
    bare = await client.post("/v1/kbs", json={"name": f"bare-{uid()}"})
    assert bare.status_code == 201, bare.text
    for field, value in kb.items():
        assert bare.json()[field] == value, field

    # One token over the model's limit is refused, naming the field.
    over = {**kb, "chunk_size": model["max_chunk_size"] + 1}
    names_field(await client.post("/v1/kbs", json={"name": f"over-{uid()}", **over}), "chunk_size")
