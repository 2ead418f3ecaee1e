"""Vector store: the interface and the factory choosing Edge (embedded) or a Qdrant server."""

from __future__ import annotations

from services.common.settings import Settings
from services.common.store.base import (
    DENSE,
    SPARSE,
    ChunkPoint,
    Condition,
    DateRange,
    Filter,
    HasIds,
    Hit,
    Match,
    MatchAny,
    MatchSubstring,
    MatchText,
    Mode,
    Query,
    Range,
    SparseVector,
    TermStats,
    VectorStore,
)

__all__ = [
    "DENSE",
    "SPARSE",
    "ChunkPoint",
    "Condition",
    "DateRange",
    "Filter",
    "HasIds",
    "Hit",
    "Match",
    "MatchAny",
    "MatchSubstring",
    "MatchText",
    "Mode",
    "Query",
    "Range",
    "SparseVector",
    "TermStats",
    "VectorStore",
    "create_store",
]


def create_store(settings: Settings, *, bulk: bool = False) -> VectorStore:
    """The store the settings name. `bulk`: for a bulk load (a restore), which the embedded
    store indexes a full segment at a time (the Qdrant server's own optimiser decides)."""
    if settings.qdrant_url:
        from services.common.store.server import ServerStore

        return ServerStore(url=settings.qdrant_url, api_key=settings.qdrant_api_key)
    from services.common.store.edge import EdgeStore

    return EdgeStore(settings.data_dir / "shards", bulk=bulk)
