"""A rebuild's phases as clients see them: the KB reports a reindex until searches read the
new collection, a settings change in that last phase rebuilds again without losing a
document, and a cancel returns the KB to exactly the index it served, even while a
document of the cancelled rebuild is still being embedded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from services.common.store import Match
from services.common.store.base import Filter
from tests.conftest import running_stack
from tests.support.domain import create_kb, settled, uid, wait_until
from tests.support.openai_embeddings import OpenAIEmbeddingsServer

REMOTE = "openai/test-embed"
WORDS = ["glacier", "volcano", "espresso", "orchid", "comet", "lantern"]


def document(i: int) -> str:
    """About 150 tokens, with a word no other document has: one chunk at chunk_size 200,
    several at 50."""
    word = WORDS[i % len(WORDS)]
    return (
        f"# The {word} {i}\n\n"
        + (
            f"Paragraph {i}: the {word} is described at length, with its history, its behaviour "
            "and the people who study it over many patient years. "
        )
        * 5
    )


async def kb_record(rt: Any, kb_id: str) -> Any:
    return await rt.registries.kbs.get(f"local.{kb_id}")


async def upload_all(client: Any, kb_id: str, count: int) -> list[str]:
    ids = []
    for i in range(count):
        r = await client.post(
            f"/v1/kbs/{kb_id}/documents?wait=true",
            json={"name": f"note-{i}.md", "content": document(i)},
        )
        assert r.json()["status"] == "complete", r.text
        ids.append(r.json()["document_id"])
    return ids


async def switched(rt: Any, kb_id: str) -> bool:
    kb = await kb_record(rt, kb_id)
    return kb is not None and kb.serving is None


async def assert_every_document_served(rt: Any, client: Any, kb_id: str, ids: list[str]) -> None:
    """Each document is in the collection searches read, with as many points as its index
    entry says, and the KB's chunk count is that collection's."""
    kb = await kb_record(rt, kb_id)
    assert kb.serving is None
    total = 0
    for document_id in ids:
        entry = await rt.registries.index.get(f"{kb_id}.{document_id}")
        points = await rt.store.count(
            kb.collection_name, Filter(must=(Match("document_id", document_id),))
        )
        assert entry is not None and entry.settings_version == kb.settings_version
        assert points == entry.chunk_count > 0, (document_id, points, entry)
        total += points
    assert await rt.store.count(kb.collection_name) == total
    stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
    assert stats["chunk_count"] == total, stats


async def test_status_is_reindexing_until_searches_switch_and_a_late_change_rebuilds_again(
    tmp_path, embedders, monkeypatch: pytest.MonkeyPatch
):
    """Between the last document's new index entry and the switch of searches to the new
    collection, `GET /v1/kbs/{kb}` still says `pending_reindex` (never `active` while searches
    read the old collection). A settings change made in that window supersedes the finished
    build: searches stay on the collection they read, the finished one is dropped, every
    document is built again with the newest settings, and searches answer throughout."""
    # A longer pause between completion checks, so the last phase is long enough to act in.
    monkeypatch.setattr("services.embed.service.SWITCH_CHECK_SECONDS", 4.0)
    async with running_stack(tmp_path, embedders=embedders, embed_concurrency=1) as (rt, client):
        kb_id = (await create_kb(client, name=f"phases-{uid()}", chunk_size=200))["kb_id"]
        ids = await upload_all(client, kb_id, 8)
        first = await kb_record(rt, kb_id)

        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 50})
        assert r.status_code == 200 and r.json()["status"] == "pending_reindex", r.text
        built = (await kb_record(rt, kb_id)).collection_name

        async def last_phase() -> bool:
            """Every index entry written at the new settings, searches not yet switched."""
            kb = await kb_record(rt, kb_id)
            entries = await rt.registries.index.list(f"{kb_id}.", fresh=True)
            current = [e for e in entries if e.settings_version == kb.settings_version]
            status = (await client.get(f"/v1/kbs/{kb_id}")).json()["status"]
            still_serving = (await kb_record(rt, kb_id)).serving is not None
            assert not (still_serving and status == "active"), "active before the switch"
            search = await client.post(
                "/v1/search", json={"query": "volcano history", "kb_ids": [kb_id]}
            )
            assert search.status_code == 200 and search.json()["hits"], search.text
            return len(current) == len(ids) and still_serving

        await wait_until(last_phase, timeout=120, interval=0.02, what="the rebuild's last phase")

        # The newer change, before searches moved to the finished build.
        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 80})
        assert r.status_code == 200 and r.json()["status"] == "pending_reindex", r.text
        newest = await kb_record(rt, kb_id)
        assert newest.serving is not None and newest.serving.generation == first.index_generation
        assert newest.collection_name != built

        async def done() -> bool:
            await last_phase()  # the status stays truthful, searches answer
            return await switched(rt, kb_id)

        await wait_until(done, timeout=120, interval=0.05, what="the switch to the newest build")
        await settled(rt)
        kb = await kb_record(rt, kb_id)
        assert kb.chunk_size == 80 and kb.collection_name == newest.collection_name
        assert (await client.get(f"/v1/kbs/{kb_id}")).json()["status"] == "active"
        assert not await rt.store.collection_exists(built)
        assert not await rt.store.collection_exists(first.collection_name)
        await assert_every_document_served(rt, client, kb_id, ids)
        for i, document_id in enumerate(ids):
            hits = (
                await client.post(
                    "/v1/search",
                    json={"query": f"the {WORDS[i % len(WORDS)]} {i}", "kb_ids": [kb_id]},
                )
            ).json()["hits"]
            assert document_id in {h["document_id"] for h in hits}, i


async def test_a_cancel_answers_with_the_served_index_counted(tmp_path, embedders):
    """When `POST .../reindex/cancel` answers, the KB's counts are already those of the
    collection searches read, though documents had been rebuilt with other chunking."""
    async with running_stack(tmp_path, embedders=embedders, embed_concurrency=1) as (rt, client):
        kb_id = (await create_kb(client, name=f"counted-{uid()}", chunk_size=200))["kb_id"]
        ids = await upload_all(client, kb_id, 12)
        before = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 50})
        assert r.status_code == 200, r.text

        async def some_rebuilt() -> bool:
            kb = await kb_record(rt, kb_id)
            entries = await rt.registries.index.list(f"{kb_id}.", fresh=True)
            return sum(e.settings_version == kb.settings_version for e in entries) >= 3

        await wait_until(some_rebuilt, timeout=120, interval=0.02, what="a few rebuilt")
        r = await client.post(f"/v1/kbs/{kb_id}/reindex/cancel")
        assert r.status_code == 200, r.text
        after = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
        assert (after["chunk_count"], after["document_count"]) == (
            before["chunk_count"],
            before["document_count"],
        )
        await settled(rt)
        await assert_every_document_served(rt, client, kb_id, ids)
        assert (await client.get(f"/v1/kbs/{kb_id}/stats")).json()["chunk_count"] == before[
            "chunk_count"
        ]


async def test_points_a_rebuild_lost_before_the_switch_are_built_again(
    tmp_path, embedders, monkeypatch: pytest.MonkeyPatch
):
    """A rebuild writes its collection without waiting for the disk (nobody searches it
    yet), so a machine going down could lose its last points while their index entries
    stay. Before searches move there the collection is checked against its entries: a
    document whose points are missing is built again, and then every document is served."""
    monkeypatch.setattr("services.embed.service.SWITCH_CHECK_SECONDS", 4.0)
    async with running_stack(tmp_path, embedders=embedders, embed_concurrency=1) as (rt, client):
        kb_id = (await create_kb(client, name=f"lost-{uid()}", chunk_size=200))["kb_id"]
        ids = await upload_all(client, kb_id, 6)
        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 50})
        assert r.status_code == 200, r.text
        building = (await kb_record(rt, kb_id)).collection_name

        async def last_phase() -> bool:
            kb = await kb_record(rt, kb_id)
            entries = await rt.registries.index.list(f"{kb_id}.", fresh=True)
            current = [e for e in entries if e.settings_version == kb.settings_version]
            return len(current) == len(ids) and kb.serving is not None

        await wait_until(last_phase, timeout=120, interval=0.02, what="the rebuild's last phase")
        # What the machine going down would leave: entries whose points never reached disk.
        await rt.store.delete_document(building, ids[0])
        assert (await kb_record(rt, kb_id)).serving is not None, "switched before the loss"

        await wait_until(lambda: switched(rt, kb_id), timeout=120, interval=0.1, what="switch")
        await settled(rt)
        assert (await kb_record(rt, kb_id)).collection_name == building
        await assert_every_document_served(rt, client, kb_id, ids)


@pytest.fixture
def provider() -> Iterator[OpenAIEmbeddingsServer]:
    # LiteLLM's OpenAI client wants a key; the local server ignores it.
    with pytest.MonkeyPatch.context() as mp, OpenAIEmbeddingsServer(dim=16) as server:
        mp.setenv("OPENAI_API_KEY", "test")
        yield server


async def test_a_cancel_while_a_document_is_embedded_returns_to_the_served_index(
    tmp_path, embedders, provider
):
    """A rebuild is cancelled while one of its documents waits for the model. When that
    document's embedding comes back, nothing of it reaches the index searches read: no
    document is embedded again, the KB's chunk count and every search answer are exactly
    those from before the rebuild."""
    async with running_stack(
        tmp_path, embedders=embedders, egress={"allow_private": True}, embed_concurrency=1
    ) as (rt, client):
        kb_id = (
            await create_kb(
                client,
                name=f"cancelled-{uid()}",
                embedding_model=REMOTE,
                api_base=provider.base_url,
                chunk_size=200,
            )
        )["kb_id"]
        ids = await upload_all(client, kb_id, 6)
        before_stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
        queries = [f"the {WORDS[i]} {i} history" for i in range(len(ids))]

        async def answers() -> list[list[tuple[str, str]]]:
            found = []
            for q in queries:
                body = {"query": q, "kb_ids": [kb_id], "mode": "keyword"}
                hits = (await client.post("/v1/search", json=body)).json()["hits"]
                found.append([(h["chunk_id"], h["content"]) for h in hits])
            return found

        before = await answers()

        provider.hold()
        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 50})
        assert r.status_code == 200, r.text
        await wait_until(
            lambda: _true(provider.held >= 1), timeout=60, what="a rebuild's embedding call"
        )
        r = await client.post(f"/v1/kbs/{kb_id}/reindex/cancel")
        assert r.status_code == 200, r.text
        requests = provider.requests
        provider.release()
        await settled(rt)
        assert await switched(rt, kb_id)

        assert provider.requests == requests, "a document was embedded again"
        after_stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
        assert after_stats["chunk_count"] == before_stats["chunk_count"]
        assert after_stats["document_count"] == before_stats["document_count"]
        await assert_every_document_served(rt, client, kb_id, ids)
        assert await answers() == before


async def test_the_same_change_again_after_a_cancel_builds_every_document(
    tmp_path, embedders, provider
):
    """A cancel returns the KB to its previous settings version; the same change made
    again right after reaches that version number once more. A document whose embedding
    for the cancelled rebuild was still under way must not pass for built in the new one:
    after the switch, every document is in the collection searches read."""
    async with running_stack(
        tmp_path, embedders=embedders, egress={"allow_private": True}, embed_concurrency=1
    ) as (rt, client):
        kb_id = (
            await create_kb(
                client,
                name=f"again-{uid()}",
                embedding_model=REMOTE,
                api_base=provider.base_url,
                chunk_size=200,
            )
        )["kb_id"]
        ids = await upload_all(client, kb_id, 6)

        provider.hold()
        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 50})
        assert r.status_code == 200, r.text
        cancelled = await kb_record(rt, kb_id)
        await wait_until(
            lambda: _true(provider.held >= 1), timeout=60, what="a rebuild's embedding call"
        )
        assert (await client.post(f"/v1/kbs/{kb_id}/reindex/cancel")).status_code == 200
        r = await client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": 50})
        assert r.status_code == 200, r.text
        again = await kb_record(rt, kb_id)
        assert again.settings_version == cancelled.settings_version  # the version comes back
        assert again.collection_name != cancelled.collection_name  # a collection never does
        provider.release()

        await wait_until(lambda: switched(rt, kb_id), timeout=120, interval=0.1, what="the switch")
        await settled(rt)
        kb = await kb_record(rt, kb_id)
        assert kb.collection_name == again.collection_name and kb.chunk_size == 50
        await assert_every_document_served(rt, client, kb_id, ids)


async def _true(value: bool) -> bool:
    return value
