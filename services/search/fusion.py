"""Pure result shaping: rank fusion across KBs and neighbour coalescing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from services.common.queries import SearchHit

T = TypeVar("T")


def rrf_merge(ranked_lists: Sequence[Sequence[T]], k: int = 60) -> list[T]:
    """Reciprocal rank fusion of already-ranked lists: scores of different models are
    never compared, only ranks. Ties keep the order of the first list."""
    scores: dict[int, float] = {}
    items: dict[int, T] = {}
    order: dict[int, int] = {}
    for ranked in ranked_lists:
        for rank, item in enumerate(ranked, start=1):
            ident = id(item)
            items[ident] = item
            order.setdefault(ident, len(order))
            scores[ident] = scores.get(ident, 0.0) + 1.0 / (k + rank)
    return [items[i] for i in sorted(scores, key=lambda i: (-scores[i], order[i]))]


def neighbour_windows(
    matched: Sequence[SearchHit], n: int
) -> dict[tuple[str, str], list[int]]:
    """(kb, document) → chunk indexes to fetch: N on each side of every match, windows
    merged, the matches themselves excluded."""
    wanted: dict[tuple[str, str], set[int]] = {}
    have: dict[tuple[str, str], set[int]] = {}
    for hit in matched:
        doc = (hit.kb_id, hit.document_id)
        have.setdefault(doc, set()).add(hit.chunk_index)
        low = max(0, hit.chunk_index - n)
        high = min(hit.total_chunks - 1, hit.chunk_index + n)
        wanted.setdefault(doc, set()).update(range(low, high + 1))
    return {doc: sorted(idx - have[doc]) for doc, idx in wanted.items() if idx - have[doc]}


def coalesce(matched: Sequence[SearchHit], neighbours: Sequence[SearchHit]) -> list[SearchHit]:
    """Group by document (documents in the order of their best match), chunks in chunk
    order, each chunk once. Matched chunks keep score and rank; neighbours have neither."""
    first_rank: dict[tuple[str, str], int] = {}
    chunks: dict[tuple[str, str], dict[int, SearchHit]] = {}
    for position, hit in enumerate(matched):
        doc = (hit.kb_id, hit.document_id)
        first_rank.setdefault(doc, position)
        chunks.setdefault(doc, {})[hit.chunk_index] = hit
    for hit in neighbours:
        doc = (hit.kb_id, hit.document_id)
        if doc in chunks and hit.chunk_index not in chunks[doc]:
            chunks[doc][hit.chunk_index] = hit.model_copy(
                update={"is_matched": False, "score": None, "rank": None, "match_type": None}
            )
    out: list[SearchHit] = []
    for doc in sorted(first_rank, key=first_rank.__getitem__):
        out.extend(chunks[doc][i] for i in sorted(chunks[doc]))
    return out
