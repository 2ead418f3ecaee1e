"""Search through the real pipeline (REST upload → NATS → ingest → embed → Qdrant Edge) and
the real model: typed filters, modes, scores, neighbours, chunks, validation and org
isolation, at the service level and through REST."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from services.common.domain.models import KnowledgeBase
from services.common.messages.queries import SearchRequest, SearchResponse
from services.common.store import Filter, Match, bm25
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.corpus import DOCS

OTHER_ORG = "other-org"
IDENTIFIER = "ERR_7731_XQ"
# Shares no term with any document (checked below), so keyword search cannot find it.
PARAPHRASE = "peak spewing molten stone"

# Filter corpus: every document mentions the quarterly report, so one query reaches all of
# them in every mode and the filters alone decide what comes back.
FILTER_DOCS: dict[str, dict[str, Any]] = {
    "A": {
        "name": "Employee Handbook.md",
        "content": "# Employee handbook\n\nHow we work, holidays and benefits, as summarised "
        "in the quarterly report of the people team.",
        "source_id": "hr-wiki",
        "tags": ["hr", "policy"],
        "collection": "handbooks",
        "metadata": {
            "team": "people",
            "year": 2021,
            "score": 4.5,
            "reviewed": "2021-03-01T00:00:00Z",
            "public": True,
        },
    },
    "B": {
        "name": "handbook-appendix.md",
        "content": "# Appendix\n\nForms and contacts referenced by the quarterly report on "
        "onboarding.",
        "source_id": "hr-wiki",
        "tags": ["hr"],
        "collection": "handbooks",
        "metadata": {
            "team": "people",
            "year": 2022,
            "score": 3.0,
            "reviewed": "2022-06-15T00:00:00Z",
        },
    },
    "C": {
        "name": "Travel Policy.txt",
        "content": "Travel policy: book trains over flights below 600 km. Spending is tracked "
        "in the quarterly report of the finance team.",
        "source_id": "finance-drive",
        "tags": ["finance", "policy"],
        "metadata": {
            "team": "finance",
            "year": 2023,
            "score": 2.25,
            "reviewed": "2023-01-10T00:00:00Z",
            "public": False,
        },
    },
    # Uploaded after the others (the upload-date boundary lies between).
    "D": {
        "name": "release-notes-v2.md",
        "content": "# Release 2.0\n\nFaster indexing and a new console; adoption figures "
        "are in the quarterly report.",
        "source_id": "git:kbmesh",
        "tags": ["eng"],
        "collection": "releases",
        "metadata": {"team": "platform", "year": 2024, "score": 5},
    },
    "E": {
        "name": "Notes.txt",
        "content": "Loose notes for the next quarterly report.",
        "metadata": {},
    },
    "F": {
        "name": "HANDBOOK quick reference.md",
        "content": "# Quick reference\n\nThe one-page version of the handbook, updated with "
        "each quarterly report.",
        "source_id": "git:kbmesh",
        "tags": ["eng", "hr"],
        "collection": "handbooks",
        "metadata": {"team": "platform", "year": 2024, "reviewed": "2024-02-01T00:00:00Z"},
    },
}
FIRST_BATCH = ("A", "B", "C")
FILTER_QUERY = "quarterly report"

# Modes corpus: the identifier sits in release notes about other things, while the documents
# that read like "error codes" do not contain it (so dense ranks them above the notes).
MODES_DOCS = {
    **DOCS,
    "release-notes-4.2.md": (
        "# Release notes 4.2\n\nThe dashboard loads faster, dark mode now covers the settings "
        f"pages, and exports include time zones. Payment retries that used to end in "
        f"{IDENTIFIER} now back off and succeed. Thanks to everyone who reported issues."
    ),
    "error-codes.md": (
        "# Error code reference\n\nEvery service reports failures with a numbered error "
        "code, for example E1187 or E5520. Look the code up in the service runbook before "
        "paging anyone."
    ),
    "search-outage.md": (
        "# Search cluster incident\n\nThe search cluster returned error 4410 to every query "
        "after a disk filled up. Old snapshots were pruned and the cluster recovered within "
        "an hour."
    ),
    "login-outage.md": (
        "# Login failures\n\nUsers could not sign in because the identity service answered "
        "with failure code 9902 while its certificate was expired. Rotating the certificate "
        "fixed the problem."
    ),
}

# Neighbour corpus (chunk_size 50): one paragraph per chunk, each naming one animal or plant.
ANIMALS = ["quokka", "narwhal", "okapi", "axolotl", "pangolin", "wombat", "capybara", "tapir"]
PLANTS = ["baobab", "welwitschia", "rafflesia", "sequoia"]


def paragraphs(words: list[str], topic: str) -> str:
    return "\n\n".join(
        f"Chapter {i + 1} of the {topic} field guide describes the {word}. Researchers "
        f"observed it in the wild for several seasons and recorded where it lives, what it "
        f"needs to thrive and how local people have long described it in their stories."
        for i, word in enumerate(words)
    )


COALESCE_DOCS = {
    "animals.md": paragraphs(ANIMALS, "animal"),
    "plants.md": paragraphs(PLANTS, "plant"),
}


@dataclass
class Corpus:
    keys: dict[str, str]  # org → bearer token
    ids: dict[str, str] = field(default_factory=dict)  # FILTER_DOCS letter / name → id
    other_ids: set[str] = field(default_factory=set)
    kbs: dict[str, str] = field(default_factory=dict)  # name → kb_id (local org)
    boundary: datetime | None = None

    def auth(self, org: str = "local") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[org]}"}


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(tmp_path_factory.mktemp("search"), embedders=embedders) as s:
        yield s


async def create_kb(client, headers: dict[str, str], **body: Any) -> str:
    r = await client.post("/v1/kbs", json=body, headers=headers)
    assert r.status_code in (200, 201), r.text
    return r.json()["kb_id"]


async def upload(client, headers: dict[str, str], kb: str, **body: Any) -> str:
    body.setdefault("mime_type", "text/markdown")
    r = await client.post(f"/v1/kbs/{kb}/documents?wait=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["status"] == "complete", result
    return result["document_id"]


@pytest.fixture(scope="module")
async def corpus(stack) -> Corpus:
    rt, client = stack
    resolver = OperatorKeys(rt)
    c = Corpus(
        keys={
            "local": await resolver.create("local", name="search tests"),
            OTHER_ORG: await resolver.create(OTHER_ORG, name="search tests, second org"),
        }
    )
    local, other = c.auth(), c.auth(OTHER_ORG)
    for letter in FIRST_BATCH:
        c.ids[letter] = await upload(client, local, "default", **FILTER_DOCS[letter])
    c.boundary = datetime.now(UTC)
    for letter in FILTER_DOCS:
        if letter not in FIRST_BATCH:
            c.ids[letter] = await upload(client, local, "default", **FILTER_DOCS[letter])

    c.kbs["modes"] = await create_kb(client, local, name="modes")
    for name, text in MODES_DOCS.items():
        c.ids[name] = await upload(client, local, "modes", name=name, content=text)

    c.kbs["coalesce"] = await create_kb(
        client, local, name="coalesce", chunk_size=50, coalesce_neighbors=1
    )
    for name, text in COALESCE_DOCS.items():
        c.ids[name] = await upload(client, local, "coalesce", name=name, content=text)

    # The second org holds copies: the filter documents in a KB whose id collides with the
    # first org's `default` (as data from before KB ids were made unique across orgs would),
    # so both orgs' points share one Qdrant collection and only the org filter separates
    # them; the modes documents in a KB of its own.
    await rt.registries.kbs.create(
        f"{OTHER_ORG}.default",
        KnowledgeBase(org_id=OTHER_ORG, kb_id="default", name="shared-collection"),
    )
    for doc in FILTER_DOCS.values():
        c.other_ids.add(await upload(client, other, "default", **doc))
    await create_kb(client, other, name="modes")
    for name, text in MODES_DOCS.items():
        c.other_ids.add(await upload(client, other, "modes", name=name, content=text))
    return c


async def service_search(rt, org: str = "local", **query: Any) -> SearchResponse:
    """The search service called directly, as its bus handler would."""
    return await rt.search.search(SearchRequest(org_id=org, **query))


async def rest_search(client, corpus: Corpus, org: str = "local", **query: Any) -> dict[str, Any]:
    r = await client.post("/v1/search", json=query, headers=corpus.auth(org))
    assert r.status_code == 200, r.text
    return r.json()


def doc_ids(hits: list[Any]) -> set[str]:
    return {h["document_id"] if isinstance(h, dict) else h.document_id for h in hits}


# ---- filters -------------------------------------------------------------------------------

FILTER_CASES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "document_ids": ({"document_ids": ["<A>", "<C>"]}, {"A", "C"}),
    "source_ids": ({"source_ids": ["hr-wiki"]}, {"A", "B"}),
    "source_ids-default-source": ({"source_ids": ["git:kbmesh", "user-provided"]}, {"D", "E", "F"}),
    "tags-any-of": ({"tags": ["eng", "finance"]}, {"C", "D", "F"}),
    "tags-one": ({"tags": ["policy"]}, {"A", "C"}),
    "collection": ({"collection": "handbooks"}, {"A", "B", "F"}),
    "name-exact": (
        {"document_name": "Employee Handbook.md", "document_name_match": "exact"},
        {"A"},
    ),
    "name-exact-is-case-sensitive": (
        {"document_name": "employee handbook.md", "document_name_match": "exact"},
        set(),
    ),
    "name-substring-any-case": ({"document_name": "handbook"}, {"A", "B", "F"}),
    "name-substring-inside-words": ({"document_name": "BOOK Q"}, {"F"}),
    "name-substring-punctuation": ({"document_name": "dbook-app"}, {"B"}),
    "metadata-eq-string": ({"metadata": [{"key": "team", "eq": "people"}]}, {"A", "B"}),
    "metadata-eq-int": ({"metadata": [{"key": "year", "eq": 2024}]}, {"D", "F"}),
    "metadata-eq-int-finds-float": ({"metadata": [{"key": "score", "eq": 3}]}, {"B"}),
    "metadata-eq-float": ({"metadata": [{"key": "score", "eq": 2.25}]}, {"C"}),
    "metadata-eq-bool": ({"metadata": [{"key": "public", "eq": False}]}, {"C"}),
    "metadata-any-of-strings": (
        {"metadata": [{"key": "team", "any_of": ["finance", "platform"]}]},
        {"C", "D", "F"},
    ),
    "metadata-any-of-ints": ({"metadata": [{"key": "year", "any_of": [2021, 2023]}]}, {"A", "C"}),
    "metadata-range": ({"metadata": [{"key": "score", "gte": 3}]}, {"A", "B", "D"}),
    "metadata-range-open-bounds": ({"metadata": [{"key": "score", "gt": 3, "lte": 5}]}, {"A", "D"}),
    "metadata-range-upper": ({"metadata": [{"key": "year", "lt": 2023}]}, {"A", "B"}),
    "metadata-date-range": (
        {
            "metadata": [
                {"key": "reviewed", "date_from": "2022-01-01T00:00:00Z", "date_to": "2023-12-31"}
            ]
        },
        {"B", "C"},
    ),
    "metadata-date-from": (
        {"metadata": [{"key": "reviewed", "date_from": "2023-06-01T00:00:00"}]},
        {"F"},
    ),
    "metadata-unknown-key": ({"metadata": [{"key": "nope", "eq": "x"}]}, set()),
    "upload-date-from": ({"upload_date_from": "<T>"}, {"D", "E", "F"}),
    "upload-date-to": ({"upload_date_to": "<T>"}, {"A", "B", "C"}),
    "upload-date-both": (
        {"upload_date_from": "2000-01-01", "upload_date_to": "<T>"},
        {"A", "B", "C"},
    ),
    "combined-tags-collection-range": (
        {"tags": ["hr"], "collection": "handbooks", "metadata": [{"key": "year", "gte": 2022}]},
        {"B", "F"},
    ),
    "combined-with-upload-date": (
        {"tags": ["hr"], "collection": "handbooks", "upload_date_from": "<T>"},
        {"F"},
    ),
    "combined-name-and-source": (
        {"document_name": "handbook", "source_ids": ["hr-wiki"]},
        {"A", "B"},
    ),
    "combined-two-metadata": (
        {
            "metadata": [
                {"key": "team", "any_of": ["people", "finance"]},
                {"key": "public", "eq": True},
            ]
        },
        {"A"},
    ),
    "combined-nothing-left": ({"tags": ["eng"], "source_ids": ["hr-wiki"]}, set()),
}


def resolve(filters: dict[str, Any], corpus: Corpus) -> dict[str, Any]:
    """Fill in the placeholders: <A> → A's document id, <T> → the upload boundary."""
    assert corpus.boundary is not None
    out = dict(filters)
    if "document_ids" in out:
        out["document_ids"] = [corpus.ids[v.strip("<>")] for v in out["document_ids"]]
    for key in ("upload_date_from", "upload_date_to"):
        if out.get(key) == "<T>":
            out[key] = corpus.boundary.isoformat()
    return out


def letters(ids: set[str], corpus: Corpus) -> set[str]:
    by_id = {v: k for k, v in corpus.ids.items()}
    return {by_id.get(i, f"?{i}") for i in ids}


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
@pytest.mark.parametrize(("filters", "expected"), FILTER_CASES.values(), ids=FILTER_CASES.keys())
async def test_filter_returns_exactly_the_expected_documents(
    stack, corpus, filters, expected, mode
):
    """Each filter alone and combined, in every mode, at the service level: exactly the
    fixture documents that satisfy it (top_k above the corpus size, one query reaching all)."""
    rt, _ = stack
    resp = await service_search(
        rt,
        query=FILTER_QUERY,
        kb_ids=["default"],
        mode=mode,
        top_k=50,
        filters=resolve(filters, corpus),
    )
    assert letters(doc_ids(resp.hits), corpus) == expected


@pytest.mark.parametrize(("filters", "expected"), FILTER_CASES.values(), ids=FILTER_CASES.keys())
async def test_filter_through_rest(stack, corpus, filters, expected):
    """The same cases through POST /v1/search (hybrid, the default mode)."""
    _, client = stack
    body = await rest_search(
        client,
        corpus,
        query=FILTER_QUERY,
        kb_ids=["default"],
        top_k=50,
        filters=resolve(filters, corpus),
    )
    assert letters(doc_ids(body["hits"]), corpus) == expected
    for hit in body["hits"]:
        assert hit["is_matched"] and hit["match_type"] == "hybrid"


async def test_hits_carry_every_result_field(stack, corpus):
    """A hit names its chunk, KB, document, source and labels as uploaded, with no
    `collection:` tag leaking into tags."""
    _, client = stack
    body = await rest_search(
        client,
        corpus,
        query=FILTER_QUERY,
        kb_ids=["default"],
        filters={"document_ids": [corpus.ids["A"]]},
    )
    [hit] = body["hits"]
    doc = FILTER_DOCS["A"]
    assert hit["chunk_id"] and hit["kb_id"] == "default"
    assert hit["document_id"] == corpus.ids["A"]
    assert hit["document_name"] == doc["name"]
    assert hit["source_id"] == doc["source_id"]
    assert "uri" in hit and hit["chunk_index"] == 0 and hit["total_chunks"] == 1
    assert "quarterly report" in hit["content"]
    assert set(doc["tags"]) <= set(hit["tags"])
    assert not any(t.startswith("collection:") for t in hit["tags"])
    assert hit["collection"] == "handbooks"
    assert hit["metadata"] == doc["metadata"]
    assert hit["rank"] == 1 and isinstance(hit["score"], float)


# ---- modes -----------------------------------------------------------------------------------


def test_paraphrase_shares_no_term_with_the_corpus():
    """Precondition of the modes test: keyword search has nothing to go on."""
    terms = set(bm25.tokenize(PARAPHRASE))
    for name, text in MODES_DOCS.items():
        assert not terms & set(bm25.tokenize(f"{name}\n{text}")), name


async def test_keyword_finds_identifier_dense_finds_paraphrase_hybrid_finds_both(stack, corpus):
    """At top_k=2: keyword finds the release notes by `ERR_7731_XQ`, which dense misses (it
    prefers documents that read like error codes); dense finds the volcano page from a
    paraphrase, which keyword misses (no shared term); hybrid puts each target first."""
    _, client = stack
    notes, volcano = corpus.ids["release-notes-4.2.md"], corpus.ids["volcanoes.md"]

    async def top(query: str, mode: str) -> list[str]:
        body = await rest_search(client, corpus, query=query, kb_ids=["modes"], mode=mode, top_k=2)
        return [h["document_id"] for h in body["hits"]]

    assert (await top(IDENTIFIER, "keyword"))[0] == notes
    assert notes not in await top(IDENTIFIER, "dense")
    assert (await top(IDENTIFIER, "hybrid"))[0] == notes

    assert (await top(PARAPHRASE, "dense"))[0] == volcano
    assert await top(PARAPHRASE, "keyword") == []
    assert (await top(PARAPHRASE, "hybrid"))[0] == volcano


async def test_match_type_per_hit(stack, corpus):
    """keyword → 'keyword', dense → 'semantic'; in hybrid a chunk holding the query's terms
    is 'hybrid' and one found by meaning alone is 'semantic'."""
    _, client = stack
    expected = {"keyword": {"keyword"}, "dense": {"semantic"}}
    for mode, types in expected.items():
        body = await rest_search(
            client, corpus, query=IDENTIFIER, kb_ids=["modes"], mode=mode, top_k=5
        )
        assert {h["match_type"] for h in body["hits"]} == types
    body = await rest_search(client, corpus, query=IDENTIFIER, kb_ids=["modes"], top_k=5)
    by_doc = {h["document_id"]: h["match_type"] for h in body["hits"]}
    assert by_doc.pop(corpus.ids["release-notes-4.2.md"]) == "hybrid"
    assert by_doc and set(by_doc.values()) == {"semantic"}


# ---- scores and min_score --------------------------------------------------------------------


async def test_scores_in_every_mode(stack, corpus):
    """`score` is what ranked the hits: 0-1, never increasing down the list, in every mode.
    `similarity` is the chunk's cosine (hybrid's equals dense's for the same chunk), absent
    in keyword mode. min_score keeps exactly the hits scoring at least that (a prefix of the
    ranking); min_similarity keeps exactly those at least that similar, in ranking order."""
    _, client = stack
    query = "service error after a network failure"
    similarities: dict[str, dict[str, float]] = {}
    for mode in ("hybrid", "dense", "keyword"):
        body = await rest_search(client, corpus, query=query, kb_ids=["modes"], mode=mode, top_k=10)
        assert body["score_kind"] == "fused" and body["mode"] == mode
        hits = body["hits"]
        assert len(hits) >= 3, (mode, hits)
        scores = [h["score"] for h in hits]
        assert scores == sorted(scores, reverse=True)
        assert all(0 < s <= 1 for s in scores)
        assert [h["rank"] for h in hits] == list(range(1, len(hits) + 1))
        if mode == "keyword":
            assert all(h["similarity"] is None for h in hits)
        else:
            assert all(-1 <= h["similarity"] <= 1 for h in hits)
            similarities[mode] = {h["chunk_id"]: h["similarity"] for h in hits}
        # A threshold between the 2nd and 3rd best scores keeps exactly the first two.
        floor = (scores[1] + scores[2]) / 2
        kept = await rest_search(
            client, corpus, query=query, kb_ids=["modes"], mode=mode, top_k=10, min_score=floor
        )
        assert [h["chunk_id"] for h in kept["hits"]] == [h["chunk_id"] for h in hits[:2]]
        assert [h["rank"] for h in kept["hits"]] == [1, 2]
        nothing = await rest_search(
            client, corpus, query=query, kb_ids=["modes"], mode=mode, min_score=1.0
        )
        assert all(h["score"] == 1.0 for h in nothing["hits"])
        if mode != "keyword":
            ranked = sorted((h["similarity"] for h in hits), reverse=True)
            floor = (ranked[1] + ranked[2]) / 2
            similar = await rest_search(
                client,
                corpus,
                query=query,
                kb_ids=["modes"],
                mode=mode,
                top_k=10,
                min_similarity=floor,
            )
            assert [h["chunk_id"] for h in similar["hits"]] == [
                h["chunk_id"] for h in hits if h["similarity"] >= floor
            ]
    for chunk_id, cosine in similarities["hybrid"].items():
        if chunk_id in similarities["dense"]:
            assert cosine == pytest.approx(similarities["dense"][chunk_id], abs=1e-4)
    r = await client.post(
        "/v1/search",
        json={"query": query, "mode": "keyword", "min_similarity": 0.3},
        headers=corpus.auth("local"),
    )
    assert r.status_code == 422 and "min_similarity" in r.text


# ---- neighbours and chunks -------------------------------------------------------------------


async def chunk_index_of(rt, corpus: Corpus, doc: str, word: str) -> tuple[int, int]:
    """(chunk index holding `word`, total chunks) of a coalescing fixture document, read
    from the store, so the test does not depend on the chunker's exact boundaries."""
    store = rt.store
    points = await store.scroll(
        f"kb_{corpus.kbs['coalesce']}", Filter(must=(Match("document_id", corpus.ids[doc]),)), 100
    )
    found = [p.payload["chunk_index"] for p in points if word in p.payload["content"]]
    assert len(found) == 1, (word, found)
    return found[0], len(points)


async def test_adjacent_matches_coalesce_into_one_window_without_duplicates(stack, corpus):
    """Matches in adjacent chunks (axolotl, pangolin) and one at a document's start (baobab),
    with one neighbour each side: the windows are merged and clipped, each chunk appears
    once, documents are grouped in chunk order and ordered by their best match, matched
    chunks keep their rank and score, neighbours have is_matched false and no score."""
    rt, client = stack
    axolotl, total = await chunk_index_of(rt, corpus, "animals.md", "axolotl")
    pangolin, _ = await chunk_index_of(rt, corpus, "animals.md", "pangolin")
    baobab, plants_total = await chunk_index_of(rt, corpus, "plants.md", "baobab")
    assert pangolin == axolotl + 1 and total >= pangolin + 3, (
        "fixture needs one paragraph per chunk"
    )
    assert baobab == 0

    body = await rest_search(
        client,
        corpus,
        query="axolotl pangolin baobab",
        kb_ids=["coalesce"],
        mode="keyword",
        top_k=3,
        coalesce_neighbors=1,
    )
    hits = body["hits"]
    assert body["coalesced"] == 1
    assert len({h["chunk_id"] for h in hits}) == len(hits), "a chunk appears twice"
    matched = [h for h in hits if h["is_matched"]]
    assert sorted(h["rank"] for h in matched) == [1, 2, 3]
    for h in hits:
        if not h["is_matched"]:
            assert h["score"] is None and h["rank"] is None and h["match_type"] is None
        else:
            assert h["score"] is not None and h["match_type"] == "keyword"

    animals, plants = corpus.ids["animals.md"], corpus.ids["plants.md"]
    layout = [(h["document_id"], h["chunk_index"]) for h in hits]
    animal_window = [(animals, i) for i in range(axolotl - 1, pangolin + 2)]
    plant_window = [(plants, 0), (plants, 1)]
    best = {d: min(h["rank"] for h in matched if h["document_id"] == d) for d in (animals, plants)}
    first, second = sorted((animal_window, plant_window), key=lambda w: best[w[0][0]])
    assert layout == first + second
    assert plants_total > 1


async def test_coalescing_defaults_to_the_kb_and_zero_turns_it_off(stack, corpus):
    """Unset → the KB's coalesce_neighbors (1 here); 0 → matched chunks only; 5 → up to
    five each side, clipped to the document."""
    rt, client = stack
    query = {"query": "capybara", "kb_ids": ["coalesce"], "mode": "keyword", "top_k": 1}
    default = await rest_search(client, corpus, **query)
    assert default["coalesced"] == 1
    assert [h["is_matched"] for h in default["hits"]] == [False, True, False]
    off = await rest_search(client, corpus, **query, coalesce_neighbors=0)
    assert off["coalesced"] == 0 and [h["is_matched"] for h in off["hits"]] == [True]
    wide = await rest_search(client, corpus, **query, coalesce_neighbors=5)
    capybara, total = await chunk_index_of(rt, corpus, "animals.md", "capybara")
    assert [h["chunk_index"] for h in wide["hits"]] == list(
        range(max(0, capybara - 5), min(total, capybara + 6))
    )


async def test_get_chunk_with_neighbours(stack, corpus):
    """GET /v1/chunks/{id}?neighbors=N: the chunk itself, then up to N chunks each side in
    chunk order, marked is_matched false; clipped at the document's start."""
    _, client = stack
    body = await rest_search(
        client,
        corpus,
        query="pangolin",
        kb_ids=["coalesce"],
        mode="keyword",
        top_k=1,
        coalesce_neighbors=0,
    )
    [hit] = body["hits"]
    r = await client.get(f"/v1/chunks/{hit['chunk_id']}?neighbors=2", headers=corpus.auth())
    assert r.status_code == 200, r.text
    chunk = r.json()
    assert chunk["chunk"]["chunk_id"] == hit["chunk_id"]
    assert chunk["chunk"]["content"] == hit["content"] and "pangolin" in hit["content"]
    i = hit["chunk_index"]
    assert [n["chunk_index"] for n in chunk["neighbors"]] == [i - 2, i - 1, i + 1, i + 2]
    assert all(not n["is_matched"] and n["score"] is None for n in chunk["neighbors"])

    body = await rest_search(
        client,
        corpus,
        query="quokka",
        kb_ids=["coalesce"],
        mode="keyword",
        top_k=1,
        coalesce_neighbors=0,
    )
    first = body["hits"][0]
    assert first["chunk_index"] == 0
    r = await client.get(
        f"/v1/chunks/{first['chunk_id']}",
        params={"neighbors": 3, "kb": "coalesce"},
        headers=corpus.auth(),
    )
    assert [n["chunk_index"] for n in r.json()["neighbors"]] == [1, 2, 3]
    r = await client.get(f"/v1/chunks/{first['chunk_id']}", headers=corpus.auth())
    assert r.json()["neighbors"] == []


async def test_get_chunk_errors(stack, corpus):
    """Unknown chunk → 404; malformed id → 422 naming chunk_id; neighbors over 5 → 422."""
    _, client = stack
    r = await client.get("/v1/chunks/00000000-0000-0000-0000-000000000000", headers=corpus.auth())
    assert r.status_code == 404, r.text
    r = await client.get("/v1/chunks/not-a-chunk", headers=corpus.auth())
    assert r.status_code == 422 and "chunk_id" in r.json()["detail"], r.text
    r = await client.get(
        "/v1/chunks/00000000-0000-0000-0000-000000000000?neighbors=6", headers=corpus.auth()
    )
    assert r.status_code == 422 and "neighbors" in r.json()["detail"], r.text


# ---- org isolation -----------------------------------------------------------------------------

ISOLATION_QUERIES = [IDENTIFIER, PARAPHRASE, FILTER_QUERY, "handbook"]


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
async def test_org_isolation_in_every_mode(stack, corpus, mode):
    """The second org holds identical documents, some in the same Qdrant collection as the
    first org's: across every KB, with neighbours, and even when asking for the other org's
    document ids, neither org ever sees the other's documents."""
    rt, client = stack
    mine = set(corpus.ids.values())
    for query in ISOLATION_QUERIES:
        for org, own, foreign in (
            ("local", mine, corpus.other_ids),
            (OTHER_ORG, corpus.other_ids, mine),
        ):
            body = await rest_search(
                client, corpus, org=org, query=query, mode=mode, top_k=50, coalesce_neighbors=2
            )
            found = doc_ids(body["hits"])
            assert found <= own and not found & foreign, (org, query)
            # Keyword search has nothing to match the paraphrase with; all else finds some.
            assert found or (mode, query) == ("keyword", PARAPHRASE)
            resp = await service_search(rt, org=org, query=query, mode=mode, top_k=50)
            assert doc_ids(resp.hits) <= own
    asked = await rest_search(
        client,
        corpus,
        query=FILTER_QUERY,
        mode=mode,
        top_k=50,
        filters={"document_ids": sorted(corpus.other_ids)},
    )
    assert asked["hits"] == []


async def test_org_isolation_for_kbs_and_chunks(stack, corpus):
    """Another org's chunk id is not found; its KBs cannot be named; kb_ids omitted covers
    only the caller's KBs."""
    _, client = stack
    body = await rest_search(client, corpus, org=OTHER_ORG, query=IDENTIFIER, top_k=1)
    shared = await rest_search(
        client, corpus, org=OTHER_ORG, query=FILTER_QUERY, top_k=1, kb_ids=["default"]
    )
    for hit in (body["hits"][0], shared["hits"][0]):
        foreign_chunk = hit["chunk_id"]
        r = await client.get(f"/v1/chunks/{foreign_chunk}?neighbors=1", headers=corpus.auth())
        assert r.status_code == 404, r.text
        r = await client.get(f"/v1/chunks/{foreign_chunk}", headers=corpus.auth(OTHER_ORG))
        assert r.status_code == 200
    assert shared["hits"][0]["kb_id"] == "default"
    other_kbs = set(body["kb_ids"])
    mine = await rest_search(client, corpus, query=IDENTIFIER)
    assert set(mine["kb_ids"]) == {"default", corpus.kbs["modes"], corpus.kbs["coalesce"]}
    private = other_kbs - {"default"}
    assert private
    r = await client.post(
        "/v1/search", json={"query": "x", "kb_ids": sorted(private)}, headers=corpus.auth()
    )
    assert r.status_code == 404, r.text


# ---- validation --------------------------------------------------------------------------------

MALFORMED: dict[str, tuple[dict[str, Any], list[str]]] = {
    "unknown-operator": (
        {"filters": {"metadata": [{"key": "year", "contains": 2}]}},
        ["filters.metadata.0.contains"],
    ),
    "unknown-filter-field": ({"filters": {"author": "me"}}, ["filters.author"]),
    "unknown-top-level-field": ({"filter": {"tags": ["x"]}}, ["filter"]),
    "tags-not-a-list": ({"filters": {"tags": "hr"}}, ["filters.tags", "list"]),
    "range-not-a-number": (
        {"filters": {"metadata": [{"key": "year", "gte": "recent"}]}},
        ["filters.metadata.0.gte"],
    ),
    "date-not-a-date": ({"filters": {"upload_date_to": "yesterday"}}, ["upload_date_to"]),
    "eq-object": (
        {"filters": {"metadata": [{"key": "year", "eq": {"$ne": 0}}]}},
        ["filters.metadata.0.eq"],
    ),
    "inverted-upload-dates": (
        {"filters": {"upload_date_from": "2025-01-01", "upload_date_to": "2024-01-01"}},
        ["filters", "upload_date_from", "inverted"],
    ),
    "inverted-metadata-dates": (
        {
            "filters": {
                "metadata": [
                    {
                        "key": "reviewed",
                        "date_from": "2025-01-01T00:00:00Z",
                        "date_to": "2024-01-01T00:00:00Z",
                    }
                ]
            }
        },
        ["filters.metadata.0", "'reviewed'", "inverted"],
    ),
    "inverted-numeric-range": (
        {"filters": {"metadata": [{"key": "year", "gte": 2025, "lte": 2020}]}},
        ["'year'", "inverted"],
    ),
    "dotted-metadata-key": (
        {"filters": {"metadata": [{"key": "x.org_id", "eq": "local"}]}},
        ["filters.metadata.0.key", "'x.org_id'", "no dots"],
    ),
    "path-metadata-key": (
        {"filters": {"metadata": [{"key": "tags[]", "eq": "x"}]}},
        ["filters.metadata.0.key"],
    ),
    "no-condition": ({"filters": {"metadata": [{"key": "year"}]}}, ["exactly one of"]),
    "top-k-zero": ({"top_k": 0}, ["top_k"]),
    "top-k-51": ({"top_k": 51}, ["top_k"]),
    "top-k-text": ({"top_k": "many"}, ["top_k"]),
    "neighbours-over-5": ({"coalesce_neighbors": 6}, ["coalesce_neighbors"]),
    "unknown-mode": ({"mode": "fuzzy"}, ["mode"]),
    "blank-query": ({"query": "  "}, ["query"]),
}


@pytest.mark.parametrize(("body", "names"), MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_search_gets_422_naming_the_problem(stack, corpus, body, names):
    _, client = stack
    r = await client.post("/v1/search", json={"query": "x", **body}, headers=corpus.auth())
    assert r.status_code == 422, r.text
    problem = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    for name in names:
        assert name in problem["detail"], problem["detail"]


async def test_rest_search_runs_through_the_route_behind_every_middleware(stack, corpus):
    """`POST /v1/search` has one path: FastAPI's route, behind the same middleware as every
    route (a middleware added to the app sees each search, answered or refused), with the
    route's own validation and problem answers."""
    _, client = stack
    app = client._transport.app
    assert not any(hasattr(app, name) for name in ("fast_search", "routed"))
    seen: list[tuple[str, int]] = []
    inner = app.middleware_stack or app.build_middleware_stack()

    async def watching(scope, receive, send):
        async def send_seen(message):
            if message["type"] == "http.response.start":
                seen.append((scope["path"], message["status"]))
            await send(message)

        await inner(scope, receive, send_seen)

    app.middleware_stack = watching
    try:
        body = {"query": FILTER_QUERY, "kb_ids": ["default"], "top_k": 10, "mode": "hybrid"}
        ok = await client.post("/v1/search", json=body, headers=corpus.auth())
        assert ok.status_code == 200 and len(ok.json()["hits"]) == len(FILTER_DOCS)
        refused = await client.post("/v1/search", json={"query": ""}, headers=corpus.auth())
        assert refused.status_code == 422
        assert refused.headers["content-type"] == "application/problem+json"
    finally:
        app.middleware_stack = inner
    assert seen == [("/v1/search", 200), ("/v1/search", 422)]
    assert list(app.openapi()["paths"]["/v1/search"]) == ["post"]


async def test_top_k_bounds_are_inclusive(stack, corpus):
    """top_k 1 and 50 are accepted; 50 returns every match of a small KB."""
    _, client = stack
    one = await rest_search(client, corpus, query=FILTER_QUERY, kb_ids=["default"], top_k=1)
    assert len(one["hits"]) == 1
    many = await rest_search(client, corpus, query=FILTER_QUERY, kb_ids=["default"], top_k=50)
    assert len(many["hits"]) == len(FILTER_DOCS)
    default = await rest_search(client, corpus, query=IDENTIFIER, kb_ids=["modes"])
    assert len(default["hits"]) == 5


async def test_unknown_kb_is_404(stack, corpus):
    _, client = stack
    r = await client.post(
        "/v1/search", json={"query": "x", "kb_ids": ["nope"]}, headers=corpus.auth()
    )
    assert r.status_code == 404 and "nope" in r.json()["detail"], r.text


# ---- query embedding cache -----------------------------------------------------------------


async def test_repeated_query_embeds_nothing_new(stack, corpus, embedders):
    """A repeated query is answered from the query-embedding LRU: the model embeds nothing."""
    rt, client = stack
    model = embedders.get("local/all-MiniLM-L6-v2")
    query = {"query": "a query asked twice about sourdough starters", "kb_ids": ["modes"]}
    await rest_search(client, corpus, **query)
    embedded, hits = model.embed_count, rt.search.query_vectors.hits
    again = await rest_search(client, corpus, **query)
    await rest_search(client, corpus, **query, mode="dense")
    assert model.embed_count == embedded
    assert rt.search.query_vectors.hits == hits + 2
    assert again["hits"]


async def test_scoped_key_searches_only_its_kbs(stack, corpus):
    """A key limited to one KB: kb_ids omitted means that KB alone; naming another is 404."""
    rt, client = stack
    token = await OperatorKeys(rt).create(
        "local", name="modes only", kb_ids=[corpus.kbs["modes"]], read_only=True
    )
    headers = {"Authorization": f"Bearer {token}"}
    r = await client.post("/v1/search", json={"query": FILTER_QUERY, "top_k": 50}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["kb_ids"] == [corpus.kbs["modes"]]
    assert {h["kb_id"] for h in r.json()["hits"]} == {corpus.kbs["modes"]}
    r = await client.post(
        "/v1/search", json={"query": FILTER_QUERY, "kb_ids": ["default"]}, headers=headers
    )
    assert r.status_code == 404, r.text


async def test_a_malformed_request_on_the_bus_gets_an_error_reply_and_search_answers_on(stack):
    """Bytes that are not a search request, sent straight to `search.query`, come back as a
    `ValidationError` body; the responder goes on answering."""
    rt, _ = stack
    assert rt.bus.nc is not None
    for junk in (b"not json", b'{"query": 3}', b"\xff\xfe", b"[" * 10_000):
        reply = await rt.bus.nc.request("search.query", junk, timeout=10)
        error = json.loads(reply.data)["error"]
        assert error["error_type"] == "ValidationError", error
    reply = await rt.bus.request(
        "search.query", SearchRequest(query="anything", org_id="any-org"), timeout=10
    )
    assert reply["result"]["hits"] == []  # an org without KBs: answered, nothing found
