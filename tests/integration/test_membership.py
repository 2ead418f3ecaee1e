"""Membership by tags, driven by events, against the real stack: one document in two KBs
with different chunking, re-tagging, KB retagging, out-of-order and duplicated events, and
redelivered uploads."""

from __future__ import annotations

import uuid

import pytest

from services.common.messages.events import DocUploaded, KbIndex, KbRemove, TagsChanged
from services.common.messages.names import Subject
from services.common.store import Filter, Match
from tests.conftest import running_stack
from tests.support.domain import (
    LONG_DOCS,
    LONG_QUERIES,
    create_kb,
    embed_count,
    expected_chunks,
    settled,
    stored_chunks,
    vector_count,
    wait_until,
)

ORG = "local"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(tmp_path_factory.mktemp("membership"), embedders=embedders) as s:
        yield s


def tag() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def search_ids(client, query: str, kb_id: str, **extra) -> list[str]:
    r = await client.post("/v1/search", json={"query": query, "kb_ids": [kb_id], **extra})
    assert r.status_code == 200, r.text
    return [h["document_id"] for h in r.json()["hits"]]


async def test_one_document_two_kbs_own_chunking_and_retag_removes_within_one_round_trip(stack):
    """A document tagged for two KBs (chunk_size 50 and 120) is indexed in each with that
    KB's own chunking: the stored chunks are exactly what the chunker produces for each
    KB's settings, so the counts differ. Re-tagging it away from one KB (PATCH, wait=true)
    has removed every vector there by the time the call returns, without re-embedding,
    and the document stays searchable in the other KB."""
    rt, client = stack
    t_small, t_large = tag(), tag()
    small = await create_kb(client, chunk_size=50, tag_ids=[t_small])
    large = await create_kb(client, chunk_size=120, tag_ids=[t_large])
    name, text = "glaciers.md", LONG_DOCS["glaciers.md"]

    r = await client.post(
        "/v1/documents?wait=true",
        json={
            "name": name,
            "content": text,
            "mime_type": "text/markdown",
            "tags": [t_small, t_large, "geo"],
        },
    )
    assert r.status_code == 200, r.text
    up = r.json()
    doc = up["document_id"]
    assert up["status"] == "complete"
    assert sorted(up["kb_ids"]) == sorted([small["kb_id"], large["kb_id"]])

    want_small = expected_chunks(rt, small, text, name)
    want_large = expected_chunks(rt, large, text, name)
    assert len(want_small) > len(want_large) >= 2
    assert await stored_chunks(rt, small["kb_id"], doc) == want_small
    assert await stored_chunks(rt, large["kb_id"], doc) == want_large
    assert up["chunk_count"] == len(want_small) + len(want_large)
    entry = await rt.registries.index.get(f"{small['kb_id']}.{doc}")
    assert entry is not None and entry.chunk_count == len(want_small)

    before = embed_count(rt)
    r = await client.patch(f"/v1/documents/{doc}?wait=true", json={"tags": [t_large, "geo"]})
    assert r.status_code == 200, r.text
    view = r.json()
    # Checked straight after the call returned: no polling.
    assert view["kb_ids"] == [large["kb_id"]]
    assert view["status"] == "complete"
    assert await vector_count(rt, small["kb_id"], doc) == 0
    assert await rt.registries.index.get(f"{small['kb_id']}.{doc}") is None
    assert await stored_chunks(rt, large["kb_id"], doc) == want_large
    assert embed_count(rt) == before, "a tag change must not re-embed"

    query = LONG_QUERIES[name]
    assert (await search_ids(client, query, large["kb_id"]))[0] == doc
    assert doc not in await search_ids(client, query, small["kb_id"])
    r = await client.get(f"/v1/kbs/{small['kb_id']}/documents")
    assert doc not in [d["document_id"] for d in r.json()["items"]]


async def test_kb_tag_changes_backfill_and_remove_every_time(stack):
    """Creating a KB backfills the documents its tag_ids match; changing its tag_ids removes
    the ones that no longer match and adds the new ones — also when the same document
    leaves, rejoins and leaves again at the same document revision."""
    rt, client = stack
    t_a, t_b = tag(), tag()
    docs = {}
    for t, name in ((t_a, "espresso.md"), (t_b, "raft.md")):
        r = await client.post(
            "/v1/documents?wait=true", json={"name": name, "content": LONG_DOCS[name], "tags": [t]}
        )
        assert r.json()["status"] == "stored", r.text  # no KB matches yet
        docs[t] = r.json()["document_id"]

    kb = await create_kb(client, chunk_size=120, tag_ids=[t_a])
    await settled(rt)
    assert await vector_count(rt, kb["kb_id"], docs[t_a]) > 0
    assert await vector_count(rt, kb["kb_id"], docs[t_b]) == 0

    for round_ in range(2):
        r = await client.patch(f"/v1/kbs/{kb['kb_id']}", json={"tag_ids": [t_b]})
        assert r.status_code == 200, r.text
        await settled(rt)
        assert await vector_count(rt, kb["kb_id"], docs[t_a]) == 0, round_
        assert await vector_count(rt, kb["kb_id"], docs[t_b]) > 0, round_
        record = await rt.registries.documents.get(f"{ORG}.{docs[t_a]}")
        assert kb["kb_id"] not in record.kb_ids

        r = await client.patch(f"/v1/kbs/{kb['kb_id']}", json={"tag_ids": [t_a]})
        assert r.status_code == 200, r.text
        await settled(rt)
        assert await vector_count(rt, kb["kb_id"], docs[t_a]) > 0, round_
        assert await vector_count(rt, kb["kb_id"], docs[t_b]) == 0, round_
        record = await rt.registries.documents.get(f"{ORG}.{docs[t_b]}")
        assert kb["kb_id"] not in record.kb_ids

    stats = (await client.get(f"/v1/kbs/{kb['kb_id']}/stats")).json()
    assert stats["document_count"] == 1 and stats["total_documents_with_tags"] == 1


async def test_out_of_order_and_duplicated_tags_changed_end_in_newest_revision(stack):
    """tags.changed events published straight to NATS, newest revision first, the older one
    last, each also duplicated (same event id, and a fresh event id): the document ends in
    the newest revision's tags, metadata and KB membership; stale kb.index / kb.remove
    published afterwards change nothing either."""
    rt, client = stack
    t_a, t_b, t_c = tag(), tag(), tag()
    kb_a = await create_kb(client, chunk_size=120, tag_ids=[t_a])
    kb_b = await create_kb(client, chunk_size=120, tag_ids=[t_b])
    kb_c = await create_kb(client, chunk_size=120, tag_ids=[t_c])
    r = await client.post(
        "/v1/documents?wait=true",
        json={"name": "raft.md", "content": LONG_DOCS["raft.md"], "tags": [t_a]},
    )
    doc = r.json()["document_id"]
    assert r.json()["kb_ids"] == [kb_a["kb_id"]]
    before = embed_count(rt)

    rev2 = TagsChanged(org_id=ORG, document_id=doc, tags=[t_b], metadata={"v": 2}, revision=2)
    rev3 = TagsChanged(
        org_id=ORG, document_id=doc, tags=[t_c, "collection:final"], metadata={"v": 3}, revision=3
    )
    for event in (
        rev3,
        rev2,
        rev3,
        rev2,
        rev3.model_copy(update={"event_id": uuid.uuid4().hex}),
        rev2.model_copy(update={"event_id": uuid.uuid4().hex}),
    ):
        await rt.bus.publish(Subject.TAGS_CHANGED, event)
    await settled(rt)

    record = await rt.registries.documents.get(f"{ORG}.{doc}")
    assert record.revision == 3
    assert record.tags == [t_c, "collection:final"]
    assert record.metadata == {"v": 3}
    assert record.kb_ids == [kb_c["kb_id"]]
    assert await vector_count(rt, kb_a["kb_id"], doc) == 0
    assert await vector_count(rt, kb_b["kb_id"], doc) == 0
    assert await rt.registries.index.get(f"{kb_b['kb_id']}.{doc}") is None
    entry = await rt.registries.index.get(f"{kb_c['kb_id']}.{doc}")
    assert entry is not None and entry.revision == 3
    chunks = await rt.store.scroll(f"kb_{kb_c['kb_id']}", Filter(), 100)
    assert chunks and all(
        h.payload["tags"] == [t_c]
        and h.payload["collection"] == "final"
        and h.payload["metadata"] == {"v": 3}
        and h.payload["revision"] == 3
        for h in chunks
    )

    # Stale work orders for revision 2, arriving late, are dropped by embed.
    await rt.bus.publish(
        Subject.KB_INDEX, KbIndex(org_id=ORG, kb_id=kb_b["kb_id"], document_id=doc, revision=2)
    )
    await rt.bus.publish(
        Subject.KB_REMOVE, KbRemove(org_id=ORG, kb_id=kb_c["kb_id"], document_id=doc, revision=2)
    )
    await settled(rt)
    assert await vector_count(rt, kb_b["kb_id"], doc) == 0
    assert await vector_count(rt, kb_c["kb_id"], doc) == entry.chunk_count
    # Moving between KBs of equal settings embeds once, in the KB gained.
    assert embed_count(rt) - before == entry.chunk_count

    r = await client.get(f"/v1/documents/{doc}")
    assert r.json()["collection"] == "final" and r.json()["tags"] == [t_c]


async def test_redelivered_upload_is_harmless_and_same_content_is_not_re_embedded(stack):
    """The same doc.uploaded published twice (same event id: JetStream drops the copy), and
    delivered again past the de-duplication window (another Nats-Msg-Id, same event id),
    is applied once. A new upload event with the same document id and content makes a new
    revision but embeds nothing: the text checksum and the KB settings are unchanged."""
    rt, client = stack
    t = tag()
    kb = await create_kb(client, chunk_size=50, tag_ids=[t])
    doc = f"doc-{uuid.uuid4().hex[:8]}"
    text = LONG_DOCS["espresso.md"]
    event = DocUploaded(
        org_id=ORG, document_id=doc, name="espresso.md", content=text, tags=[t], metadata={"n": 1}
    )
    before = embed_count(rt)
    await rt.bus.publish(Subject.DOC_UPLOADED, event)
    await rt.bus.publish(Subject.DOC_UPLOADED, event)
    await rt.bus.js.publish(
        Subject.DOC_UPLOADED,
        event.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"replay-{event.event_id}"},
    )
    await settled(rt)

    want = expected_chunks(rt, kb, text, "espresso.md")
    record = await rt.registries.documents.get(f"{ORG}.{doc}")
    assert record.revision == 1 and record.last_event_id == event.event_id
    entry = await rt.registries.index.get(f"{kb['kb_id']}.{doc}")
    assert entry.revision == 1 and entry.chunk_count == len(want)
    assert embed_count(rt) - before == len(want), "embedded exactly once"
    assert await stored_chunks(rt, kb["kb_id"], doc) == want

    again = event.model_copy(update={"event_id": uuid.uuid4().hex, "metadata": {"n": 2}})
    mid = embed_count(rt)
    await rt.bus.publish(Subject.DOC_UPLOADED, again)
    await wait_until(lambda: _entry_at(rt, kb["kb_id"], doc, 2), what="revision 2 indexed")
    await settled(rt)
    record = await rt.registries.documents.get(f"{ORG}.{doc}")
    assert record.revision == 2 and record.checksum == entry.checksum
    assert embed_count(rt) == mid, "unchanged text and settings must not be re-embedded"
    hits = await rt.store.scroll(f"kb_{kb['kb_id']}", Filter(), 100)
    assert {h.payload["metadata"]["n"] for h in hits} == {2}


async def _entry_at(rt, kb_id: str, doc: str, revision: int) -> bool:
    entry = await rt.registries.index.get(f"{kb_id}.{doc}")
    return entry is not None and entry.revision >= revision


async def test_upstream_tags_changed_without_implicit_tag_leaves_direct_kb(stack):
    """A direct upload into a KB is membership through the implicit tag `kb:<id>`; an
    upstream tags.changed carrying a full tag set without it takes the document out of that
    KB, and one carrying it again brings it back — all through the single tag rule."""
    rt, client = stack
    kb = await create_kb(client, chunk_size=120)
    r = await client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
        json={"name": "glaciers.md", "content": LONG_DOCS["glaciers.md"]},
    )
    doc = r.json()["document_id"]
    assert r.json()["kb_ids"] == [kb["kb_id"]]
    record = await rt.registries.documents.get(f"{ORG}.{doc}")
    assert f"kb:{kb['kb_id']}" in record.tags

    await rt.bus.publish(
        Subject.TAGS_CHANGED, TagsChanged(org_id=ORG, document_id=doc, tags=["other"])
    )
    await settled(rt)
    assert await vector_count(rt, kb["kb_id"], doc) == 0
    await rt.bus.publish(
        Subject.TAGS_CHANGED,
        TagsChanged(org_id=ORG, document_id=doc, tags=["other", f"kb:{kb['kb_id']}"]),
    )
    await settled(rt)
    assert await vector_count(rt, kb["kb_id"], doc) > 0
    r = await client.get(f"/v1/documents/{doc}")
    assert r.json()["kb_ids"] == [kb["kb_id"]] and r.json()["status"] == "complete"


async def test_concurrent_tag_and_kb_changes_lose_no_update(stack):
    """Ingest's consumers run side by side: document tag changes (tags.changed) interleaved
    with KB tag_ids changes that move the same document in and out of the KB. Every tag
    change survives (the revision counts all of them, the last tag set wins), and the
    document's membership and vectors agree with the KB's final tag_ids."""
    rt, client = stack
    t_in, t_out = tag(), tag()
    kb = await create_kb(client, chunk_size=120, tag_ids=[t_in])
    r = await client.post(
        "/v1/documents?wait=true",
        json={"name": "raft.md", "content": LONG_DOCS["raft.md"], "tags": [t_in, "v0"]},
    )
    doc = r.json()["document_id"]
    rounds = 12
    for i in range(1, rounds + 1):
        await rt.bus.publish(
            Subject.TAGS_CHANGED, TagsChanged(org_id=ORG, document_id=doc, tags=[t_in, f"v{i}"])
        )
        r = await client.patch(
            f"/v1/kbs/{kb['kb_id']}", json={"tag_ids": [t_out] if i % 2 else [t_in]}
        )
        assert r.status_code == 200, r.text
    await settled(rt)

    record = await rt.registries.documents.get(f"{ORG}.{doc}")
    assert record.tags == sorted([t_in, f"v{rounds}"])
    assert record.revision == 1 + rounds
    final = (await client.get(f"/v1/kbs/{kb['kb_id']}")).json()
    assert final["tag_ids"] == [t_in]
    assert record.kb_ids == [kb["kb_id"]]
    entry = await rt.registries.index.get(f"{kb['kb_id']}.{doc}")
    assert entry is not None and entry.revision == record.revision
    hits = await rt.store.scroll(
        f"kb_{kb['kb_id']}", Filter(must=(Match("document_id", doc),)), 100
    )
    assert hits and {tuple(h.payload["tags"]) for h in hits} == {tuple(record.tags)}
