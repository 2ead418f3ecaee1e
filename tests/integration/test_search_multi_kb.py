"""Search across several KBs with different embedding models — the bundled MiniLM and a
LiteLLM model served by a local OpenAI-compatible server — and search replicas sharing the
load through the NATS queue group."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace

from services.common.bus.client import Bus
from services.search.handlers import create_responders
from services.search.service import SearchService
from tests.conftest import running_stack
from tests.support.bus import credentials
from tests.support.corpus import DOCS
from tests.support.openai_embeddings import OpenAIEmbeddingsServer

MINILM = "local/all-MiniLM-L6-v2"
REMOTE = "openai/test-embed"


@pytest.fixture(scope="module")
def remote_server() -> Iterator[OpenAIEmbeddingsServer]:
    # LiteLLM's OpenAI client wants a key; the local server ignores it.
    with pytest.MonkeyPatch.context() as mp, OpenAIEmbeddingsServer(dim=24) as server:
        mp.setenv("OPENAI_API_KEY", "test")
        yield server


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders, remote_server):
    # The provider listens on loopback: allowed explicitly, as for a self-hosted model.
    async with running_stack(
        tmp_path_factory.mktemp("multi"), embedders=embedders, egress={"allow_private": True}
    ) as s:
        yield s


@pytest.fixture(scope="module")
async def kbs(stack, remote_server) -> dict[str, str]:
    """Three KBs of the default org: `default` and `local2` on MiniLM, `remote` on the
    LiteLLM model; each holds the three corpus documents."""
    _, client = stack
    ids = {"default": "default"}
    for name, body in (
        ("local2", {}),
        ("remote", {"embedding_model": REMOTE, "api_base": remote_server.base_url}),
    ):
        r = await client.post("/v1/kbs", json={"name": name, **body})
        assert r.status_code in (200, 201), r.text
        ids[name] = r.json()["kb_id"]
    for kb in ids.values():
        for name, text in DOCS.items():
            r = await client.post(
                f"/v1/kbs/{kb}/documents?wait=true", json={"name": name, "content": text}
            )
            assert r.json()["status"] == "complete", r.text
    return ids


async def search(client, **query: Any) -> dict[str, Any]:
    r = await client.post("/v1/search", json=query)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
async def test_kbs_with_different_models_all_answer_fused_by_rank(stack, kbs, mode):
    """kb_ids omitted covers every KB of the org; with top_k equal to the number of KBs the
    answer holds each KB's best hit once (rank fusion: first places before second places,
    whatever the raw scores of the two models)."""
    _, client = stack
    body = await search(client, query=f"volcano lava eruption {mode}", mode=mode, top_k=3)
    assert set(body["kb_ids"]) == set(kbs.values())
    assert sorted(h["kb_id"] for h in body["hits"]) == sorted(kbs.values())
    assert [h["rank"] for h in body["hits"]] == [1, 2, 3]
    named = await search(client, query="volcano", kb_ids=["remote", "local2"], mode=mode, top_k=10)
    assert set(named["kb_ids"]) == {kbs["remote"], kbs["local2"]}
    assert {h["kb_id"] for h in named["hits"]} == {kbs["remote"], kbs["local2"]}


async def test_query_is_embedded_once_per_distinct_model(stack, kbs, embedders, remote_server):
    """Two MiniLM KBs and one remote KB: a new query costs one MiniLM encode and one request
    to the remote provider, whatever the number of KBs; asked again it costs nothing."""
    _, client = stack
    local = embedders.get(MINILM)
    before_local, before_remote = local.embed_count, remote_server.requests
    query = "a brand new question about bread and yeast"
    body = await search(client, query=query, top_k=10)
    assert {h["kb_id"] for h in body["hits"]} == set(kbs.values())
    assert local.embed_count - before_local == 1
    assert remote_server.requests - before_remote == 1
    assert remote_server.batches[-1] == [query]

    await search(client, query=query, top_k=10)
    await search(client, query=query, mode="dense", kb_ids=["remote"])
    assert local.embed_count - before_local == 1
    assert remote_server.requests - before_remote == 1


async def test_a_broken_kb_leaves_a_partial_result_naming_it(stack, kbs, remote_server):
    """The remote KB's provider rejects every request (401, as with a missing key): a search
    over every KB still answers 200 with the MiniLM KBs' hits and names the remote KB in
    `failed_kbs`, without the provider's response text; keyword search needs no model and
    keeps all three. Searching only the broken KB is the error itself."""
    _, client = stack
    remote_server.fail_next(1000, status=401, message="SECRET-PROVIDER-TEXT")
    try:
        body = await search(client, query="volcano ash and broken providers", top_k=10)
        assert {h["kb_id"] for h in body["hits"]} == {kbs["default"], kbs["local2"]}
        [failed] = body["failed_kbs"]
        assert failed["kb_id"] == kbs["remote"] and failed["name"] == "remote"
        assert failed["error_type"] == "ValidationError"
        assert "401" in failed["message"] and "SECRET" not in failed["message"]
        keyword = await search(client, query="volcano", mode="keyword", top_k=10)
        assert keyword["failed_kbs"] == []
        assert {h["kb_id"] for h in keyword["hits"]} == set(kbs.values())
        r = await client.post(
            "/v1/search", json={"query": "volcano ash, alone", "kb_ids": ["remote"]}
        )
        assert r.status_code == 422 and "SECRET" not in r.text, r.text
    finally:
        remote_server.reset()


async def test_search_replicas_share_the_load(stack, kbs):
    """A second search replica on its own NATS connection joins the queue group: many
    requests through the gateway are answered by both replicas, each with the full answer."""
    rt, client = stack
    first = rt.search
    assert first is not None
    second = SearchService(rt.registries, first.store, rt.embedders, rt.settings.search)
    served: Counter[str] = Counter()

    def counting(name: str, service: SearchService) -> None:
        call = service.search

        async def search(req: Any) -> Any:
            served[name] += 1
            return await call(req)

        service.search = search  # type: ignore[method-assign]

    counting("first", first)
    counting("second", second)
    bus = Bus(
        rt.bus.url,
        trace.get_tracer_provider(),
        credentials(rt.settings.data_dir, "search"),
        rules=rt.settings.bus,
    )
    bus.responders += create_responders(second)
    try:
        await bus.connect()
        await bus.start()
        answers = await asyncio.gather(
            *(search(client, query="volcano", kb_ids=["default"], top_k=1) for _ in range(40))
        )
    finally:
        await bus.close()
        del first.search  # the instance attribute; the class method serves again
    assert served["first"] + served["second"] == 40
    assert served["first"] > 0 and served["second"] > 0, served
    assert {a["hits"][0]["document_name"] for a in answers} == {"volcanoes.md"}
