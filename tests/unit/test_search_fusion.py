"""Result shaping in services/search/fusion.py: rank fusion across KBs and neighbour
coalescing, on hand-made hits."""

from __future__ import annotations

from services.common.queries import SearchHit
from services.search.fusion import coalesce, neighbour_windows, rrf_merge


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


# ---- rrf_merge ---------------------------------------------------------------------------------


def test_rrf_interleaves_lists_by_rank_not_score() -> None:
    """Two lists of equal length: first places come before second places, whatever the raw
    scores; ties go to the earlier list."""
    a = [hit("a1", 0, score=0.01), hit("a2", 0, score=0.009)]
    b = [hit("b1", 0, kb="kb2", score=0.99), hit("b2", 0, kb="kb2", score=0.98)]
    merged = rrf_merge([a, b], k=60, key=lambda h: h.chunk_id)
    assert [h.document_id for h in merged] == ["a1", "b1", "a2", "b2"]


def test_rrf_sums_an_item_found_in_several_lists_and_returns_it_once() -> None:
    """An item ranked second in two lists beats items ranked first in only one."""
    shared = ["x", "shared", "y"]
    merged = rrf_merge([["p", "shared"], ["q", "shared"], shared], k=60, key=lambda s: s)
    assert merged[0] == "shared"
    assert merged.count("shared") == 1
    assert sorted(merged) == sorted({"p", "q", "x", "y", "shared"})


def test_rrf_k_controls_how_much_top_ranks_dominate() -> None:
    """A first place in one list against a fourth place in both: 1/(k+1) vs 2/(k+4), so a
    small k lets the single first place win and the default k lets agreement win."""
    lists = [["solo", "a", "b", "z"], ["c", "d", "e", "z"]]
    assert rrf_merge(lists, k=1, key=str)[0] == "solo"
    assert rrf_merge(lists, k=60, key=str)[0] == "z"


def test_rrf_of_nothing_is_empty_and_of_one_list_keeps_its_order() -> None:
    assert rrf_merge([], key=str) == []
    assert rrf_merge([["c", "a", "b"]], key=str) == ["c", "a", "b"]


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
