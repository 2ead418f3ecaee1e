"""Which document a candidate chunk belongs to, without reading its payload on every search.

Ranking groups candidates by document (a document's opening lends its chunks a prior), so
every candidate needs its document id. Reading it with the candidate lists costs the
engine a payload read per point, about 6 us in Qdrant Edge and 400 points a hybrid search:
2.7 of a 1,000-chunk KB's 3.2 ms of candidate lists, 3.4 of 6.1 ms at 100k chunks
(docs/benchmarks.md). The answer never changes: a point id is derived from its KB,
document and chunk index (`ids.point_id`), so an id names one document for good and a
remembered answer cannot go stale (a point deleted since is simply not returned again).
Ids not seen before are read in one lookup per search.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from services.common.store import VectorStore


class DocumentIds:
    def __init__(self, store: VectorStore, max_points: int = 200_000) -> None:
        self.store = store
        self.max_points = max_points
        self._of: dict[str, str] = {}  # point id → document id, oldest first
        self.reads = 0  # points read from the store (the rest were remembered)

    async def get(self, collection: str, ids: Iterable[str]) -> dict[str, str]:
        """Document id by point id; points the collection no longer holds are left out."""
        wanted = list(dict.fromkeys(ids))
        known = self._of
        missing = [i for i in wanted if i not in known]
        found = {i: known[i] for i in wanted if i in known}
        if missing:
            self.reads += len(missing)
            for hit in await self.store.retrieve(collection, missing):
                found[hit.id] = known[hit.id] = hit.payload["document_id"]
            # Oldest first out: about 250 bytes a point, 50 MB at the default bound.
            for key in list(islice(known, max(0, len(known) - self.max_points))):
                del known[key]
        return found
