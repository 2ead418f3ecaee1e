"""Which document a candidate chunk belongs to, without reading its payload on every search.

Ranking groups candidates by document (a document's opening lends its chunks a prior), so
every candidate needs its document id. Reading it with the candidate lists costs the
engine a payload read per point, 400 points a hybrid search: most of the time of the
candidate lists (docs/benchmarks.md, "Figures behind the code").
The answer never changes: a point id is derived from its KB, document and chunk index
(`ids.point_id`), so an id names one document for good and a remembered answer cannot go
stale (a point deleted since is simply not returned again).

The first search of a collection starts reading all of its points' document ids in the
background, a small page at a time and at most a quarter of the time (the engine holds
the interpreter lock while it reads a page, so searches meanwhile wait a little); until
then, and for points written since, the ids a search has not seen are read in one lookup.

What is remembered is held in flat arrays, not Python objects per point: about 20 bytes a
point plus one string per document, so a replica remembers every chunk of a million-chunk
KB in a few tens of MB (a dict of strings took ~200 bytes a point, and at a bound of 200k
points a larger KB's searches read most of their candidates' payloads again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import numpy as np

from services.common.ops import metrics
from services.common.store import VectorStore

log = logging.getLogger(__name__)

PAGE = 64  # points a background read takes at once
# Chunks whose document id a search replica remembers: ~20 bytes each plus their
# documents' ids, about 100 MB when full. Past it the table starts over (and each
# collection's background read with it), which also sheds the points deleted since.
MAX_POINTS = 4_000_000
# Points remembered in a dict (~180 bytes each) before they join the sorted arrays: at least
# this many, or an eighth of the arrays, since a merge re-sorts them (~10 ms a million points).
MERGE_EVERY = 4096


def _keys(ids: list[str]) -> np.ndarray:
    """Point ids (UUID strings) as rows of two big-endian 64-bit halves, which sort as the
    ids do."""
    raw = b"".join(bytes.fromhex(i.replace("-", "")) for i in ids)
    return np.frombuffer(raw, dtype=">u8").reshape(-1, 2).astype(np.uint64)


class DocumentIds:
    def __init__(self, store: VectorStore, max_points: int = MAX_POINTS) -> None:
        self.store = store
        self.max_points = max_points
        self._reading: dict[str, asyncio.Task[None]] = {}  # collection → its background read
        self.reads = 0  # points looked up by a search (the rest were remembered)
        self._clear()

    def _clear(self) -> None:
        # Sorted by the ids' first half; the second half checks a match (two ids sharing a
        # first half, one chance in 2**64 per pair, then just miss and are read each time).
        self._high = np.empty(0, dtype=np.uint64)
        self._low = np.empty(0, dtype=np.uint64)
        self._document = np.empty(0, dtype=np.int32)  # index into self._names
        self._names: list[str] = []
        self._name_index: dict[str, int] = {}
        self._recent: dict[str, str] = {}  # point id → document id, not merged yet

    def __len__(self) -> int:
        return len(self._high) + len(self._recent)

    def read_all(self, collection: str) -> None:
        """Start remembering every point of the collection, once (in the background)."""
        if collection not in self._reading and self.max_points:
            self._reading[collection] = asyncio.create_task(self._read_all(collection))

    async def _read_all(self, collection: str) -> None:
        offset: str | None = None
        began = time.monotonic()
        points = 0
        metrics.DOCUMENT_ID_READS.inc()
        try:
            # Only while there is room: a table started over reads its collections again.
            while len(self) < self.max_points:
                started = time.monotonic()
                hits, offset = await self.store.page(collection, offset, PAGE, ("document_id",))
                self._remember((hit.id, hit.payload["document_id"]) for hit in hits)
                points += len(hits)
                if offset is None:
                    break
                await asyncio.sleep(3 * (time.monotonic() - started))
            if self._recent:
                self._merge()
            log.info(
                "document_ids_read collection=%s points=%d seconds=%.1f",
                collection,
                points,
                time.monotonic() - began,
            )
        except Exception:  # a search then reads what it needs itself
            log.exception("document_ids_read_failed collection=%s", collection)
        finally:
            metrics.DOCUMENT_ID_READS.dec()

    async def close(self) -> None:
        reading = list(self._reading.values())
        for task in reading:
            task.cancel()
        await asyncio.gather(*reading, return_exceptions=True)

    async def get(self, collection: str, ids: Iterable[str]) -> dict[str, str]:
        """Document id by point id; points the collection no longer holds are left out."""
        wanted = list(dict.fromkeys(ids))  # in order, once each
        found: dict[str, str] = {}
        missing: list[str] = []
        for i, document in zip(wanted, self._lookup(wanted), strict=True):
            if document is None:
                missing.append(i)
            else:
                found[i] = document
        if missing:
            self.reads += len(missing)
            hits = await self.store.retrieve(collection, missing)
            pairs = [(hit.id, hit.payload["document_id"]) for hit in hits]
            found.update(pairs)
            self._remember(pairs)
        return found

    def _lookup(self, ids: list[str]) -> list[str | None]:
        recent = self._recent
        documents: list[str | None] = [recent.get(i) for i in ids]
        if not len(self._high) or not ids:
            return documents
        keys = _keys(ids)
        at = np.searchsorted(self._high, keys[:, 0])
        at[at == len(self._high)] = 0
        hit = (self._high[at] == keys[:, 0]) & (self._low[at] == keys[:, 1])
        names = self._names
        rows = np.flatnonzero(hit)
        for n, d in zip(rows.tolist(), self._document[at[rows]].tolist(), strict=True):
            documents[n] = names[d]
        return documents

    def _remember(self, pairs: Iterable[tuple[str, str]]) -> None:
        self._recent.update(pairs)
        due = max(MERGE_EVERY, len(self._high) // 8)
        if len(self._recent) >= due or (self._recent and len(self) >= self.max_points):
            self._merge()
        metrics.DOCUMENT_IDS.set(len(self))

    def _merge(self) -> None:
        if len(self) > self.max_points:
            # Full: start over. The collections' background reads may run again, reading
            # only the points that still exist.
            log.info("document_ids_start_over points=%d", len(self))
            self._clear()
            self._reading = {c: t for c, t in self._reading.items() if not t.done()}
            return
        ids = list(self._recent)
        index = self._name_index
        documents = np.fromiter(
            (index.setdefault(d, len(index)) for d in self._recent.values()),
            dtype=np.int32,
            count=len(ids),
        )
        self._names.extend(list(index)[len(self._names) :])
        keys = _keys(ids)
        high = np.concatenate([self._high, keys[:, 0]])
        order = np.argsort(high, kind="stable")  # two sorted runs: merged in linear time
        self._high = high[order]
        self._low = np.concatenate([self._low, keys[:, 1]])[order]
        self._document = np.concatenate([self._document, documents])[order]
        self._recent = {}
