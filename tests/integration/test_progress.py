"""Long work made visible: the KB's event stream reports a reindex of 30 documents as it
runs, to done = total; a second reindex is cancelled half-way, and searches keep answering
from the index they read all along."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import running_stack
from tests.support.domain import (
    create_kb,
    embed_count,
    settled,
    uid,
    vector_count,
    wait_until,
)
from tests.support.mcp_client import serve_http

TOPICS = ["glacier", "volcano", "espresso", "raft", "orchid", "comet"]


def document(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"# Note {i} about the {topic}\n\n"
        + f"Paragraph {i}: the {topic} is described at length, with its history, its "
        "behaviour and the people who study it. " * 6
    )


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    async with (
        # Few documents at a time, so a cancel lands while most of a rebuild is still
        # ahead (with the default 16 in flight, 30 one-chunk documents go in one batch).
        running_stack(
            tmp_path_factory.mktemp("progress"), embedders=embedders, embed_concurrency=2
        ) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        yield rt, client, base


@contextlib.asynccontextmanager
async def event_stream(base: str, kb_id: str) -> AsyncIterator[asyncio.Queue[tuple[str, Any]]]:
    """The KB's server-sent events over real HTTP, parsed into (event, data) pairs."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    opened = asyncio.Event()

    async def read() -> None:
        async with (
            httpx.AsyncClient(base_url=base, timeout=None) as http,
            http.stream("GET", f"/v1/kbs/{kb_id}/events") as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            opened.set()
            event = None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: ") and event:
                    queue.put_nowait((event, json.loads(line[len("data: ") :])))

    task = asyncio.create_task(read())
    try:
        await asyncio.wait_for(opened.wait(), 30)
        yield queue
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def next_progress(queue: asyncio.Queue[tuple[str, Any]], seen: list[tuple[str, Any]]):
    while True:
        event, data = await asyncio.wait_for(queue.get(), 60)
        seen.append((event, data))
        if event == "progress":
            return data


def indexed_documents(seen: list[tuple[str, Any]]) -> set[str]:
    return {d["document_id"] for e, d in seen if e == "document" and d["status"] == "indexed"}


async def test_reindex_progress_streams_to_done_and_cancel_keeps_the_old_index(stack):
    rt, client, base = stack
    kb = await create_kb(client, name=f"progress-{uid()}")
    kb_id = kb["kb_id"]
    for i in range(30):
        r = await client.post(
            f"/v1/kbs/{kb_id}/documents", json={"name": f"note-{i}.md", "content": document(i)}
        )
        assert r.status_code == 202, r.text
    await settled(rt)
    stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
    assert stats["progress"]["indexed"] == 30 and stats["progress"]["reindex"] is None

    # A reindex, watched from the stream: the first event is the current snapshot, then
    # progress rises to done = total, with per-document events along the way.
    seen: list[tuple[str, Any]] = []
    async with event_stream(base, kb_id) as events:
        first = await next_progress(events, seen)
        assert first["total"] == 30 and first["reindex"] is None
        r = await client.post(f"/v1/kbs/{kb_id}/reindex")
        assert r.status_code == 202, r.text
        version = kb["settings_version"] + 1
        dones = []
        while True:
            progress = await next_progress(events, seen)
            reindex = progress["reindex"]
            if reindex is None:
                continue
            assert reindex["settings_version"] == version and reindex["total"] == 30
            dones.append(reindex["done"])
            if reindex["done"] == reindex["total"]:
                break
        # Index entries are written before their doc.indexed goes out: the last document
        # events may follow the snapshot that counted them.
        while len(indexed_documents(seen)) < 30:
            seen.append(await asyncio.wait_for(events.get(), 60))
    assert len(dones) >= 2, f"no progress seen during the reindex: {dones}"
    assert dones == sorted(dones), dones
    await settled(rt)
    kb_record = await rt.registries.kbs.get(f"local.{kb_id}")
    assert kb_record.serving is None
    serving = kb_record.collection_name
    store = rt.embed.store
    chunks = await store.count(serving)
    query = {"query": "espresso history and behaviour", "kb_ids": [kb_id]}
    top = (await client.post("/v1/search", json=query)).json()["hits"][0]

    # A second reindex, cancelled once it is under way.
    before = embed_count(rt)
    async with event_stream(base, kb_id) as events:
        await next_progress(events, [])
        r = await client.post(f"/v1/kbs/{kb_id}/reindex")
        assert r.status_code == 202, r.text
        while True:
            reindex = (await next_progress(events, []))["reindex"]
            if reindex and reindex["settings_version"] == version + 1 and reindex["done"] > 0:
                break
        assert reindex["done"] < reindex["total"], "the reindex finished before the cancel"
        building = (await rt.registries.kbs.get(f"local.{kb_id}")).collection_name
        r = await client.post(f"/v1/kbs/{kb_id}/reindex/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        hits = (await client.post("/v1/search", json=query)).json()["hits"]
        assert hits and hits[0]["document_id"] == top["document_id"]
    await settled(rt)

    # Stopped: far fewer chunks embedded than a whole rebuild, the half-built collection
    # dropped, the KB back on its serving index with every chunk, answering as before.
    assert embed_count(rt) - before < chunks
    assert not await store.collection_exists(building)
    kb_record = await rt.registries.kbs.get(f"local.{kb_id}")
    assert kb_record.serving is None and kb_record.collection_name == serving
    assert kb_record.settings_version == version
    assert await store.count(serving) == chunks
    stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
    assert stats["progress"] == {
        "total": 30,
        "indexed": 30,
        "pending": 0,
        "failed": 0,
        "reindex": None,
    }
    assert stats["pending_count"] == 0
    hits = (await client.post("/v1/search", json=query)).json()["hits"]
    assert hits[0]["document_id"] == top["document_id"]
    assert hits[0]["content"] == top["content"]
    r = await client.post(f"/v1/kbs/{kb_id}/reindex/cancel")
    assert r.status_code == 409, r.text

    # Nothing more happens after the cancel: no embedding while the bus is quiet.
    quiet = embed_count(rt)
    await wait_until(lambda: _settled_twice(rt), what="a quiet bus")
    assert embed_count(rt) == quiet


async def _settled_twice(rt: Any) -> bool:
    await settled(rt)
    return True


async def test_cancel_keeps_changes_made_during_the_rebuild(stack):
    """Changes made while a rebuild runs reach the index searches read: a relabelled
    document is found by its new tag at once, and after the cancel, a document whose text
    changed meanwhile (built only into the abandoned collection) is indexed again into the
    serving one. Every index entry ends at the KB's settings with the serving chunk count."""
    rt, client, base = stack
    kb_id = (await create_kb(client, name=f"changes-{uid()}"))["kb_id"]
    ids = []
    for i in range(30):
        r = await client.post(
            f"/v1/kbs/{kb_id}/documents", json={"name": f"note-{i}.md", "content": document(i)}
        )
        ids.append(r.json()["document_id"])
    await settled(rt)
    changed, relabelled = ids[0], ids[1]
    async with event_stream(base, kb_id) as events:
        await next_progress(events, [])
        assert (await client.post(f"/v1/kbs/{kb_id}/reindex")).status_code == 202
        r = await client.post(
            f"/v1/kbs/{kb_id}/documents",
            json={
                "name": "note-0.md",
                "document_id": changed,
                "content": "Lighthouse keepers trimmed the lamp wicks every evening.",
            },
        )
        assert r.status_code == 202, r.text
        r = await client.patch(f"/v1/documents/{relabelled}", json={"tags": ["flagged"]})
        assert r.status_code == 200, r.text
        flagged = await client.post(
            "/v1/search",
            json={"query": "note", "kb_ids": [kb_id], "filters": {"tags": ["flagged"]}},
        )
        assert [h["document_id"] for h in flagged.json()["hits"]] == [relabelled]
        while True:
            reindex = (await next_progress(events, []))["reindex"]
            if reindex and reindex["done"] > 0:
                break
        assert reindex["done"] < reindex["total"], "the reindex finished before the cancel"
        r = await client.post(f"/v1/kbs/{kb_id}/reindex/cancel")
        assert r.status_code == 200, r.text
    await settled(rt)

    hits = (
        await client.post("/v1/search", json={"query": "lighthouse lamp wicks", "kb_ids": [kb_id]})
    ).json()["hits"]
    assert hits[0]["document_id"] == changed and "Lighthouse" in hits[0]["content"]
    kb = await rt.registries.kbs.get(f"local.{kb_id}")
    assert kb.serving is None
    store = rt.embed.store
    for document_id in ids:
        entry = await rt.registries.index.get(f"{kb_id}.{document_id}")
        record = await rt.registries.documents.get(f"local.{document_id}")
        assert entry.settings_version == kb.settings_version, document_id
        assert entry.checksum == record.checksum and entry.revision == record.revision
        assert entry.chunk_count == await vector_count(rt, kb_id, document_id)
    assert await store.count(kb.collection_name) == sum(
        [(await rt.registries.index.get(f"{kb_id}.{d}")).chunk_count for d in ids]
    )


async def test_open_streams_end_when_the_gateway_stops(stack):
    """An event stream never ends by itself, and the HTTP server waits for open responses
    before it stops: the gateway ends them first (last test: the stack stops)."""
    rt, client, base = stack
    kb = await create_kb(client, name=f"stopping-{uid()}")
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as http,
        http.stream("GET", f"/v1/kbs/{kb['kb_id']}/events") as response,
    ):
        lines = response.aiter_lines()
        assert await anext(lines) == "event: progress"
        rt.gateway.progress.close_streams()
        rest = [line async for line in lines]  # ends: the server closed the stream
    assert all(not line.startswith("event: ") for line in rest), rest
