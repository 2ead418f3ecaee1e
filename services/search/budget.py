"""Token budgets: pack ranked, coalesced hits into what an agent can afford to read.

Tokens are counted with cl100k_base (the tokenizer litellm ships, so nothing is downloaded):
close to what current chat models count, and the same count whatever model the KBs embed
with. Whole chunks only: a chunk that does not fit is left out, never cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from services.common.messages.queries import Budget, OmittedHit, SearchHit

Counter = Callable[[str], int]


def pack(
    hits: Sequence[SearchHit], max_tokens: int, count: Counter
) -> tuple[list[SearchHit], Budget]:
    """Keep the best matches with their neighbours while they fit, in rank order.

    `hits` is a coalesced result: documents in the order of their best match, each
    document's chunks in chunk order. Each matched chunk is taken with its neighbours (the
    chunks up to the next match) when the whole window fits; else alone, its neighbours
    dropped; else it is left out and reported, and packing goes on with the next match, so
    that a long chunk does not hide shorter good ones after it."""
    units = _units(hits)
    kept: set[int] = set()
    used = 0
    omitted: list[OmittedHit] = []
    dropped_neighbours = 0
    for match, window in sorted(units, key=lambda u: hits[u[0]].rank or 0):
        sizes = {i: count(hits[i].content) for i in window}
        whole = sum(sizes.values())
        if used + whole <= max_tokens:
            kept.update(window)
            used += whole
        elif used + sizes[match] <= max_tokens:
            kept.add(match)
            used += sizes[match]
            dropped_neighbours += len(window) - 1
        else:
            hit = hits[match]
            omitted.append(
                OmittedHit(
                    chunk_id=hit.chunk_id,
                    document_name=hit.document_name,
                    rank=hit.rank or 0,
                    tokens=whole,
                )
            )
    budget = Budget(
        max_tokens=max_tokens,
        used_tokens=used,
        omitted=omitted,
        omitted_neighbors=dropped_neighbours,
    )
    return [h for i, h in enumerate(hits) if i in kept], budget


def _units(hits: Sequence[SearchHit]) -> list[tuple[int, list[int]]]:
    """(index of a matched chunk, indexes of it and the neighbours that belong to it).

    Within a document, a neighbour belongs to the nearest match before it, or (before the
    document's first match) to that first match."""
    units: list[tuple[int, list[int]]] = []
    pending: list[int] = []  # neighbours before the document's first match
    current: list[int] | None = None
    document: tuple[str, str] | None = None
    for i, hit in enumerate(hits):
        doc = (hit.kb_id, hit.document_id)
        if doc != document:
            document, current, pending = doc, None, []
        if hit.is_matched:
            current = [*pending, i]
            pending = []
            units.append((i, current))
        elif current is not None:
            current.append(i)
        else:
            pending.append(i)
    return units


_encoding: Any = None


def count_tokens(text: str) -> int:
    global _encoding
    if _encoding is None:
        from services.common.outbound.modelcalls import import_litellm

        _encoding = import_litellm().encoding
    return len(_encoding.encode(text, disallowed_special=()))


async def load_counter() -> Counter:
    """The counter, its first use (litellm's import, the BPE file) off the event loop."""
    await asyncio.to_thread(count_tokens, "")
    return count_tokens
