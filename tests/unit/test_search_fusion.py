"""Result shaping in services/search/fusion.py: rank fusion across KBs and neighbour
coalescing, on hand-made hits."""

from __future__ import annotations

from services.common.messages.queries import SearchHit
from services.search.fusion import (
    Candidate,
    CandidateList,
    Fused,
    Signal,
    coalesce,
    fuse,
    neighbour_windows,
)


def hit(
    doc: str,
    index: int,
    *,
    kb: str = "kb1",
    total: int = 10,
    score: float | None = 0.5,
    rank: int | None = None,
) -> SearchHit:
    return SearchHit(
        chunk_id=f"{kb}-{doc}-{index}",
        kb_id=kb,
        document_id=doc,
        document_name=doc,
        chunk_index=index,
        total_chunks=total,
        content=f"{doc} #{index}",
        score=score,
        rank=rank,
        match_type="hybrid" if score is not None else None,
    )


def neighbour(doc: str, index: int, *, kb: str = "kb1", total: int = 10) -> SearchHit:
    return hit(doc, index, kb=kb, total=total, score=None)


# ---- fuse --------------------------------------------------------------------------------------


def ranked(
    signal: Signal, kb: str, *chunks: tuple[str, float], lead: bool = False, scale: str = "m"
) -> CandidateList:
    """A candidate list of `kb`: chunk ids "doc:index" with their list scores, best first."""
    return CandidateList(
        signal,
        lead,
        scale if signal == "dense" else "bm25",
        [Candidate((kb, c), (kb, c.split(":")[0]), score) for c, score in chunks],
    )


def order(fused: list[Fused]) -> list[str]:
    return [f.chunk[1] for f in fused]


def test_kbs_of_one_model_rank_as_one_kb_by_score() -> None:
    """Split over two KBs, the same candidates fuse as in one KB: lists on one scale are
    merged by score, so a KB's first place is not worth more than its score."""
    one = fuse(
        [
            ranked("dense", "all", ("a:0", 0.9), ("b:0", 0.8), ("c:0", 0.3)),
            ranked("keyword", "all", ("b:0", 9.0), ("a:0", 8.0), ("c:0", 1.0)),
        ],
        k=10,
        lead_weight=0,
        lead_floor=0.7,
    )
    split = fuse(
        [
            ranked("dense", "kb1", ("a:0", 0.9), ("b:0", 0.8)),
            ranked("keyword", "kb1", ("b:0", 9.0), ("a:0", 8.0)),
            ranked("dense", "kb2", ("c:0", 0.3)),
            ranked("keyword", "kb2", ("c:0", 1.0)),
        ],
        k=10,
        lead_weight=0,
        lead_floor=0.7,
    )
    assert order(one) == order(split)[: len(one)] == ["a:0", "b:0", "c:0"]
    assert [f.score for f in one] == [f.score for f in split]


def test_an_unrelated_kb_does_not_put_its_best_hit_first() -> None:
    """An unrelated KB's best hit scores below the related KB's good ones in every signal:
    it ranks below them, not level with the related KB's first place."""
    fused = fuse(
        [
            ranked("dense", "docs", ("a:0", 0.71), ("b:2", 0.69), ("c:1", 0.65)),
            ranked("keyword", "docs", ("b:2", 7.5), ("a:0", 7.1), ("c:1", 6.0)),
            ranked("dense", "other", ("x:0", 0.21), ("y:3", 0.18)),
            ranked("keyword", "other", ("x:0", 1.2)),
        ],
        k=10,
        lead_weight=0,
        lead_floor=0.7,
    )
    assert order(fused)[:3] == ["a:0", "b:2", "c:1"]
    assert {"x:0", "y:3"} <= set(order(fused)[3:])


def test_different_models_meet_by_rank_with_bm25_shared() -> None:
    """Dense lists of two models are never compared by score; BM25 (one scale everywhere)
    decides between their first places."""
    fused = fuse(
        [
            ranked("dense", "kb1", ("a:0", 0.30), scale="model-a"),
            ranked("dense", "kb2", ("x:0", 0.95), scale="model-b"),
            ranked("keyword", "kb1", ("a:0", 5.0)),
            ranked("keyword", "kb2", ("x:0", 2.0)),
        ],
        k=10,
        lead_weight=0,
        lead_floor=0.7,
    )
    assert order(fused) == ["a:0", "x:0"]


def test_scores_are_0_to_1_and_decrease_with_rank() -> None:
    lists = [
        ranked("dense", "kb", ("a:0", 0.9), ("b:1", 0.8), ("c:0", 0.7)),
        ranked("keyword", "kb", ("a:0", 5.0), ("c:0", 4.0)),
        ranked("dense", "kb", ("a:0", 0.9), ("c:0", 0.7), lead=True),
        ranked("keyword", "kb", ("a:0", 5.0), ("c:0", 4.0), lead=True),
    ]
    fused = fuse(lists, k=10, lead_weight=0.5, lead_floor=0.7)
    scores = [f.score for f in fused]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] == 1.0  # first in every list, and its document's opening too
    assert all(0 < s <= 1 for s in scores)


def test_lead_prior_lifts_a_documents_matching_chunks_not_its_first_chunk_alone() -> None:
    """The prior is a document's: a document whose opening matches lifts its mid-document
    chunk that the chunk lists found; an opening that the chunk lists did not find at all
    is not added as a candidate."""
    lists = [
        ranked("dense", "kb", ("other:4", 0.61), ("doc:7", 0.60)),
        ranked("keyword", "kb", ("other:4", 6.1), ("doc:7", 6.0)),
        ranked("dense", "kb", ("doc:0", 0.6), lead=True),
        ranked("keyword", "kb", ("doc:0", 6.0), lead=True),
    ]
    assert order(fuse(lists, k=10, lead_weight=0, lead_floor=0.7)) == ["other:4", "doc:7"]
    assert order(fuse(lists, k=10, lead_weight=0.5, lead_floor=0.7)) == ["doc:7", "other:4"]


def test_the_prior_fades_when_no_opening_matches_like_the_best_chunk() -> None:
    """The best opening scores far below the best chunk (the answer is inside a document):
    the prior steps back and the chunk lists decide."""
    lists = [
        ranked("dense", "kb", ("other:4", 0.61), ("doc:7", 0.60)),
        ranked("keyword", "kb", ("other:4", 6.1), ("doc:7", 6.0)),
        ranked("dense", "kb", ("doc:0", 0.3), lead=True),
        ranked("keyword", "kb", ("doc:0", 2.0), lead=True),
    ]
    assert order(fuse(lists, k=10, lead_weight=0.5, lead_floor=0.7)) == ["other:4", "doc:7"]


def test_the_prior_never_lifts_a_weak_chunk_match_over_a_strong_one() -> None:
    """A chunk far down the lists gains at most the factor 1 + lead_weight: not enough to
    pass a chunk ranked first by every signal."""
    weak = [(f"w{i}:3", 0.5 - i / 100) for i in range(20)]
    lists = [
        ranked("dense", "kb", ("strong:5", 0.8), *weak),
        ranked(
            "keyword", "kb", ("strong:5", 9.0), *[(c, 8 - i / 10) for i, (c, _) in enumerate(weak)]
        ),
        ranked("dense", "kb", ("w19:0", 0.9), lead=True),
        ranked("keyword", "kb", ("w19:0", 9.0), lead=True),
    ]
    assert order(fuse(lists, k=10, lead_weight=0.5, lead_floor=0.7))[0] == "strong:5"


def test_fusing_nothing_is_empty() -> None:
    assert fuse([], k=10, lead_weight=0.5, lead_floor=0.7) == []


# ---- neighbour_windows -------------------------------------------------------------------------


def test_windows_merge_adjacent_matches_and_exclude_the_matches() -> None:
    """Matches 3 and 4 with N=1 need 2 and 5 only; each index once."""
    windows = neighbour_windows([hit("d", 3), hit("d", 4)], 1)
    assert windows == {("kb1", "d"): [2, 5]}


def test_windows_are_clipped_to_the_document() -> None:
    """No index below 0 or at/after total_chunks."""
    windows = neighbour_windows([hit("d", 0, total=3), hit("e", 2, total=3)], 2)
    assert windows == {("kb1", "d"): [1, 2], ("kb1", "e"): [0, 1]}


def test_windows_per_kb_width_and_nothing_for_zero() -> None:
    """A mapping gives each KB its own N; a KB with N=0 (or missing) fetches nothing."""
    matched = [hit("d", 5, kb="wide"), hit("d", 5, kb="none"), hit("d", 5, kb="unknown")]
    windows = neighbour_windows(matched, {"wide": 2, "none": 0})
    assert windows == {("wide", "d"): [3, 4, 6, 7]}
    assert neighbour_windows([hit("d", 5)], 0) == {}


def test_windows_keep_the_same_document_in_two_kbs_apart() -> None:
    windows = neighbour_windows([hit("d", 1, kb="a"), hit("d", 1, kb="b")], 1)
    assert windows == {("a", "d"): [0, 2], ("b", "d"): [0, 2]}


# ---- coalesce ----------------------------------------------------------------------------------


def test_coalesce_adjacent_matches_yield_one_window_without_duplicates() -> None:
    """Matches at 3 (rank 2) and 4 (rank 1) with neighbours 2 and 5 → chunks 2,3,4,5 once
    each, in chunk order; matches keep score and rank; neighbours have neither."""
    matched = [hit("d", 4, rank=1, score=0.9), hit("d", 3, rank=2, score=0.8)]
    # The neighbour list may repeat chunks or include matched chunks: neither shows twice.
    neighbours = [neighbour("d", 5), neighbour("d", 2), neighbour("d", 3), neighbour("d", 5)]
    out = coalesce(matched, neighbours)
    assert [h.chunk_index for h in out] == [2, 3, 4, 5]
    assert len({h.chunk_id for h in out}) == len(out)
    by_index = {h.chunk_index: h for h in out}
    assert (by_index[4].rank, by_index[4].score, by_index[4].is_matched) == (1, 0.9, True)
    assert (by_index[3].rank, by_index[3].score, by_index[3].is_matched) == (2, 0.8, True)
    for i in (2, 5):
        assert by_index[i].is_matched is False
        assert by_index[i].score is None and by_index[i].rank is None
        assert by_index[i].match_type is None


def test_coalesce_groups_by_document_in_order_of_best_match() -> None:
    """Documents appear in the order of their best-ranked match, each as one contiguous
    group in chunk order, even when their matches interleave in rank."""
    matched = [
        hit("b", 7, rank=1),
        hit("a", 2, rank=2),
        hit("b", 1, rank=3),
        hit("a", 0, rank=4),
    ]
    neighbours = [neighbour("a", 1), neighbour("b", 8), neighbour("b", 6), neighbour("b", 0)]
    out = coalesce(matched, neighbours)
    assert [(h.document_id, h.chunk_index) for h in out] == [
        ("b", 0),
        ("b", 1),
        ("b", 6),
        ("b", 7),
        ("b", 8),
        ("a", 0),
        ("a", 1),
        ("a", 2),
    ]
    assert [h.rank for h in out if h.is_matched] == [3, 1, 4, 2]


def test_coalesce_drops_neighbours_of_documents_without_a_match() -> None:
    out = coalesce([hit("a", 1, rank=1)], [neighbour("a", 0), neighbour("stray", 0)])
    assert [(h.document_id, h.chunk_index) for h in out] == [("a", 0), ("a", 1)]


def test_coalesce_without_neighbours_keeps_matches_grouped() -> None:
    matched = [hit("a", 5, rank=1), hit("b", 0, rank=2), hit("a", 1, rank=3)]
    out = coalesce(matched, [])
    assert [(h.document_id, h.chunk_index) for h in out] == [("a", 1), ("a", 5), ("b", 0)]
    assert all(h.is_matched for h in out)
