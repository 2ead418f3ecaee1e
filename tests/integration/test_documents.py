"""Documents over REST and events against the real stack: label-only changes without
re-embedding, collections, deletion, bad input, OCR gating, formats and listing."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest

from services.common.messages.events import DocUploaded, OcrDone, TagsChanged
from services.common.messages.names import Subject
from tests.conftest import running_stack
from tests.support.domain import (
    LONG_DOCS,
    LONG_QUERIES,
    blank_pdf,
    create_kb,
    dead_letters,
    embed_count,
    expected_chunks,
    registry_counts,
    settled,
    stored_chunks,
    text_pdf,
    uid,
    upload,
    vector_count,
    wait_until,
)

ORG = "local"
MAX_BYTES = 100_000  # this module's upload limit (KBMESH_MAX_CONTENT_BYTES)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(
        tmp_path_factory.mktemp("documents"), embedders=embedders, max_content_bytes=MAX_BYTES
    ) as s:
        yield s


async def search(client, query: str, **body) -> list[dict]:
    r = await client.post("/v1/search", json={"query": query, "top_k": 20, **body})
    assert r.status_code == 200, r.text
    assert "collection:" not in r.text
    return r.json()["hits"]


async def test_tag_and_metadata_changes_embed_nothing_and_show_in_filters(stack):
    """Tag-only and metadata-only PATCHes call the embedder zero times (counted on the
    model), rewrite every point's payload, and are visible to search filters at once:
    tags (any-of), metadata equality and ranges. A text change does re-embed."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=50, tag_ids=[t])
    up = await upload(
        client,
        "raft.md",
        LONG_DOCS["raft.md"],
        tags=[t, "draft"],
        metadata={"team": "infra", "year": 2023},
    )
    doc = up["document_id"]
    query = LONG_QUERIES["raft.md"]
    in_kb = {"kb_ids": [kb["kb_id"]]}
    await search(client, query, **in_kb)  # caches the query vector: later searches embed nothing
    chunks = await vector_count(rt, kb["kb_id"], doc)
    base = embed_count(rt)

    r = await client.patch(
        f"/v1/documents/{doc}?wait=true", json={"metadata": {"team": "search", "year": 2024}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"team": "search", "year": 2024}
    assert r.json()["revision"] == 2 and r.json()["status"] == "complete"
    assert embed_count(rt) == base, "metadata-only change embedded"

    r = await client.patch(f"/v1/documents/{doc}?wait=true", json={"tags": [t, "final"]})
    assert r.status_code == 200, r.text
    assert sorted(r.json()["tags"]) == sorted([t, "final"])
    assert embed_count(rt) == base, "tag-only change embedded"
    assert await vector_count(rt, kb["kb_id"], doc) == chunks

    def ids(hits):
        return {h["document_id"] for h in hits}

    assert doc in ids(await search(client, query, **in_kb, filters={"tags": ["final"]}))
    assert doc not in ids(await search(client, query, **in_kb, filters={"tags": ["draft"]}))
    meta = {"metadata": [{"key": "team", "eq": "search"}]}
    assert doc in ids(await search(client, query, **in_kb, filters=meta))
    meta = {"metadata": [{"key": "team", "eq": "infra"}]}
    assert doc not in ids(await search(client, query, **in_kb, filters=meta))
    meta = {"metadata": [{"key": "year", "gte": 2024}]}
    assert doc in ids(await search(client, query, **in_kb, filters=meta))
    meta = {"metadata": [{"key": "year", "lt": 2024}]}
    assert doc not in ids(await search(client, query, **in_kb, filters=meta))
    hits = await search(client, query, **in_kb, filters={"document_ids": [doc]})
    assert len(hits) == chunks
    assert all(h["metadata"] == {"team": "search", "year": 2024} for h in hits)
    assert all(sorted(h["tags"]) == sorted([t, "final"]) for h in hits)
    assert embed_count(rt) == base

    # New text under the same id: a new revision that is re-chunked and re-embedded.
    text = LONG_DOCS["glaciers.md"]
    r = await client.post(
        "/v1/documents?wait=true",
        json={"name": "raft.md", "content": text, "document_id": doc, "tags": [t]},
    )
    assert r.json()["status"] == "complete" and r.json()["revision"] == 4, r.text
    want = expected_chunks(rt, kb, text, "raft.md")
    assert embed_count(rt) - base == len(want)
    assert await stored_chunks(rt, kb["kb_id"], doc) == want


async def test_collection_set_change_clear_at_most_one_never_prefixed(stack):
    """A collection is set on upload, changed and cleared with PATCH: the document holds
    at most one at any time (also when an upstream event sends two), and no document,
    listing or search response ever shows the `collection:` prefix."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=120, tag_ids=[t])
    in_kb = {"kb_ids": [kb["kb_id"]]}
    query = LONG_QUERIES["espresso.md"]
    up = await upload(
        client, "espresso.md", LONG_DOCS["espresso.md"], tags=[t, "coffee"], collection="alpha"
    )
    doc = up["document_id"]

    async def check(expected: str | None) -> None:
        record = await rt.registries.documents.get(f"{ORG}.{doc}")
        stored = [x for x in record.tags if x.startswith("collection:")]
        assert stored == ([f"collection:{expected}"] if expected else []), record.tags
        r = await client.get(f"/v1/documents/{doc}")
        assert "collection:" not in r.text
        assert r.json()["collection"] == expected
        assert sorted(r.json()["tags"]) == sorted([t, "coffee"])
        r = await client.get("/v1/documents", params={"kb": kb["kb_id"]})
        assert "collection:" not in r.text
        hits = await search(client, query, **in_kb, filters={"document_ids": [doc]})
        assert hits and all(h["collection"] == expected for h in hits)
        assert all(sorted(h["tags"]) == sorted([t, "coffee"]) for h in hits)
        if expected:
            hits = await search(client, query, **in_kb, filters={"collection": expected})
            assert doc in {h["document_id"] for h in hits}

    await check("alpha")
    base = embed_count(rt)
    r = await client.patch(f"/v1/documents/{doc}?wait=true", json={"collection": "beta"})
    assert r.status_code == 200 and "collection:" not in r.text, r.text
    await check("beta")
    assert doc not in {
        h["document_id"]
        for h in await search(client, query, **in_kb, filters={"collection": "alpha"})
    }
    r = await client.get("/v1/documents", params={"collection": "beta"})
    assert [d["document_id"] for d in r.json()["items"]] == [doc]

    r = await client.patch(f"/v1/documents/{doc}?wait=true", json={"clear_collection": True})
    assert r.status_code == 200, r.text
    await check(None)
    assert embed_count(rt) == base

    # A collection goes through `collection`, never as a prefixed tag.
    r = await client.patch(f"/v1/documents/{doc}", json={"tags": ["collection:gamma"]})
    assert r.status_code == 422 and r.json()["field"] == "tags", r.text
    r = await client.post(
        "/v1/documents", json={"name": "x", "content": "x", "tags": ["collection:gamma"]}
    )
    assert r.status_code == 422 and r.json()["field"] == "tags", r.text

    # Upstream publishers send stored tags; two collection tags still leave one.
    await rt.bus.publish(
        Subject.TAGS_CHANGED,
        TagsChanged(
            org_id=ORG, document_id=doc, tags=[t, "coffee", "collection:one", "collection:two"]
        ),
    )
    await settled(rt)
    record = await rt.registries.documents.get(f"{ORG}.{doc}")
    assert len([x for x in record.tags if x.startswith("collection:")]) == 1
    view = (await client.get(f"/v1/documents/{doc}")).json()
    assert view["collection"] in ("one", "two")
    await check(view["collection"])


async def test_delete_by_id_and_by_source_removes_every_vector(stack):
    """DELETE by id returns the id and title and, once it returns, the document has no
    vectors in any KB and no search returns it; DELETE ?source_id= does the same for every
    document of the source; an unknown id or source answers deleted_count 0."""
    rt, client = stack
    t1, t2 = f"t-{uid()}", f"t-{uid()}"
    kb1 = await create_kb(client, chunk_size=50, tag_ids=[t1])
    kb2 = await create_kb(client, chunk_size=120, tag_ids=[t2])
    source = f"repo-{uid()}"
    lone = await upload(client, "glaciers.md", LONG_DOCS["glaciers.md"], tags=[t1, t2])
    grouped = [
        await upload(client, name, LONG_DOCS[name], tags=[t1], source_id=source)
        for name in ("espresso.md", "raft.md")
    ]
    assert await vector_count(rt, kb1["kb_id"], lone["document_id"]) > 0
    assert await vector_count(rt, kb2["kb_id"], lone["document_id"]) > 0

    r = await client.delete(f"/v1/documents/{lone['document_id']}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["deleted_count"] == 1 and body["status"] == "deleted"
    assert body["document_id"] == lone["document_id"] and body["title"] == "glaciers.md"
    # No polling: the call returned after the index reflected it.
    for kb in (kb1, kb2):
        assert await vector_count(rt, kb["kb_id"], lone["document_id"]) == 0
        assert await rt.registries.index.get(f"{kb['kb_id']}.{lone['document_id']}") is None
    hits = await search(client, LONG_QUERIES["glaciers.md"])
    assert lone["document_id"] not in {h["document_id"] for h in hits}
    assert (await client.get(f"/v1/documents/{lone['document_id']}")).status_code == 404
    assert await rt.registries.texts.get(f"{ORG}/{lone['document_id']}/text") is None
    # The id is free again: uploading under it starts a new document at revision 1.
    again = await upload(
        client, "glaciers.md", LONG_DOCS["glaciers.md"], tags=[t2], document_id=lone["document_id"]
    )
    assert again["status"] == "complete" and again["revision"] == 1, again
    assert again["kb_ids"] == [kb2["kb_id"]]
    r = await client.delete(f"/v1/documents/{lone['document_id']}")
    assert r.json()["deleted_count"] == 1
    assert await vector_count(rt, kb2["kb_id"], lone["document_id"]) == 0

    r = await client.delete("/v1/documents", params={"source_id": source})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["deleted_count"] == 2
    assert sorted(body["document_ids"]) == sorted(d["document_id"] for d in grouped)
    for d in grouped:
        assert await vector_count(rt, kb1["kb_id"], d["document_id"]) == 0
        assert await rt.registries.documents.get(f"{ORG}.{d['document_id']}") is None
    r = await client.get("/v1/documents", params={"source_id": source})
    assert r.json()["total"] == 0

    r = await client.delete(f"/v1/documents/no-such-{uid()}")
    assert r.status_code == 200 and r.json()["deleted_count"] == 0, r.text
    r = await client.delete("/v1/documents", params={"source_id": f"nothing-{uid()}"})
    assert r.status_code == 200 and r.json()["deleted_count"] == 0, r.text
    await settled(rt)
    assert await vector_count(rt, kb1["kb_id"]) == 0 and await vector_count(rt, kb2["kb_id"]) == 0


async def test_bad_uploads_get_clear_4xx_and_change_nothing(stack):
    """Over-size (text and base64), invalid base64, an unsupported type, an unknown KB
    (by path and by body), a collection disguised as a tag, a bad document id and an
    empty name each get a 4xx problem naming the field; nothing is stored anywhere —
    KBs, documents, index entries, objects and vectors are counted before and after."""
    rt, client = stack
    kb = await create_kb(client, chunk_size=120, tag_ids=["bad-input"])
    await upload(client, "existing.md", LONG_DOCS["raft.md"], tags=["bad-input"])
    await settled(rt)
    before = await registry_counts(rt)
    big = "x" * (MAX_BYTES + 1)
    cases = [
        ("/v1/documents", {"content": big}, 413, "content"),
        (
            "/v1/documents",
            {"content": base64.b64encode(big.encode()).decode(), "content_encoding": "base64"},
            413,
            "content",
        ),
        ("/v1/documents", {"content": "not base64!", "content_encoding": "base64"}, 422, "content"),
        ("/v1/documents", {"content": "x", "mime_type": "audio/mpeg"}, 422, "mime_type"),
        ("/v1/documents", {"content": "x", "kb_id": "no-such-kb"}, 404, "kb_id"),
        ("/v1/kbs/no-such-kb/documents", {"content": "x"}, 404, "kb_id"),
        ("/v1/documents", {"content": "x", "tags": ["collection:x"]}, 422, "tags"),
        ("/v1/documents", {"content": "x", "document_id": "no/slashes"}, 422, "document_id"),
        ("/v1/documents", {"content": "x", "name": ""}, 422, "name"),
    ]
    for path, body, status, field in cases:
        r = await client.post(f"{path}?wait=true", json={"name": "bad.txt", **body})
        assert r.status_code == status, (body.get("mime_type"), field, r.text[:300])
        assert r.headers["content-type"].startswith("application/problem+json")
        problem = r.json()
        assert problem["detail"]
        assert field in {problem.get("field")} | {e["field"] for e in problem.get("errors", [])}
    r = await client.post(f"/v1/kbs/{kb['kb_id']}/documents", json={"name": "a", "content": big})
    assert r.status_code == 413, r.text
    assert f"{MAX_BYTES} bytes" in r.json()["detail"], r.text
    await settled(rt)
    assert await registry_counts(rt) == before


async def test_bad_upstream_events_are_dead_lettered_and_change_nothing(stack):
    """doc.uploaded events from an upstream publisher with invalid base64, over-size
    content, an unsupported type or an unknown KB go to the dead-letter subject with the
    reason; a bad re-upload of an existing document leaves that document as it was; nothing
    else changes."""
    rt, client = stack
    existing = await upload(client, "keep.md", LONG_DOCS["espresso.md"], tags=[f"t-{uid()}"])
    await settled(rt)
    before = await registry_counts(rt)
    kept = await rt.registries.documents.get(f"{ORG}.{existing['document_id']}")
    events = {
        "base64": DocUploaded(org_id=ORG, name="a", content="@@@", content_encoding="base64"),
        "size": DocUploaded(org_id=ORG, name="a", content="x" * (MAX_BYTES + 1)),
        "mime_type": DocUploaded(org_id=ORG, name="a", content="x", mime_type="audio/mpeg"),
        "kb": DocUploaded(org_id=ORG, name="a", content="x", kb_id="no-such-kb"),
        "reupload": DocUploaded(
            org_id=ORG,
            name="keep.md",
            content="@@@",
            content_encoding="base64",
            document_id=existing["document_id"],
        ),
    }
    for event in events.values():
        await rt.bus.publish(Subject.DOC_UPLOADED, event)
    await settled(rt)

    letters = await dead_letters(rt, Subject.DOC_UPLOADED)
    reasons = {k: letters[e.event_id]["Kbmesh-Error"] for k, e in events.items()}
    assert "base64" in reasons["base64"]
    assert "limit" in reasons["size"]
    assert "audio/mpeg" in reasons["mime_type"]
    assert "no-such-kb" in reasons["kb"]
    assert "base64" in reasons["reupload"]
    assert await registry_counts(rt) == before
    assert await rt.registries.documents.get(f"{ORG}.{existing['document_id']}") == kept


async def test_a_new_document_whose_upload_fails_reads_failed_until_uploaded_again(stack):
    """A new document's upload is accepted (202) and then fails: its content is no PDF.
    GET /v1/documents/{id} answers its record, `failed` with the reason, as do the KB's
    document list and stats; no text, vectors or index entries exist for it. Uploading it
    again under the same id with readable content indexes it, and the error is gone."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=50, tag_ids=[t])
    broken = base64.b64encode(b"%PDF-1.4 this is not really a pdf").decode()
    r = await client.post(
        f"/v1/kbs/{kb['kb_id']}/documents",
        json={
            "name": "report.pdf",
            "content": broken,
            "content_encoding": "base64",
            "mime_type": "application/pdf",
            "tags": [t],
            "source_id": "reports",
        },
    )
    assert r.status_code == 202, r.text
    document_id = r.json()["document_id"]

    async def failed_view() -> dict | None:
        r = await client.get(f"/v1/documents/{document_id}")
        return r.json() if r.status_code == 200 else None

    view = await wait_until(failed_view, timeout=60, what="the failed document's record")
    assert view["status"] == "failed" and "PDF" in view["error"], view
    assert (view["name"], view["source_id"], sorted(view["tags"])) == (
        "report.pdf",
        "reports",
        sorted([t, f"kb:{kb['kb_id']}"]),
    )
    assert view["kb_ids"] == [] and view["size_bytes"] == 0 and view["writer"]["kind"] == "local"
    listed = (await client.get(f"/v1/kbs/{kb['kb_id']}/documents")).json()["items"]
    assert [(d["document_id"], d["status"]) for d in listed] == [(document_id, "failed")]
    stats = (await client.get(f"/v1/kbs/{kb['kb_id']}/stats")).json()
    assert stats["failed_count"] == 1 and stats["document_count"] == 0
    assert await vector_count(rt, kb["kb_id"], document_id) == 0
    assert await rt.registries.texts.get(f"{ORG}/{document_id}/text") is None

    again = await upload(
        client, "report.md", LONG_DOCS["raft.md"], tags=[t], document_id=document_id
    )
    assert again["status"] == "complete" and again["document_id"] == document_id, again
    view = (await client.get(f"/v1/documents/{document_id}")).json()
    assert view["status"] == "complete" and view["error"] is None, view
    assert view["kb_ids"] == [kb["kb_id"]] and view["revision"] == 2
    assert await vector_count(rt, kb["kb_id"], document_id) > 0


async def test_scanned_pdf_waits_for_ocr_then_indexes_and_ocr_failure_marks_failed(stack):
    """A PDF without a text layer (and an image) is stored as awaiting_ocr with no vectors
    and no KB membership yet. ocr.done with text indexes it in its KBs and makes it
    searchable; a repeated ocr.done changes nothing; ocr.done from an object reference
    works too; ocr.done with ok=false marks the document failed with the reason and
    announces doc.failed."""
    rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=50, tag_ids=[t])
    pdf = base64.b64encode(blank_pdf()).decode()
    up = await upload(
        client, "scan.pdf", pdf, content_encoding="base64", mime_type="application/pdf", tags=[t]
    )
    doc = up["document_id"]
    assert up["status"] == "awaiting_ocr", up
    await settled(rt)
    view = (await client.get(f"/v1/documents/{doc}")).json()
    assert view["status"] == "awaiting_ocr" and view["kb_ids"] == []
    assert await vector_count(rt, kb["kb_id"], doc) == 0
    assert await rt.registries.index.get(f"{kb['kb_id']}.{doc}") is None

    text = LONG_DOCS["glaciers.md"]
    base = embed_count(rt)
    await rt.bus.publish(Subject.OCR_DONE, OcrDone(org_id=ORG, document_id=doc, text=text))
    await settled(rt)
    want = expected_chunks(rt, kb, text, "scan.pdf")
    assert await stored_chunks(rt, kb["kb_id"], doc) == want
    assert embed_count(rt) - base == len(want)
    view = (await client.get(f"/v1/documents/{doc}")).json()
    assert view["status"] == "complete" and view["kb_ids"] == [kb["kb_id"]]
    hits = await search(client, LONG_QUERIES["glaciers.md"], kb_ids=[kb["kb_id"]])
    assert hits[0]["document_id"] == doc

    await rt.bus.publish(Subject.OCR_DONE, OcrDone(org_id=ORG, document_id=doc, text="other"))
    await settled(rt)
    assert await stored_chunks(rt, kb["kb_id"], doc) == want

    # OCR text handed over through the object store.
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
    img = await upload(
        client, "photo.png", png, content_encoding="base64", mime_type="image/png", tags=[t]
    )
    assert img["status"] == "awaiting_ocr"
    ref = f"{ORG}/ocr/{uid()}"
    await rt.registries.texts.put(ref, LONG_DOCS["raft.md"].encode())
    await rt.bus.publish(
        Subject.OCR_DONE, OcrDone(org_id=ORG, document_id=img["document_id"], object_ref=ref)
    )
    await settled(rt)
    assert await vector_count(rt, kb["kb_id"], img["document_id"]) == len(
        expected_chunks(rt, kb, LONG_DOCS["raft.md"], "photo.png")
    )

    bad = await upload(
        client, "blurry.png", png, content_encoding="base64", mime_type="image/png", tags=[t]
    )
    failures = await rt.bus.nc.subscribe(Subject.DOC_FAILED)
    await rt.bus.publish(
        Subject.OCR_DONE,
        OcrDone(org_id=ORG, document_id=bad["document_id"], ok=False, error="page 1 is unreadable"),
    )
    msg = await failures.next_msg(timeout=20)
    await failures.unsubscribe()
    failed = json.loads(msg.data)
    assert failed["document_id"] == bad["document_id"] and failed["stage"] == "ocr"
    assert "page 1 is unreadable" in failed["error"]
    await settled(rt)
    view = (await client.get(f"/v1/documents/{bad['document_id']}")).json()
    assert view["status"] == "failed" and "page 1 is unreadable" in view["error"]
    assert await vector_count(rt, kb["kb_id"], bad["document_id"]) == 0


async def test_formats_extract_to_text_before_chunking(stack):
    """Markdown, HTML (scripts and styles dropped), a PDF with a text layer and DOCX are
    each extracted with their library and indexed straight away, without OCR."""
    rt, client = stack
    import docx

    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=120, tag_ids=[t])
    document = docx.Document()
    document.add_paragraph("Quarterly report on sea ice thickness in the Arctic basin.")
    out = io.BytesIO()
    document.save(out)
    cases = {
        "notes.md": (
            "# Notes\n\nSea ice *thickness* matters.",
            "text/markdown",
            "text",
            "Sea ice *thickness* matters.",
        ),
        "page.html": (
            "<html><head><style>p{}</style><script>var x=1;</script></head>"
            "<body><p>Sea ice melts in summer.</p></body></html>",
            "text/html",
            "text",
            "Sea ice melts in summer.",
        ),
        "paper.pdf": (
            base64.b64encode(text_pdf("Sea ice reflects sunlight")).decode(),
            "application/pdf",
            "base64",
            "Sea ice reflects sunlight",
        ),
        "report.docx": (
            base64.b64encode(out.getvalue()).decode(),
            "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
            "base64",
            "Quarterly report on sea ice thickness",
        ),
    }
    for name, (content, mime, encoding, expect) in cases.items():
        up = await upload(
            client, name, content, mime_type=mime, content_encoding=encoding, tags=[t]
        )
        assert up["status"] == "complete", (name, up)
        chunks = await stored_chunks(rt, kb["kb_id"], up["document_id"])
        joined = "\n".join(chunks)
        assert expect in joined, (name, joined)
        assert "var x" not in joined and "p{}" not in joined


async def test_list_documents_by_kb_tag_collection_source_and_name(stack):
    """GET /v1/documents filters by KB, tag, collection, source and name, and pages."""
    _rt, client = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, chunk_size=120, tag_ids=[t])
    source = f"src-{uid()}"
    a = await upload(client, f"alpha-{t}.md", "first", tags=[t, "red"], source_id=source)
    b = await upload(client, f"beta-{t}.md", "second", tags=[t], collection=f"c-{t}")
    c = await upload(client, f"gamma-{t}.md", "third", tags=["red"], source_id=source)

    async def listed(**params) -> list[str]:
        r = await client.get("/v1/documents", params={"limit": 500, **params})
        assert r.status_code == 200 and "collection:" not in r.text, r.text
        return [d["document_id"] for d in r.json()["items"]]

    assert await listed(kb=kb["kb_id"]) == [a["document_id"], b["document_id"]]
    assert set(await listed(tag="red")) >= {a["document_id"], c["document_id"]}
    assert await listed(collection=f"c-{t}") == [b["document_id"]]
    assert await listed(source_id=source) == [a["document_id"], c["document_id"]]
    assert await listed(name_search=f"GAMMA-{t}") == [c["document_id"]]
    r = await client.get("/v1/documents", params={"source_id": source, "limit": 1, "skip": 1})
    assert r.json()["total"] == 2 and [d["document_id"] for d in r.json()["items"]] == [
        c["document_id"]
    ]
    assert (await client.get("/v1/documents", params={"kb": "no-such-kb"})).status_code == 404


async def test_concurrent_patches_of_different_fields_all_apply(stack):
    """PATCHes of tags, collection and metadata sent at once, each computed from the same
    revision, are all applied (none is dropped as stale): the document ends with every
    change, and each call's response shows its own change."""
    rt, client = stack
    t = f"t-{uid()}"
    await create_kb(client, chunk_size=120, tag_ids=[t])
    up = await upload(client, "raft.md", LONG_DOCS["raft.md"], tags=[t], metadata={"n": 0})
    doc = up["document_id"]
    patches = [
        {"tags": [t, "reviewed"]},
        {"collection": "consensus"},
        {"metadata": {"n": 1, "owner": "db-team"}},
    ]
    replies = await asyncio.gather(
        *(client.patch(f"/v1/documents/{doc}?wait=true", json=body) for body in patches)
    )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    tags_reply, collection_reply, metadata_reply = (r.json() for r in replies)
    assert sorted(tags_reply["tags"]) == sorted([t, "reviewed"])
    assert collection_reply["collection"] == "consensus"
    assert metadata_reply["metadata"] == {"n": 1, "owner": "db-team"}
    await settled(rt)
    view = (await client.get(f"/v1/documents/{doc}")).json()
    assert sorted(view["tags"]) == sorted([t, "reviewed"])
    assert view["collection"] == "consensus"
    assert view["metadata"] == {"n": 1, "owner": "db-team"}
    assert view["revision"] == up["revision"] + len(patches)
    assert view["status"] == "complete"
