"""Tenancy against the real stack: API keys map to one org; with keys, no key is a 401; a
key for org A can neither see nor change anything of org B through any endpoint, nor
through events naming B's KBs; and the KB limit counts per org."""

from __future__ import annotations

import uuid

import pytest

from services.common.messages.events import DocUploaded, KbIndex, TagsChanged
from services.common.messages.names import Subject
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.domain import (
    LONG_DOCS,
    LONG_QUERIES,
    dead_letters,
    settled,
    vector_count,
)

KB_LIMIT = 4
A, B, C = "org-a", "org-b", "org-c"
SHARED_DOC = "same-id"  # both orgs use this document id
SHARED_SOURCE = "same-source"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(
        tmp_path_factory.mktemp("tenancy"), embedders=embedders, kb_limit=KB_LIMIT
    ) as s:
        yield s


@pytest.fixture(scope="module")
async def world(stack):
    """Keys for orgs A, B and C, created while the gateway runs (after it has served a
    keyless request), and in A and B the same layout: the `default` KB and a tagged KB,
    the same document id and source in both, and documents of their own."""
    rt, client = stack
    keyless_before = (await client.get("/v1/kbs")).status_code
    resolver = OperatorKeys(rt)
    keys = {org: await resolver.create(org, name=f"{org} tests") for org in (A, B, C)}
    keyless_after = (await client.get("/v1/kbs")).status_code
    w = {"keys": keys, "keyless": (keyless_before, keyless_after)}
    content = {
        A: ("glaciers.md", LONG_DOCS["glaciers.md"]),
        B: ("espresso.md", LONG_DOCS["espresso.md"]),
    }
    for org in (A, B):
        h = auth(keys[org])
        r = await client.post(
            "/v1/kbs",
            headers=h,
            json={"name": f"{org}-tagged", "chunk_size": 50, "tag_ids": ["team"]},
        )
        assert r.status_code == 201, r.text
        w[org, "kb"] = r.json()["kb_id"]
        name, text = content[org]
        r = await client.post(
            "/v1/kbs/default/documents?wait=true",
            headers=h,
            json={
                "name": name,
                "content": text,
                "document_id": SHARED_DOC,
                "tags": ["team"],
                "source_id": SHARED_SOURCE,
            },
        )
        assert r.json()["status"] == "complete", r.text
        w[org, "default"] = (await client.get("/v1/kbs/default", headers=h)).json()["kb_id"]
        r = await client.post(
            "/v1/documents?wait=true",
            headers=h,
            json={
                "name": f"{org}-own.md",
                "content": LONG_DOCS["raft.md"],
                "tags": ["team"],
                "document_id": f"{org}-own",
            },
        )
        assert r.json()["status"] == "complete", r.text
        hits = (
            await client.post(
                "/v1/search",
                headers=h,
                json={"query": LONG_QUERIES[name], "kb_ids": [w[org, "kb"]]},
            )
        ).json()["hits"]
        w[org, "chunk"] = hits[0]["chunk_id"]
    await settled(rt)
    return w


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def snapshot(rt, org: str, kb_ids: list[str]) -> dict:
    """Everything of `org` that a request could change: KB definitions, document records,
    index entries and vector counts."""
    reg = rt.registries
    kbs = sorted([k.model_dump_json() for k in await reg.kbs.list(f"{org}.")])
    docs = sorted([d.model_dump_json() for d in await reg.documents.list(f"{org}.")])
    entries = []
    for kb in kb_ids:
        entries += [
            e.model_dump_json(exclude={"indexed_at"})
            for e in await reg.index.list(f"{kb}.")
            if e.org_id == org
        ]
    entries.sort()
    vectors = {kb: await vector_count(rt, kb) for kb in kb_ids}
    return {"kbs": kbs, "documents": docs, "index": entries, "vectors": vectors}


async def test_keys_are_required_once_any_exists(stack, world):
    """Before any key exists the (loopback) caller is served; once a key exists — even one
    created after the gateway answered a keyless request — a request without a key, with
    an unknown key or with another scheme is a 401."""
    _rt, client = stack
    assert world["keyless"] == (200, 401)
    for headers in ({}, auth("kbm_not-a-key"), {"Authorization": f"Basic {world['keys'][A]}"}):
        r = await client.get("/v1/kbs", headers=headers)
        assert r.status_code == 401, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
    assert (await client.get("/v1/kbs", headers=auth(world["keys"][A]))).status_code == 200


async def test_same_document_id_in_two_orgs_stays_two_documents(stack, world):
    """Both orgs uploaded document `same-id` into their `default` KB: each org's default KB
    is its own (own id, own vectors), each sees only its own text, and each org's stats
    count only its own documents."""
    rt, client = stack
    assert world[A, "default"] != world[B, "default"]
    for org, name in ((A, "glaciers.md"), (B, "espresso.md")):
        h = auth(world["keys"][org])
        view = (await client.get(f"/v1/documents/{SHARED_DOC}", headers=h)).json()
        assert view["name"] == name
        hits = (
            await client.post(
                "/v1/search",
                headers=h,
                json={"query": LONG_QUERIES[name], "kb_ids": ["default"], "top_k": 20},
            )
        ).json()["hits"]
        assert hits and {h["document_id"] for h in hits} == {SHARED_DOC}
        assert all(h["content"] in LONG_DOCS[name] for h in hits)
        assert await vector_count(rt, world[org, "default"], SHARED_DOC) == len(
            {h["chunk_id"] for h in hits}
        )
        stats = (await client.get("/v1/kbs/default/stats", headers=h)).json()
        assert stats["document_count"] == 1 and stats["total_documents_with_tags"] == 1


async def test_org_a_sees_nothing_of_org_b(stack, world):
    """With A's key: B's KBs (by id and by name), their stats and documents, B's documents
    and chunks are 404s; listings and searches across A's KBs return nothing of B's."""
    _rt, client = stack
    h = auth(world["keys"][A])
    b_kb, b_default = world[B, "kb"], world[B, "default"]
    for path in (
        f"/v1/kbs/{b_kb}",
        f"/v1/kbs/{B}-tagged",
        f"/v1/kbs/{b_kb}/stats",
        f"/v1/kbs/{b_kb}/documents",
        f"/v1/kbs/{b_default}",
        f"/v1/documents/{B}-own",
        f"/v1/documents?kb={b_kb}",
        f"/v1/chunks/{world[B, 'chunk']}",
        f"/v1/chunks/{world[B, 'chunk']}?kb={b_kb}",
    ):
        r = await client.get(path, headers=h)
        assert r.status_code == 404, (path, r.text)

    kbs = (await client.get("/v1/kbs", headers=h, params={"limit": 200})).json()
    assert {k["kb_id"] for k in kbs["items"]} == {world[A, "kb"], world[A, "default"]}
    docs = (await client.get("/v1/documents", headers=h, params={"limit": 500})).json()
    assert {d["document_id"] for d in docs["items"]} == {SHARED_DOC, f"{A}-own"}
    assert (await client.get(f"/v1/documents/{SHARED_DOC}", headers=h)).json()["name"] == (
        "glaciers.md"
    )
    r = await client.get("/v1/documents", headers=h, params={"source_id": SHARED_SOURCE})
    assert r.json()["total"] == 1

    for body in ({"kb_ids": [b_kb]}, {"kb_ids": [f"{B}-tagged"]}, {"kb_ids": [b_default]}):
        r = await client.post("/v1/search", headers=h, json={"query": "espresso", **body})
        assert r.status_code == 404, (body, r.text)
    r = await client.post(
        "/v1/search", headers=h, json={"query": LONG_QUERIES["espresso.md"], "top_k": 50}
    )
    hits = r.json()["hits"]
    assert set(r.json()["kb_ids"]) == {world[A, "kb"], world[A, "default"]}
    assert all("espresso" not in hit["content"].lower() for hit in hits)
    r = await client.post(
        "/v1/search",
        headers=h,
        json={"query": "espresso", "top_k": 50, "filters": {"document_ids": [f"{B}-own"]}},
    )
    assert r.json()["hits"] == []


async def test_kb_limit_counts_per_org(stack, world):
    """Org C may create KB_LIMIT knowledge bases and the next is a 409 naming the limit;
    other orgs are not affected by C's count."""
    _rt, client = stack
    hc = auth(world["keys"][C])
    for i in range(KB_LIMIT):
        r = await client.post("/v1/kbs", headers=hc, json={"name": f"c-{i}"})
        assert r.status_code == 201, r.text
    r = await client.post("/v1/kbs", headers=hc, json={"name": "one-too-many"})
    assert r.status_code == 409, r.text
    assert str(KB_LIMIT) in r.json()["detail"] and "KBMESH_KB_LIMIT" in r.json()["detail"]
    assert (await client.get("/v1/kbs", headers=hc)).json()["total"] == KB_LIMIT
    r = await client.post(
        "/v1/kbs", headers=auth(world["keys"][B]), json={"name": f"b-extra-{uuid.uuid4().hex[:6]}"}
    )
    assert r.status_code == 201, r.text


async def test_org_a_changes_nothing_of_org_b(stack, world):
    """With A's key, every write aimed at B — KB update, delete, reindex, retry, uploads
    into B's KBs, document patch and delete, delete by B's source, reusing B's document id
    — is a 404 or touches only A's own data; events naming B's KB from A's org are
    dead-lettered or dropped. B's registry records, index entries and vectors are
    unchanged afterwards. (Last in the module: it deletes A's default KB and document.)"""
    rt, client = stack
    h = auth(world["keys"][A])
    b_kb, b_default = world[B, "kb"], world[B, "default"]
    before = await snapshot(rt, B, [b_kb, b_default])
    writes = [
        ("PATCH", f"/v1/kbs/{b_kb}", {"chunk_size": 120}),
        ("DELETE", f"/v1/kbs/{b_kb}", None),
        ("DELETE", f"/v1/kbs/{B}-tagged", None),
        ("POST", f"/v1/kbs/{b_kb}/reindex", None),
        ("POST", f"/v1/kbs/{b_kb}/retry-failed", None),
        ("POST", f"/v1/kbs/{b_kb}/documents", {"name": "x.md", "content": "intruder"}),
        ("POST", "/v1/documents", {"name": "x.md", "content": "intruder", "kb_id": b_kb}),
        ("PATCH", f"/v1/documents/{B}-own", {"tags": ["hijacked"]}),
    ]
    for method, path, body in writes:
        r = await client.request(method, path, headers=h, json=body)
        assert r.status_code == 404, (method, path, r.text)
    # Unknown ids delete nothing (deleted_count 0), so B's ids are no different.
    r = await client.delete(f"/v1/documents/{B}-own", headers=h)
    assert r.status_code == 200 and r.json()["deleted_count"] == 0, r.text
    # A's own document of the same id and source, and A's own default KB, go; B's stay.
    r = await client.delete("/v1/documents", headers=h, params={"source_id": SHARED_SOURCE})
    assert r.json()["deleted_count"] == 1 and r.json()["document_ids"] == [SHARED_DOC]
    r = await client.delete("/v1/kbs/default", headers=h)
    assert r.status_code == 200, r.text
    r = await client.post(
        "/v1/documents?wait=true",
        headers=h,
        json={"name": "mine.md", "content": "A's document under B's id", "document_id": f"{B}-own"},
    )
    assert r.status_code == 200, r.text

    # Upstream events from A's org that name B's KB.
    upload = DocUploaded(org_id=A, name="x.md", content="intruder", kb_id=b_kb)
    await rt.bus.publish(Subject.DOC_UPLOADED, upload)
    await rt.bus.publish(
        Subject.TAGS_CHANGED,
        TagsChanged(org_id=A, document_id=f"{A}-own", tags=["team", f"kb:{b_kb}"]),
    )
    await rt.bus.publish(
        Subject.KB_INDEX, KbIndex(org_id=A, kb_id=b_kb, document_id=f"{A}-own", revision=99)
    )
    await settled(rt)
    assert upload.event_id in await dead_letters(rt, Subject.DOC_UPLOADED)
    assert await vector_count(rt, b_kb, f"{A}-own") == 0

    assert await snapshot(rt, B, [b_kb, b_default]) == before
    hb = auth(world["keys"][B])
    view = (await client.get(f"/v1/documents/{B}-own", headers=hb)).json()
    assert view["tags"] == ["team"] and view["status"] == "complete"
    hits = (
        await client.post(
            "/v1/search",
            headers=hb,
            json={"query": LONG_QUERIES["espresso.md"], "kb_ids": ["default"]},
        )
    ).json()["hits"]
    assert hits and hits[0]["document_id"] == SHARED_DOC
