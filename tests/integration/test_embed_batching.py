"""Cross-document batching in embed: the chunks of concurrent kb.index messages share model
calls, yet each message keeps its own outcome: effects stay exactly-once when messages are
delivered again, and one poisoned document fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from services.common.messages.events import KbIndex
from services.common.messages.names import Subject
from tests.conftest import running_stack
from tests.support.domain import (
    DEFAULT_MODEL,
    create_kb,
    dead_letters,
    embed_count,
    expected_chunks,
    settled,
    stored_chunks,
    uid,
    wait_until,
)
from tests.support.openai_embeddings import OpenAIEmbeddingsServer

REMOTE = "openai/test-embed"
TOPICS = ["volcanoes", "sourdough", "congestion", "glaciers", "compilers", "tides", "bees"]


def text_of(topic: str, paragraphs: int = 3) -> str:
    return "\n\n".join(
        f"{topic.title()} paragraph {p}: " + " ".join(f"{topic}{w} fact{p}" for w in range(60))
        for p in range(paragraphs)
    )


@pytest.fixture(scope="module")
def provider() -> Iterator[OpenAIEmbeddingsServer]:
    with pytest.MonkeyPatch.context() as mp, OpenAIEmbeddingsServer(dim=16) as server:
        mp.setenv("OPENAI_API_KEY", "test")
        yield server


async def post_document(client, kb_id: str, name: str, content: str) -> str:
    r = await client.post(f"/v1/kbs/{kb_id}/documents", json={"name": name, "content": content})
    assert r.status_code in (200, 202), r.text
    return str(r.json()["document_id"])


async def test_redelivered_messages_in_shared_batches_have_exactly_once_effects(
    tmp_path, embedders
):
    """Seven documents are uploaded at once and every kb.index is delivered three times
    (two extra copies published while the first is in flight, as a redelivery after a lost
    ack does). Their chunks share model calls, and the result is as if each message had
    been handled once: each document's points are exactly its chunks, in order, and every
    chunk was embedded once."""
    async with running_stack(tmp_path, embedders=embedders) as (rt, client):
        kb = await create_kb(client, name=f"batch-{uid()}")
        model = rt.embedders.get(DEFAULT_MODEL)
        shared_before = model.documents.stats.shared_calls
        embedded_before = embed_count(rt)
        texts = {f"{t}.md": text_of(t) for t in TOPICS}
        ids = await asyncio.gather(
            *(post_document(client, kb["kb_id"], n, c) for n, c in texts.items())
        )
        copies = [
            KbIndex(org_id=rt.settings.default_org, kb_id=kb["kb_id"], document_id=d, revision=1)
            for d in ids
            for _ in range(2)
        ]
        await asyncio.gather(*(rt.bus.publish(Subject.KB_INDEX, ev) for ev in copies))
        await settled(rt, timeout=120)

        want = {d: expected_chunks(rt, kb, texts[n], n) for d, n in zip(ids, texts, strict=True)}
        for document_id, chunks in want.items():
            assert await stored_chunks(rt, kb["kb_id"], document_id) == chunks
        assert embed_count(rt) - embedded_before == sum(len(c) for c in want.values())
        assert model.documents.stats.shared_calls > shared_before
        assert await dead_letters(rt, Subject.KB_INDEX) == {}


async def test_a_poisoned_document_fails_alone_and_its_batch_mates_are_indexed(
    tmp_path, embedders, provider
):
    """The provider refuses any request that holds one document's text (HTTP 400). Seven
    documents are indexed together; the refused shared call is repeated per document, so
    only the poisoned one fails (dead letter, status failed) and the other six are
    complete with all their chunks."""
    provider.reset()
    provider.reject_inputs_containing("tides")
    try:
        # The provider listens on loopback: allowed explicitly, as for a self-hosted model.
        async with running_stack(tmp_path, embedders=embedders, egress={"allow_private": True}) as (
            rt,
            client,
        ):
            kb = await create_kb(
                client, name=f"poison-{uid()}", embedding_model=REMOTE, api_base=provider.base_url
            )
            remote = rt.embedders.get(REMOTE, provider.base_url)
            texts = {f"{t}.md": text_of(t, paragraphs=1) for t in TOPICS}
            # A stalled provider holds the first document's call; the other six, the poisoned
            # one among them, queue behind it and go out together once it answers.
            first, *rest = sorted(texts, key=lambda n: n == "tides.md")
            waiting = sum(len(expected_chunks(rt, kb, texts[n], n)) for n in rest)

            async def first_call_held() -> bool:
                return provider.held == 1

            async def all_queued() -> bool:
                return remote.documents.queued == waiting

            provider.hold()
            ids = {first: await post_document(client, kb["kb_id"], first, texts[first])}
            await wait_until(first_call_held, what="the first call at the provider")
            for name in rest:
                ids[name] = await post_document(client, kb["kb_id"], name, texts[name])
            await wait_until(all_queued, what="the other documents' chunks queued")
            provider.release()
            await settled(rt, timeout=120)

            async def statuses() -> dict[str, str] | None:
                views = [(await client.get(f"/v1/documents/{d}")).json() for d in ids.values()]
                done = {v["name"]: v["status"] for v in views}
                return done if all(s in ("complete", "failed") for s in done.values()) else None

            done = await wait_until(statuses, timeout=60)
            assert done == {n: "failed" if n == "tides.md" else "complete" for n in texts}
            for name, document_id in ids.items():
                stored = await stored_chunks(rt, kb["kb_id"], document_id)
                want = [] if name == "tides.md" else expected_chunks(rt, kb, texts[name], name)
                assert stored == want, name
            assert len(await dead_letters(rt, Subject.KB_INDEX)) == 1
            # The proof that the poisoned text shared a call with others, which still
            # succeeded: a refused request held other documents' chunks too.
            assert any(any("tides" not in text for text in batch) for batch in provider.rejected), (
                provider.rejected
            )
            assert remote.documents.stats.split_retries >= 1
    finally:
        provider.reset()
