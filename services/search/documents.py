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
then, and for points written since, the ids
a search has not seen are read in one lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from itertools import islice

from services.common.ops import metrics
from services.common.store import VectorStore

log = logging.getLogger(__name__)

PAGE = 64  # points a background read takes at once
# Chunks whose document id a search replica remembers: ~200 bytes each, 40 MB when full,
# the candidates of a few hundred thousand chunks' worth of searches.
MAX_POINTS = 200_000


class DocumentIds:
    def __init__(self, store: VectorStore, max_points: int = MAX_POINTS) -> None:
        self.store = store
        self.max_points = max_points
        self._of: dict[str, str] = {}  # point id → document id, oldest first
        self._reading: dict[str, asyncio.Task[None]] = {}  # collection → its background read
        self.reads = 0  # points looked up by a search (the rest were remembered)

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
            # Only while there is room: past it, each page would push out as many as it adds.
            while len(self._of) < self.max_points:
                started = time.monotonic()
                hits, offset = await self.store.page(collection, offset, PAGE, ("document_id",))
                for hit in hits:
                    self._of.setdefault(hit.id, hit.payload["document_id"])
                points += len(hits)
                self._trim()
                if offset is None:
                    break
                await asyncio.sleep(3 * (time.monotonic() - started))
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
        known = self._of
        found: dict[str, str] = {}
        missing: dict[str, None] = {}  # in order, once each
        for i in ids:
            document = known.get(i)
            if document is None:
                missing[i] = None
            else:
                found[i] = document
        if missing:
            self.reads += len(missing)
            for hit in await self.store.retrieve(collection, list(missing)):
                found[hit.id] = known[hit.id] = hit.payload["document_id"]
            self._trim()
        return found

    def _trim(self) -> None:
        """Oldest first out: about 200 bytes a point, 40 MB at the default bound."""
        for key in list(islice(self._of, max(0, len(self._of) - self.max_points))):
            del self._of[key]
        metrics.DOCUMENT_IDS.set(len(self._of))
