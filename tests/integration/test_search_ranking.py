"""Ranking through the real pipeline and model: several KBs ranked as one (an unrelated KB
does not push its best hit up), scores that follow the ranking in every mode and across
KBs, reranking through a server speaking Cohere's rerank protocol (and the fallback when it
fails), and token-budgeted answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.outbound.modelcalls import import_litellm
from services.search.budget import count_tokens
from tests.conftest import running_stack
from tests.support.rerank_server import RerankScript, rerank_server

RERANK_MODEL = "cohere/rerank-english-v3.0"

GEOLOGY = {
    "etna.md": "# Mount Etna\n\nEtna in Sicily is one of the most active volcanoes on Earth. "
    "Its eruptions send lava flows down the slopes and ash over Catania.",
    "vesuvius.md": "# Vesuvius\n\nThe volcano above Naples erupted in 79 AD and buried Pompeii "
    "under ash and pumice. Its magma chamber is still watched closely.",
    "lava.md": "# How lava flows\n\nMolten rock leaves a volcano as lava; basalt lava is runny "
    "and flows far, while viscous lava builds steep domes during an eruption.",
}
BAKERY = {
    "sourdough.md": "# Sourdough\n\nA starter of wild yeast raises the dough overnight; bake it "
    "in a hot Dutch oven for a crisp crust.",
    "croissants.md": "# Croissants\n\nLaminated dough: butter folded into the dough many times, "
    "rested cold, then rolled and baked until the layers puff.",
    "rye.md": "# Rye bread\n\nRye flour holds little gluten, so rye loaves are dense and often "
    "soured; bake them in tins and let them rest a day before cutting.",
}
# Long enough for several chunks of 50 tokens each: budgets then have chunks to leave out.
LONG = {
    "handbook.md": "\n\n".join(
        f"Section {i}. Holidays and leave: staff request leave in the portal; the manager "
        f"approves within {i + 2} days, and unused days carry over to the next year."
        for i in range(8)
    ),
    "travel.md": "\n\n".join(
        f"Part {i}. Travel: book trains under 600 km, keep receipts, and file the expense "
        f"report within {i + 5} days; leave for travel days is counted as work."
        for i in range(6)
    ),
}

# "ash" is in every page of one KB and in one page of another: each KB's own IDF makes it a
# common word in the first and a rare one in the second.
ASH_MANY = {
    "kiln.md": "Wood ash from the kiln: ash glaze, ash layers and ash dust on every shelf.",
    "hearth.md": "The hearth holds ash; sweep the ash out each morning before the ash cools.",
    "fireplace.md": "Fireplace ash and more ash: keep the ash in a metal bin outside.",
    "compost.md": "Add ash to compost sparingly; too much ash raises the pH of the soil.",
}
ASH_ONE = {
    "quarter.md": "Quarterly figures: revenue grew in every region, costs stayed flat, the "
    "new office opened on time, hiring met its plan, and the old ash tray in the lobby was "
    "finally replaced along with the carpets, the lights and the reception desk.",
    "pricing.md": "Pricing review: list prices rise three percent in spring for all plans.",
    "support.md": "Support rota: two engineers on call each week, handover on Mondays.",
    "travel.md": "Travel policy: trains under 600 km, receipts kept, reports within a week.",
}


@pytest.fixture(scope="module")
async def reranker() -> AsyncIterator[tuple[str, RerankScript]]:
    # The first `import litellm` can take longer than the rerank timeout on a busy machine
    # (search then answers in fused order, as test_a_failing_reranker... checks): import it
    # before the tests that expect the reranker's answer.
    await asyncio.to_thread(import_litellm)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COHERE_API_KEY", "test")  # LiteLLM wants one; the local server ignores it
        async with rerank_server() as server:
            yield server


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders, reranker):
    # The rerank server listens on loopback: allowed explicitly, as for a self-hosted model.
    async with running_stack(
        tmp_path_factory.mktemp("ranking"), embedders=embedders, egress={"allow_private": True}
    ) as s:
        _, client = s
        base, _ = reranker
        for kb, docs, body in (
            ("geology", GEOLOGY, {}),
            ("bakery", BAKERY, {}),
            (
                "reranked",
                GEOLOGY,
                {"rerank_model": RERANK_MODEL, "rerank_api_base": base},
            ),
            ("long", LONG, {"chunk_size": 50}),
            ("ash-many", ASH_MANY, {}),
            ("ash-one", ASH_ONE, {}),
            ("ash-all", ASH_MANY | ASH_ONE, {}),
        ):
            r = await client.post("/v1/kbs", json={"name": kb, **body})
            assert r.status_code == 201, r.text
            for name, text in docs.items():
                r = await client.post(
                    f"/v1/kbs/{kb}/documents?wait=true", json={"name": name, "content": text}
                )
                assert r.json()["status"] == "complete", r.text
        yield s


async def search(client, **query: Any) -> dict[str, Any]:
    r = await client.post("/v1/search", json=query)
    assert r.status_code == 200, r.text
    return r.json()


def names(body: dict[str, Any]) -> list[str]:
    return [h["document_name"] for h in body["hits"] if h["is_matched"]]


# ---- several KBs ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
async def test_an_unrelated_kb_does_not_outrank_a_related_kbs_good_hits(stack, mode):
    """Three volcano pages in one KB, bread in another: searched together, the related KB's
    three good hits come first. (Merging by rank alone put the bakery's best hit second.)"""
    _, client = stack
    body = await search(
        client,
        query="volcano eruption lava and ash",
        kb_ids=["geology", "bakery"],
        mode=mode,
        top_k=4,
    )
    assert set(names(body)[:3]) == set(GEOLOGY), names(body)


@pytest.mark.parametrize("mode", ["keyword", "hybrid"])
async def test_split_kbs_rank_like_one(stack, mode):
    """The same pages in one KB or split over two: the same order. A word common in one KB
    and rare in the other weighs the same in both when they are searched together, so the
    pages that use it most come first. (With each KB's own IDF the one passing mention in
    the other KB ranked first in keyword mode.)"""
    _, client = stack
    query = {"query": "ash", "mode": mode, "top_k": 8, "coalesce_neighbors": 0}
    together = await search(client, kb_ids=["ash-many", "ash-one"], **query)
    one = await search(client, kb_ids=["ash-all"], **query)
    assert names(together) == names(one)
    assert set(names(together)[:4]) == set(ASH_MANY), names(together)


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
async def test_scores_follow_the_ranking_across_kbs(stack, mode):
    _, client = stack
    body = await search(
        client,
        query="bread dough, lava flows and leave for travel",
        kb_ids=["geology", "bakery", "long"],
        mode=mode,
        top_k=20,
        coalesce_neighbors=0,
    )
    hits = body["hits"]
    assert len({h["kb_id"] for h in hits}) >= 3
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True) and all(0 < s <= 1 for s in scores)
    assert [h["rank"] for h in hits] == list(range(1, len(hits) + 1))
    assert body["score_kind"] == "fused"


# ---- reranking --------------------------------------------------------------------------------


async def test_a_kb_with_a_rerank_model_returns_the_rerankers_order(stack, reranker):
    """The reranker's order and scores replace the fused ones; the request carried the
    query and the candidates' text."""
    _, client = stack
    _, script = reranker
    script.prefer = "Pompeii"
    before = len(script.requests)
    body = await search(client, query="volcano eruption", kb_ids=["reranked"], top_k=3)
    assert len(script.requests) == before + 1
    sent = script.requests[-1]
    assert sent["query"] == "volcano eruption" and sent["model"] == "rerank-english-v3.0"
    assert body["score_kind"] == "rerank" and body["warnings"] == []
    assert names(body)[0] == "vesuvius.md"
    scores = [h["score"] for h in body["hits"]]
    assert scores == sorted(scores, reverse=True)
    plain = await search(client, query="volcano eruption", kb_ids=["reranked"], rerank=False)
    assert plain["score_kind"] == "fused" and len(script.requests) == before + 1
    script.prefer = "basalt"
    again = await search(client, query="volcano eruption", kb_ids=["reranked"], top_k=3)
    assert names(again)[0] == "lava.md"


@pytest.mark.parametrize("failure", ["status", "garbage"])
async def test_a_failing_reranker_leaves_the_fused_order_with_a_warning(stack, reranker, failure):
    _, client = stack
    _, script = reranker
    fused = await search(client, query="volcano ash", kb_ids=["reranked"], rerank=False)
    if failure == "status":
        script.fail_next(1, status=503)
    else:
        script.garbage_next(1)
    body = await search(client, query="volcano ash", kb_ids=["reranked"])
    assert body["score_kind"] == "fused"
    assert [h["chunk_id"] for h in body["hits"]] == [h["chunk_id"] for h in fused["hits"]]
    assert len(body["warnings"]) == 1 and RERANK_MODEL in body["warnings"][0]


async def test_rerank_asked_of_kbs_without_a_model_is_a_clear_error(stack):
    _, client = stack
    r = await client.post(
        "/v1/search", json={"query": "bread", "kb_ids": ["bakery"], "rerank": True}
    )
    assert r.status_code == 422, r.text
    assert "rerank_model" in r.text


async def test_rerank_off_by_default(stack, reranker):
    _, client = stack
    _, script = reranker
    before = len(script.requests)
    body = await search(client, query="volcano", kb_ids=["geology"])
    assert body["score_kind"] == "fused" and len(script.requests) == before


# ---- token budgets ----------------------------------------------------------------------------


async def test_max_tokens_packs_whole_chunks_in_rank_order_and_lists_the_rest(stack):
    _, client = stack
    query = "how many days does the manager take to approve leave"
    full = await search(client, query=query, kb_ids=["long"], top_k=8, coalesce_neighbors=0)
    sizes = [count_tokens(h["content"]) for h in full["hits"]]
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # the third does not fit
    body = await search(
        client, query=query, kb_ids=["long"], top_k=8, coalesce_neighbors=0, max_tokens=budget
    )
    kept = [h["chunk_id"] for h in body["hits"]]
    ranked = [h["chunk_id"] for h in full["hits"]]
    assert kept == [c for c in ranked if c in kept]  # rank order
    assert kept[:2] == ranked[:2]
    assert {h["content"] for h in body["hits"]} <= {h["content"] for h in full["hits"]}
    used = sum(count_tokens(h["content"]) for h in body["hits"])
    assert body["budget"]["used_tokens"] == used <= budget
    omitted = [o["chunk_id"] for o in body["budget"]["omitted"]]
    assert sorted(omitted + kept) == sorted(ranked)
    assert ranked[2] in omitted


async def test_max_tokens_keeps_neighbours_only_when_they_fit(stack):
    """With neighbours asked for, the best match comes with its context if it fits, and
    alone (context dropped, counted) if only it fits."""
    _, client = stack
    query = "expense report deadline for train travel"
    full = await search(client, query=query, kb_ids=["long"], top_k=1, coalesce_neighbors=1)
    whole = sum(count_tokens(h["content"]) for h in full["hits"])
    assert len(full["hits"]) >= 2
    fits = await search(
        client, query=query, kb_ids=["long"], top_k=1, coalesce_neighbors=1, max_tokens=whole
    )
    assert [h["chunk_id"] for h in fits["hits"]] == [h["chunk_id"] for h in full["hits"]]
    assert fits["budget"]["omitted"] == [] and fits["budget"]["omitted_neighbors"] == 0
    match = next(h for h in full["hits"] if h["is_matched"])
    alone = await search(
        client,
        query=query,
        kb_ids=["long"],
        top_k=1,
        coalesce_neighbors=1,
        max_tokens=count_tokens(match["content"]),
    )
    assert [h["chunk_id"] for h in alone["hits"]] == [match["chunk_id"]]
    assert alone["budget"]["omitted_neighbors"] == len(full["hits"]) - 1
    nothing = await search(client, query=query, kb_ids=["long"], top_k=1, max_tokens=1)
    assert nothing["hits"] == [] and len(nothing["budget"]["omitted"]) == 1


async def test_kb_search_tool_takes_max_tokens(stack):
    _, client = stack
    r = await client.post(
        "/api/v1/tools/kb_search",
        json={"query": "approve leave", "kb": "long", "top_k": 5, "max_tokens": 60},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    body = out.get("structuredContent") or out.get("result") or out
    assert body["budget"]["max_tokens"] == 60
    assert body["budget"]["used_tokens"] <= 60
