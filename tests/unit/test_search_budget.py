"""Token budgets in services/search/budget.py, on hand-made coalesced hits and a word count."""

from __future__ import annotations

from services.common.messages.queries import SearchHit
from services.search.budget import pack


def chunk(doc: str, index: int, words: int, rank: int | None = None) -> SearchHit:
    return SearchHit(
        chunk_id=f"{doc}-{index}",
        kb_id="kb",
        document_id=doc,
        document_name=doc,
        chunk_index=index,
        total_chunks=10,
        content=" ".join(["w"] * words),
        score=None if rank is None else 1 / rank,
        rank=rank,
        is_matched=rank is not None,
    )


def words(text: str) -> int:
    return len(text.split())


def ids(hits: list[SearchHit]) -> list[str]:
    return [h.chunk_id for h in hits]


def test_best_matches_first_whole_chunks_and_a_long_one_skipped_not_cut() -> None:
    """Rank 2 does not fit: it is left out whole and reported, and rank 3 still gets in."""
    hits = [chunk("a", 0, 10, rank=1), chunk("b", 0, 50, rank=2), chunk("c", 0, 10, rank=3)]
    kept, budget = pack(hits, 25, words)
    assert ids(kept) == ["a-0", "c-0"]
    assert budget.used_tokens == 20
    assert [(o.chunk_id, o.rank, o.tokens) for o in budget.omitted] == [("b-0", 2, 50)]


def test_neighbours_come_with_their_match_or_are_dropped_for_it() -> None:
    """Coalesced: a's window (neighbour before, match, neighbour after) fits whole; b's
    window does not, so b's match comes alone and its neighbour is counted as dropped."""
    hits = [
        chunk("a", 2, 5),
        chunk("a", 3, 5, rank=1),
        chunk("a", 4, 5),
        chunk("b", 7, 5, rank=2),
        chunk("b", 8, 20),
    ]
    kept, budget = pack(hits, 21, words)
    assert ids(kept) == ["a-2", "a-3", "a-4", "b-7"]
    assert budget.used_tokens == 20 and budget.omitted == [] and budget.omitted_neighbors == 1


def test_order_of_the_answer_is_kept() -> None:
    """Packing picks by rank but returns the chunks in the coalesced order it was given."""
    hits = [chunk("a", 0, 5, rank=2), chunk("a", 1, 5, rank=1)]
    kept, _ = pack(hits, 100, words)
    assert ids(kept) == ["a-0", "a-1"]


def test_a_budget_too_small_for_anything_returns_nothing_and_says_so() -> None:
    kept, budget = pack([chunk("a", 0, 5, rank=1)], 4, words)
    assert kept == [] and budget.used_tokens == 0 and len(budget.omitted) == 1
