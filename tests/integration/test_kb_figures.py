"""A KB's figures (view, stats, progress) and the document listings come from the gateway's
live view of the `documents` and `index` buckets: no request reads a bucket whole, and the
figures equal what the buckets hold across uploads, deletes, tag changes of a document and
of the KB, and a reindex; a second gateway on the same bus sees the first one's writes
within a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import pytest

from services.cli.runtime import build_runtime, gateway_app, start_consuming
from services.common.bus.registry import read_current
from services.common.domain.models import DocStatus, DocumentRecord, IndexEntry, KnowledgeBase
from services.common.settings import Settings
from tests.conftest import running_stack
from tests.support.bus import as_operator, credentials
from tests.support.domain import create_kb, settled, uid, upload, wait_until

# How long another gateway may take to see a write (its watch delivers in milliseconds).
SEEN_WITHIN = 10.0
BUCKETS = ("documents", "index")


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with running_stack(tmp_path_factory.mktemp("figures"), embedders=embedders) as s:
        yield s


@contextlib.asynccontextmanager
async def consumers_created(rt: Any) -> AsyncIterator[list[str]]:
    """The consumers JetStream creates on the `documents` and `index` buckets while the
    block runs (its advisories, heard as the operator): each whole-bucket read is one."""
    created: list[str] = []
    async with as_operator(rt) as nc:

        async def heard(msg: nats.aio.msg.Msg) -> None:
            created.append(msg.subject)

        subs = [
            await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.CREATED.KV_{b}.*", cb=heard)
            for b in BUCKETS
        ]
        await nc.flush()
        yield created
        # The advisories of the block's last request are on the wire: a round trip later
        # they have been heard.
        await nc.flush()
        await asyncio.sleep(0)
        for sub in subs:
            await sub.unsubscribe()


async def figures(client: httpx.AsyncClient, kb_id: str) -> dict[str, Any]:
    view = (await client.get(f"/v1/kbs/{kb_id}")).json()
    stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
    listing = (await client.get(f"/v1/kbs/{kb_id}/documents", params={"limit": 500})).json()
    return {
        "status": view["status"],
        "document_count": view["document_count"],
        "chunk_count": view["chunk_count"],
        "stats": stats,
        "listing": sorted(
            (d["document_id"], d["status"], d["chunk_count"]) for d in listing["items"]
        ),
        "listed": listing["total"],
    }


async def truth(rt: Any, kb_id: str) -> dict[str, Any]:
    """The same figures computed the slow way, from every record the buckets hold now."""
    reg = rt.registries
    kb = next(k for k in await reg.kbs.list(fresh=True) if k.kb_id == kb_id)
    raw_docs, raw_entries = await asyncio.gather(
        read_current(reg.documents.kv, f"{kb.org_id}.>"), read_current(reg.index.kv, f"{kb_id}.>")
    )
    docs = [DocumentRecord.model_validate_json(v) for v in raw_docs.values()]
    entries = {
        e.document_id: e for e in (IndexEntry.model_validate_json(v) for v in raw_entries.values())
    }
    members = [d for d in docs if kb.matches(d.tags)]
    return expected(kb, members, entries)


def expected(
    kb: KnowledgeBase, members: list[DocumentRecord], entries: dict[str, IndexEntry]
) -> dict[str, Any]:
    def failed(d: DocumentRecord) -> bool:
        return d.status == DocStatus.failed or kb.kb_id in d.kb_errors

    def listed_status(d: DocumentRecord) -> str:
        e = entries.get(d.document_id)
        if d.status != DocStatus.ready:
            return d.status.value
        if kb.kb_id in d.kb_errors:
            return "failed"
        if e is None or e.revision < d.revision:
            return "processing"
        return "complete" if e.settings_version == kb.settings_version else "pending_reindex"

    ready = [d for d in members if d.status == DocStatus.ready]
    current = {i for i, e in entries.items() if e.settings_version == kb.settings_version}
    indexed = sum(
        1
        for d in members
        if not failed(d)
        and (e := entries.get(d.document_id)) is not None
        and e.revision >= d.revision
    )
    n_failed = sum(1 for d in members if failed(d))
    rebuild = [d for d in ready if not failed(d)]
    status = kb.status.value
    if status == "pending_reindex" and all(
        e.settings_version == kb.settings_version for e in entries.values()
    ):
        status = "active"
    if status == "active" and len(entries) < len(ready):
        status = "indexing"
    return {
        "status": status,
        "document_count": len(entries),
        "chunk_count": sum(e.chunk_count for e in entries.values()),
        "stats": {
            "kb_id": kb.kb_id,
            "document_count": len(entries),
            "chunk_count": sum(e.chunk_count for e in entries.values()),
            "total_documents_with_tags": len(members),
            "failed_count": n_failed,
            "pending_count": sum(
                1 for d in ready if d.document_id not in current and kb.kb_id not in d.kb_errors
            ),
            "progress": {
                "total": len(members),
                "indexed": indexed,
                "pending": len(members) - indexed - n_failed,
                "failed": n_failed,
                "reindex": (
                    {
                        "settings_version": kb.settings_version,
                        "done": sum(1 for d in rebuild if d.document_id in current),
                        "total": len(rebuild),
                    }
                    if kb.status.value == "pending_reindex"
                    else None
                ),
            },
        },
        "listing": sorted(
            (
                d.document_id,
                listed_status(d),
                e.chunk_count if (e := entries.get(d.document_id)) else 0,
            )
            for d in members
        ),
        "listed": len(members),
    }


async def agree(rt: Any, client: httpx.AsyncClient, kb_id: str, step: str) -> None:
    """Once the bus is idle, the gateway's figures are the buckets' (within the moment its
    watch needs to deliver the last write)."""
    await settled(rt)
    want = await truth(rt, kb_id)

    async def same() -> bool:
        return await figures(client, kb_id) == want

    if not await _within(same, 5.0):
        assert await figures(client, kb_id) == want, step


async def _within(check: Any, timeout: float) -> bool:
    with contextlib.suppress(AssertionError):
        await wait_until(check, timeout=timeout, what="figures")
        return True
    return False


async def test_kb_views_stats_and_listings_read_no_bucket(stack):
    """GET of a KB, its stats, its documents, the documents listing (by KB, tag, source,
    name), the KB listing and a reindex request create no consumer on the `documents` or
    `index` bucket: they answer from the gateway's live view, whatever the KB's size. (A
    whole-bucket read made the same way is heard, so the probe hears them.)"""
    rt, client = stack
    kb = await create_kb(client)
    await upload(client, f"a-{uid()}.md", "The figures come from memory.", kb_id=kb["kb_id"])
    await settled(rt)
    async with consumers_created(rt) as control:
        await read_current(rt.registries.documents.kv, ">")
    assert control, "the probe must hear a whole-bucket read"

    async with consumers_created(rt) as created:
        for path, params in [
            (f"/v1/kbs/{kb['kb_id']}", {}),
            (f"/v1/kbs/{kb['kb_id']}/stats", {}),
            (f"/v1/kbs/{kb['kb_id']}/documents", {"status": "complete"}),
            ("/v1/kbs", {}),
            ("/v1/documents", {"kb": kb["kb_id"]}),
            ("/v1/documents", {"tag": "nothing", "name_search": "a-"}),
            ("/v1/documents", {"source_id": "user-provided"}),
        ]:
            r = await client.get(path, params=params)
            assert r.status_code == 200, r.text
        r = await client.post(f"/v1/kbs/{kb['kb_id']}/reindex")
        assert r.status_code == 202, r.text
    assert created == [], created
    await settled(rt)


async def test_replace_same_uri_finds_the_document_without_reading_the_bucket(stack):
    """`replace_same_uri` finds the document with the uri through the live view's uri index
    (no whole-bucket read), and replaces it rather than adding a second one. (Sent without
    `wait`: a wait watches the document's own key, which is no bucket read.)"""
    rt, client = stack
    kb = await create_kb(client)
    uri = f"https://example.test/{uid()}"
    first = await upload(client, "page.md", "First version.", kb_id=kb["kb_id"], uri=uri)
    async with consumers_created(rt) as created:
        r = await client.post(
            "/v1/documents",
            json={
                "name": "page.md",
                "content": "Second version.",
                "kb_id": kb["kb_id"],
                "uri": uri,
                "replace_same_uri": True,
            },
        )
    assert r.status_code == 202, r.text
    assert r.json()["document_id"] == first["document_id"]
    assert created == [], created
    await settled(rt)
    listing = (await client.get(f"/v1/kbs/{kb['kb_id']}/documents")).json()
    assert [d["document_id"] for d in listing["items"]] == [first["document_id"]]


async def test_figures_follow_uploads_deletes_tag_changes_and_reindex(stack):
    """After each change — uploads into the KB, a document tagged into it, the KB's tags
    widened to a label, a document's tag removed, a delete, a reindex (new settings
    version) — the KB's view, stats and listing equal the figures computed from the
    buckets themselves."""
    rt, client = stack
    label = f"label-{uid()}"
    kb = await create_kb(client)
    kb_id = kb["kb_id"]
    docs = [
        await upload(client, f"doc-{i}.md", f"Document {i} about figures.", kb_id=kb_id)
        for i in range(3)
    ]
    await agree(rt, client, kb_id, "uploads")

    outside = await upload(client, "outside.md", "Tagged in later.", tags=[label])
    await agree(rt, client, kb_id, "a document outside the KB")

    r = await client.patch(f"/v1/kbs/{kb_id}", json={"tag_ids": [label]})
    assert r.status_code == 200, r.text
    await agree(rt, client, kb_id, "the KB's tags widened")
    listed = {d[0] for d in (await figures(client, kb_id))["listing"]}
    assert outside["document_id"] in listed

    r = await client.patch(f"/v1/documents/{outside['document_id']}?wait=true", json={"tags": []})
    assert r.status_code == 200, r.text
    await agree(rt, client, kb_id, "a document's tag removed")

    r = await client.delete(f"/v1/documents/{docs[0]['document_id']}?wait=true")
    assert r.status_code == 200, r.text
    await agree(rt, client, kb_id, "a delete")

    r = await client.post(f"/v1/kbs/{kb_id}/reindex")
    assert r.status_code == 202, r.text
    await agree(rt, client, kb_id, "a reindex")
    view = (await client.get(f"/v1/kbs/{kb_id}")).json()
    assert view["settings_version"] == 2 and view["document_count"] == 2


@contextlib.asynccontextmanager
async def second_gateway(rt: Any, data_dir: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Another gateway process's worth: its own runtime, registries and live view, on the
    stack's bus as the gateway's NATS user."""
    creds = credentials(rt.settings.data_dir, "gateway")
    settings = Settings(
        data_dir=data_dir,
        nats_url=rt.bus.url,
        nats={"user": creds.user, "password": creds.password},
        default_org=rt.settings.default_org,
    )
    other = await build_runtime(settings, services=("gateway",))
    app = gateway_app(other)
    try:
        async with app.router.lifespan_context(app):
            await start_consuming(other)
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50001))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1", timeout=60
            ) as client:
                yield client
    finally:
        await other.close()


async def test_a_second_gateway_sees_the_first_ones_writes(stack, tmp_path):
    """Two gateways on one bus: what one uploads and deletes shows in the other's KB view,
    stats and listing within seconds, at once in the view of the one that waited for it,
    and both agree."""
    rt, client = stack
    async with second_gateway(rt, tmp_path) as other:
        kb = await create_kb(client)
        kb_id = kb["kb_id"]

        async def other_counts(n: int) -> bool:
            r = await other.get(f"/v1/kbs/{kb_id}")
            stats = (await other.get(f"/v1/kbs/{kb_id}/stats")).json()
            return (
                r.status_code == 200
                and r.json()["document_count"] == n
                and stats["total_documents_with_tags"] == n
            )

        made = await upload(client, "shared.md", "Seen by both gateways.", kb_id=kb_id)
        await wait_until(lambda: other_counts(1), timeout=SEEN_WITHIN, what="the upload")
        r = await other.delete(f"/v1/documents/{made['document_id']}?wait=true")
        assert r.status_code == 200, r.text
        # A wait answers once the deleting gateway's own view shows the delete.
        assert await other_counts(0)

        async def gone_here() -> bool:
            listing = (await client.get(f"/v1/kbs/{kb_id}/documents")).json()
            view = (await client.get(f"/v1/kbs/{kb_id}")).json()
            return listing["total"] == 0 and view["document_count"] == 0

        await wait_until(gone_here, timeout=SEEN_WITHIN, what="the delete")
        assert await figures(other, kb_id) == await figures(client, kb_id)


async def test_an_unreadable_value_does_not_stop_the_view(stack, tmp_path):
    """A value in the `documents` bucket that is no document record (written by hand, or by
    a broken publisher) is left out of a gateway's view, whether it is there when the
    gateway starts or comes while it runs, and the view goes on following the bucket: a
    document uploaded after it shows in another gateway's listing (which only its watch
    can tell it)."""
    rt, client = stack
    keys = [f"{rt.settings.default_org}.{uid()}{uid()}" for _ in range(2)]
    async with as_operator(rt) as nc:
        bucket = await nc.jetstream().key_value("documents")
        await bucket.put(keys[0], b"{not a record")
        try:
            async with second_gateway(rt, tmp_path) as other:
                await bucket.put(keys[1], b"[]")
                kb = await create_kb(client)
                made = await upload(client, "after.md", "After bad values.", kb_id=kb["kb_id"])

                async def listed() -> bool:
                    r = await other.get(f"/v1/kbs/{kb['kb_id']}/documents")
                    return [d["document_id"] for d in r.json()["items"]] == [made["document_id"]]

                await wait_until(listed, timeout=SEEN_WITHIN, what="the later upload listed")
        finally:
            for key in keys:
                await bucket.purge(key)
