"""Changing a KB's embedding model builds a new collection while the old one keeps
answering searches with the old model; when every document is in the new one, searches
move there and the old collection is dropped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import running_stack
from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.domain import wait_until
from tests.support.openai_embeddings import OpenAIEmbeddingsServer

REMOTE = "openai/test-embed"


@pytest.fixture(scope="module")
def provider() -> Iterator[OpenAIEmbeddingsServer]:
    # LiteLLM's OpenAI client wants a key; the local server ignores it.
    with pytest.MonkeyPatch.context() as mp, OpenAIEmbeddingsServer(dim=16) as server:
        mp.setenv("OPENAI_API_KEY", "test")
        yield server


async def test_model_change_switches_collections_and_search_answers_throughout(
    tmp_path, embedders, provider
):
    """MiniLM (384 dims) → a LiteLLM model (16 dims): every search during the rebuild
    answers; afterwards the KB's points live in generation 2 (one per chunk, as before),
    generation 1 is gone, and queries are embedded by the new model."""
    # The provider listens on loopback: allowed explicitly, as for a self-hosted model.
    async with running_stack(tmp_path, embedders=embedders, egress={"allow_private": True}) as (
        rt,
        client,
    ):
        kb_id = (await client.post("/v1/kbs", json={"name": "switching"})).json()["kb_id"]
        for name, text in DOCS.items():
            r = await client.post(
                f"/v1/kbs/{kb_id}/documents?wait=true", json={"name": name, "content": text}
            )
            assert r.json()["status"] == "complete", r.text
        store = rt.store
        old, new = f"kb_{kb_id}", f"kb_{kb_id}_g2"
        chunks = await store.count(old)
        assert chunks >= len(DOCS)

        r = await client.patch(
            f"/v1/kbs/{kb_id}",
            json={"embedding_model": REMOTE, "api_base": provider.base_url},
        )
        assert r.status_code == 200, r.text
        query = PARAPHRASES["volcanoes.md"]

        async def switched() -> bool:
            r = await client.post("/v1/search", json={"query": query, "kb_ids": [kb_id]})
            assert r.status_code == 200 and r.json()["hits"], r.text  # answers throughout
            kb = await rt.registries.kbs.get(f"local.{kb_id}")
            if kb is None or kb.serving is not None:
                return False
            return not await store.collection_exists(old)

        await wait_until(switched, timeout=90, interval=0.2, what="the switch to generation 2")
        assert await store.count(new) == chunks
        before = provider.requests
        r = await client.post("/v1/search", json={"query": "lava and ash", "kb_ids": [kb_id]})
        assert r.status_code == 200 and r.json()["hits"]
        assert provider.requests == before + 1
