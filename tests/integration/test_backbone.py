"""The backbone end to end in one process: REST upload → NATS → ingest → embed → Qdrant
Edge → search, with the real nats-server, engine and model."""

from __future__ import annotations

import json

import nats
import pytest

from tests.conftest import running_stack
from tests.support.bus import bus_url, nats_with_max_payload
from tests.support.corpus import DOCS, PARAPHRASES


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(tmp_path_factory.mktemp("stack"), embedders=embedders) as s:
        yield s


async def upload_corpus(client, kb: str = "default") -> dict[str, str]:
    ids = {}
    for name, text in DOCS.items():
        r = await client.post(
            f"/v1/kbs/{kb}/documents?wait=true",
            json={"name": name, "content": text, "mime_type": "text/markdown"},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "complete" and body["chunk_count"] >= 1, body
        ids[name] = body["document_id"]
    return ids


async def test_upload_then_paraphrase_search_returns_the_document_first(stack):
    """Three uploads with wait=true index for real; each paraphrase finds its document
    first, with content and a score."""
    _rt, client = stack
    ids = await upload_corpus(client)
    for name, query in PARAPHRASES.items():
        r = await client.post("/v1/search", json={"query": query, "kb_ids": ["default"]})
        assert r.status_code == 200, r.text
        hits = r.json()["hits"]
        assert hits[0]["document_id"] == ids[name], (query, hits)
        assert hits[0]["content"] and hits[0]["score"] is not None
        assert hits[0]["document_name"] == name


async def test_malformed_event_is_dead_lettered_and_consumer_keeps_going(stack):
    """A malformed doc.uploaded goes to dlq.~.doc.uploaded (no org can be read from it) with
    a reason; the next valid upload still indexes."""
    rt, client = stack
    # Watched as the operator (services may not open readers of the dead-letter stream).
    operator = await nats.connect(bus_url(rt.bus.url, rt.settings.data_dir, "operator"))
    try:
        js = operator.jetstream()
        sub = await js.subscribe("dlq.~.doc.uploaded", stream="KBMESH_DLQ", durable=None)
        await js.publish("doc.uploaded", b'{"org_id": "local", "name": 42', stream="KBMESH")
        msg = await sub.next_msg(timeout=20)
        assert msg.headers["Kbmesh-Error-Type"] == "ValidationError"
        assert "malformed event" in msg.headers["Kbmesh-Error"]
        assert msg.data == b'{"org_id": "local", "name": 42'
        await sub.unsubscribe()
    finally:
        await operator.close()
    r = await client.post(
        "/v1/kbs/default/documents?wait=true",
        json={"name": "after-dlq.txt", "content": "still indexing fine"},
    )
    assert r.json()["status"] == "complete"


async def test_bad_upload_is_rejected_and_changes_nothing(stack):
    """Invalid base64, oversize, unsupported type and unknown KB get 4xx problems."""
    rt, client = stack
    before = len(await rt.registries.documents.list())
    cases = [
        (
            "/v1/kbs/default/documents",
            {"name": "a", "content": "!!!", "content_encoding": "base64"},
            422,
        ),
        (
            "/v1/kbs/default/documents",
            {"name": "a", "content": "x", "mime_type": "audio/mpeg"},
            422,
        ),
        ("/v1/kbs/nope/documents", {"name": "a", "content": "x"}, 404),
        ("/v1/kbs/default/documents", {"name": "a", "content": "x" * (10 * 1024 * 1024 + 1)}, 413),
    ]
    for path, body, status in cases:
        r = await client.post(path, json=body)
        assert r.status_code == status, (body.get("mime_type"), r.text[:300])
        assert r.headers["content-type"].startswith("application/problem+json")
        assert json.loads(r.text)["detail"]
    assert len(await rt.registries.documents.list()) == before


async def test_large_upload_travels_via_object_store_and_staging_is_cleaned(tmp_path, embedders):
    """Content too large to travel inside its event is staged in the object store, indexed
    from there, and the staging copy is deleted once ingest has stored the original. Too
    large is a quarter of the bus's message limit where that is small: here 200 kB, under
    kbmesh's own inline size but over the whole message limit of this NATS server."""
    text = "Glaciers carve valleys as they slide downhill. " * 4300  # ~200 kB
    with nats_with_max_payload(tmp_path, 160 * 1024) as url:
        async with running_stack(tmp_path / "data", nats_url=url, embedders=embedders) as (
            rt,
            client,
        ):
            r = await client.post(
                "/v1/kbs/default/documents?wait=true",
                json={"name": "glaciers.txt", "content": text},
            )
            body = r.json()
            assert body["status"] == "complete" and body["chunk_count"] >= 1, body
            staged = [o async for o in _object_names(rt) if o.startswith("uploads/")]
            assert staged == []
            original = await rt.registries.texts.get(f"local/{body['document_id']}/original")
            assert original == text.encode()


async def _object_names(rt):
    for info in await rt.registries.texts.store.list(ignore_deletes=True):
        yield info.name
