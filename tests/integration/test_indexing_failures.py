"""A document that embed cannot index says why: the dead letter holds the message, the
document's status and error name the KB and the reason, stats count it, and retry-failed
indexes it once the cause is gone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import running_stack
from tests.support.bus import as_operator
from tests.support.domain import wait_until
from tests.support.openai_embeddings import OpenAIEmbeddingsServer


@pytest.fixture(scope="module")
def provider() -> Iterator[OpenAIEmbeddingsServer]:
    # LiteLLM's OpenAI client wants a key; the local server ignores it.
    with pytest.MonkeyPatch.context() as mp, OpenAIEmbeddingsServer(dim=16) as server:
        mp.setenv("OPENAI_API_KEY", "test")
        yield server


async def test_embed_failure_is_recorded_on_the_document_and_retry_recovers(
    tmp_path, embedders, provider
):
    """The provider rejects the embedding (HTTP 400, permanent): the upload with wait=true
    answers failed, kb.index is dead-lettered, GET /v1/documents/{id} says failed with the
    KB and the reason, and stats count it. Once the provider accepts again, retry-failed
    indexes the document and the error is gone."""
    # The provider listens on loopback: allowed explicitly, as for a self-hosted model.
    async with running_stack(tmp_path, embedders=embedders, egress={"allow_private": True}) as (
        rt,
        client,
    ):
        r = await client.post(
            "/v1/kbs",
            json={
                "name": "remote",
                "embedding_model": "openai/test-embed",
                "api_base": provider.base_url,
            },
        )
        kb_id = r.json()["kb_id"]
        async with as_operator(rt) as operator:
            dlq = await operator.jetstream().subscribe("dlq.local.kb.index", stream="KBMESH_DLQ")
            provider.fail_next(1000, status=400, message="model does not exist")
            r = await client.post(
                f"/v1/kbs/{kb_id}/documents?wait=true",
                json={"name": "note.txt", "content": "quarterly revenue rose"},
            )
            assert r.json()["status"] == "failed", r.text
            document_id = r.json()["document_id"]
            dead = await dlq.next_msg(timeout=30)
            assert dead.headers["Kbmesh-Error-Type"] == "ValidationError"

        async def failed_view():
            view = (await client.get(f"/v1/documents/{document_id}")).json()
            return view if view["status"] == "failed" else None

        view = await wait_until(failed_view, timeout=30)
        assert f"KB {kb_id}" in view["error"], view
        assert "400" in view["error"] or "does not exist" in view["error"], view
        stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
        assert stats["failed_count"] == 1 and stats["document_count"] == 0

        provider.reset()
        r = await client.post(f"/v1/kbs/{kb_id}/retry-failed")
        assert r.status_code == 202, r.text

        async def complete_view():
            view = (await client.get(f"/v1/documents/{document_id}")).json()
            return view if view["status"] == "complete" else None

        view = await wait_until(complete_view, timeout=60)
        assert view["error"] is None
        stats = (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
        assert stats["failed_count"] == 0 and stats["document_count"] == 1
