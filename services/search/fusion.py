"""Pure result shaping: rank fusion across KBs and neighbour coalescing."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

from services.common.queries import SearchHit

T = TypeVar("T")
DocKey = tuple[str, str]  # (kb_id, document_id)


def rrf_merge(
    ranked_lists: Sequence[Sequence[T]],
    k: int = 60,
    key: Callable[[T], Hashable] = id,
) -> list[T]:
    """Reciprocal rank fusion of already-ranked lists: scores of different models are never
    compared, only ranks. An item (by `key`) in several lists sums its contributions and is
    returned once, as first seen. Ties keep first-seen order (earlier lists first)."""
    scores: dict[Hashable, float] = {}
    items: dict[Hashable, T] = {}
    for ranked in ranked_lists:
        for rank, item in enumerate(ranked, start=1):
            ident = key(item)
            items.setdefault(ident, item)
            scores[ident] = scores.get(ident, 0.0) + 1.0 / (k + rank)
    order = {ident: i for i, ident in enumerate(items)}
    return [items[i] for i in sorted(scores, key=lambda i: (-scores[i], order[i]))]


def neighbour_windows(
    matched: Sequence[SearchHit], n: int | Mapping[str, int]
) -> dict[DocKey, list[int]]:
    """(kb, document) → chunk indexes to fetch: N on each side of every match (N per KB when
    a mapping), windows merged, clipped to the document, the matches themselves excluded."""
    wanted: dict[DocKey, set[int]] = {}
    have: dict[DocKey, set[int]] = {}
    for hit in matched:
        doc = (hit.kb_id, hit.document_id)
        have.setdefault(doc, set()).add(hit.chunk_index)
        width = n if isinstance(n, int) else n.get(hit.kb_id, 0)
        low = max(0, hit.chunk_index - width)
        high = min(hit.total_chunks - 1, hit.chunk_index + width)
        wanted.setdefault(doc, set()).update(range(low, high + 1))
    out: dict[DocKey, list[int]] = {}
    for doc, indexes in wanted.items():
        missing = indexes - have[doc]
        if missing:
            out[doc] = sorted(missing)
    return out


def coalesce(matched: Sequence[SearchHit], neighbours: Sequence[SearchHit]) -> list[SearchHit]:
    """Group by document (documents in the order of their best match), chunks in chunk
    order, each chunk once. Matched chunks keep score and rank; neighbours have neither,
    are marked `is_matched: false`, and are dropped unless their document has a match."""
    first_rank: dict[DocKey, int] = {}
    chunks: dict[DocKey, dict[int, SearchHit]] = {}
    for position, hit in enumerate(matched):
        doc = (hit.kb_id, hit.document_id)
        first_rank.setdefault(doc, position)
        chunks.setdefault(doc, {}).setdefault(hit.chunk_index, hit)
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
