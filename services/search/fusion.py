"""Pure result shaping: fusion of candidate lists (across KBs too) and neighbour coalescing.

Ranking in one picture. Every KB searched contributes candidate lists: its chunks by dense
similarity and by BM25, and the same two restricted to documents' first chunks ("lead"
lists). Lists that share a scale are merged into one by score before anything is fused, so
several KBs rank as one KB would: dense lists of KBs with the same embedding model (cosines
are comparable), and BM25 lists of every KB (the same tokenizer and weighting everywhere).
Dense lists of different models stay separate lists and meet by rank only.

Chunks are fused by reciprocal rank over the chunk lists. The lead lists do not compete as
candidates: they give each document a prior (how well its opening matches the query), which
scales its chunks' fused scores by at most `1 + lead_weight`, and less when no opening
matches the query nearly as well as the best chunk does (see `fuse`). A document whose
opening matches lifts its matching chunks, wherever they are; it never lifts a chunk that
the chunk lists did not find, nor a weak chunk match above a strong one by more than that
factor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal, NamedTuple

from services.common.messages.queries import SearchHit

DocKey = tuple[str, str]  # (kb_id, document_id)
ChunkKey = tuple[str, str]  # (kb_id, chunk_id)
Signal = Literal["dense", "keyword"]
_SCORE = attrgetter("score")  # of a Candidate or a Fused


class Candidate(NamedTuple):  # hundreds per search: a tuple is the cheapest to build
    chunk: ChunkKey
    document: DocKey
    score: float  # what ordered its list: cosine, or raw BM25


@dataclass(frozen=True)
class CandidateList:
    """One engine search of one KB, best first."""

    signal: Signal
    lead: bool  # restricted to documents' first chunks
    scale: str  # lists with the same signal, lead flag and scale are merged by score
    candidates: Sequence[Candidate]


class Fused(NamedTuple):  # one per candidate chunk of every search, as Candidate
    chunk: ChunkKey
    document: DocKey
    score: float  # 0..1, see `fuse`


def merge_by_scale(lists: Sequence[CandidateList]) -> list[CandidateList]:
    """Lists on one scale (same signal, lead flag and scale) become one list by score."""
    groups: dict[tuple[Signal, bool, str], list[CandidateList]] = {}
    for ranked in lists:
        groups.setdefault((ranked.signal, ranked.lead, ranked.scale), []).append(ranked)
    return [
        # A list alone on its scale (one KB searched) is already best first.
        found[0]
        if len(found) == 1
        else CandidateList(
            signal,
            lead,
            scale,
            sorted((c for ranked in found for c in ranked.candidates), key=_SCORE, reverse=True),
        )
        for (signal, lead, scale), found in groups.items()
    ]


def fuse(
    lists: Sequence[CandidateList], *, k: int, lead_weight: float, lead_floor: float
) -> list[Fused]:
    """Chunks ranked by reciprocal rank fusion of the chunk lists, scaled by their document's
    lead prior; best first. Ties keep the order in which chunks were first seen.

    The prior's weight adapts to the query: in full when the best document opening scores as
    well as the best chunk (the query says what a document is about), fading to nothing when
    it scores `lead_floor` of it or less (the answer is a passage inside a document).

    The score is normalised to 0..1: 1.0 is a chunk ranked first by every signal of the mode
    whose document's opening is ranked first by every signal too."""
    merged = merge_by_scale(lists)
    signals = {ranked.signal for ranked in merged if not ranked.lead}
    chunk_score: dict[ChunkKey, float] = {}
    document: dict[ChunkKey, DocKey] = {}
    prior: dict[DocKey, float] = {}
    # (Hundreds of candidates a search: the loops below are written for speed; k + rank
    # counted from k + 1 is the same integer, so the same floats, as k plus a rank from 1.)
    for ranked in merged:
        if ranked.lead:
            for rank, c in enumerate(ranked.candidates, start=k + 1):
                prior[c.document] = prior.get(c.document, 0.0) + 1.0 / rank
        else:
            for rank, c in enumerate(ranked.candidates, start=k + 1):
                chunk = c.chunk
                chunk_score[chunk] = chunk_score.get(chunk, 0.0) + 1.0 / rank
                if chunk not in document:
                    document[chunk] = c.document
    # Both normalised by their best possible value: rank 1 in each signal's list.
    best = len(signals) / (k + 1) if signals else 1.0
    boost = lead_weight * lead_agreement(merged, lead_floor) if prior else 0.0
    fused = [
        Fused(
            chunk,
            document[chunk],
            (s / best)
            * (1 + boost * min(1.0, prior.get(document[chunk], 0.0) / best))
            / (1 + lead_weight),
        )
        for chunk, s in chunk_score.items()
    ]
    # Stable, so ties keep the order in which chunks were first seen.
    fused.sort(key=_SCORE, reverse=True)
    return fused


def lead_agreement(merged: Sequence[CandidateList], floor: float) -> float:
    """0..1: how close the best document opening comes to the best chunk, per list of chunks
    (best lead score / best chunk score on the same scale, mapped from floor..1 to 0..1),
    averaged over those lists."""
    leads = {(r.signal, r.scale): r for r in merged if r.lead and r.candidates}
    shares = []
    for ranked in merged:
        if ranked.lead or not ranked.candidates:
            continue
        top = ranked.candidates[0].score
        lead = leads.get((ranked.signal, ranked.scale))
        ratio = lead.candidates[0].score / top if lead is not None and top > 0 else 0.0
        shares.append(min(1.0, max(0.0, (ratio - floor) / (1 - floor))))
    return sum(shares) / len(shares) if shares else 0.0


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
