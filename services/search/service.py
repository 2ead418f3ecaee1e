"""Search: resolves KBs, embeds the query once per model, queries each KB's collection,
fuses across KBs by rank, applies min_score, and coalesces neighbours."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from services.common import bm25
from services.common.embedders import EmbedderPool
from services.common.errors import Forbidden, NotFound
from services.common.models import KnowledgeBase, point_id
from services.common.queries import (
    ChunkRequest,
    ChunkResponse,
    SearchHit,
    SearchRequest,
    SearchResponse,
)
from services.common.registry import Registries
from services.common.settings import SearchSettings
from services.common.store import Filter, HasIds, Hit, Match, Mode, Query, VectorStore
from services.common.telemetry import tracer
from services.search.filters import build_filter
from services.search.fusion import coalesce, neighbour_windows, rrf_merge

_tracer = tracer("kbmesh.search")
MATCH_TYPE = {Mode.hybrid: "hybrid", Mode.dense: "semantic", Mode.keyword: "keyword"}


class SearchService:
    def __init__(
        self,
        registries: Registries,
        store: VectorStore,
        embedders: EmbedderPool,
        settings: SearchSettings,
    ) -> None:
        self.reg = registries
        self.store = store
        self.embedders = embedders
        self.settings = settings

    async def resolve_kbs(
        self, org_id: str, refs: list[str] | None, scope: list[str] | None
    ) -> list[KnowledgeBase]:
        """KB ids or names → KBs of the org; omitted → all (within the caller's scope)."""
        kbs = await self.reg.kbs.list(f"{org_id}.")
        if scope is not None:
            kbs = [kb for kb in kbs if kb.kb_id in scope]
        if not refs:
            return kbs
        by_ref = {kb.kb_id: kb for kb in kbs} | {kb.name: kb for kb in kbs}
        missing = [ref for ref in refs if ref not in by_ref]
        if missing:
            raise NotFound(f"knowledge base not found: {', '.join(missing)}", field="kb_ids")
        return list({by_ref[ref].kb_id: by_ref[ref] for ref in refs}.values())

    async def search(self, req: SearchRequest) -> SearchResponse:
        with _tracer.start_as_current_span("kbmesh.search") as span:
            span.set_attribute("kbmesh.mode", req.mode.value)
            kbs = await self.resolve_kbs(req.org_id, req.kb_ids, req.scope_kb_ids)
            flt = build_filter(req.org_id, req.filters)
            sparse = bm25.encode_query(req.query) if req.mode != Mode.dense else None
            groups: dict[tuple[str, str | None], list[KnowledgeBase]] = defaultdict(list)
            for kb in kbs:
                groups[(kb.embedding_model, kb.api_base)].append(kb)

            async def run_group(model: str, api_base: str | None, members: list[KnowledgeBase]):
                dense = None
                if req.mode != Mode.keyword:
                    # Once per distinct model, shared by every KB that uses it.
                    dense = await self.embedders.embed_query(model, req.query, api_base)
                return await asyncio.gather(
                    *(self._query_kb(kb, req, flt, dense, sparse) for kb in members)
                )

            per_group = await asyncio.gather(
                *(run_group(m, a, members) for (m, a), members in groups.items())
            )
            ranked_lists = [hits for group in per_group for hits in group if hits]
            merged = (
                ranked_lists[0]
                if len(ranked_lists) == 1
                else rrf_merge(ranked_lists, k=self.settings.rrf_k)
            )
            if req.min_score is not None:
                merged = [h for h in merged if h.score is not None and h.score >= req.min_score]
            matched = [
                h.model_copy(update={"rank": i}) for i, h in enumerate(merged[: req.top_k], 1)
            ]
            n = req.coalesce_neighbors
            if n is None:
                n = max((kb.coalesce_neighbors for kb in kbs), default=0)
            hits = await self._coalesce(matched, n, kbs) if n and matched else matched
            span.set_attribute("kbmesh.hits", len(matched))
        return SearchResponse(
            query=req.query,
            mode=req.mode,
            score_kind="bm25_relative" if req.mode == Mode.keyword else "cosine",
            kb_ids=[kb.kb_id for kb in kbs],
            coalesced=n if matched else 0,
            hits=hits,
        )

    async def _query_kb(
        self,
        kb: KnowledgeBase,
        req: SearchRequest,
        flt: Filter,
        dense: list[float] | None,
        sparse: Any,
    ) -> list[SearchHit]:
        query = Query(
            mode=req.mode,
            limit=req.top_k,
            filter=flt,
            dense=dense,
            sparse=sparse,
            prefetch_limit=max(self.settings.prefetch_limit, req.top_k),
            rrf_k=self.settings.rrf_k,
            hnsw_ef=self.settings.hnsw_ef,
        )
        hits = await self.store.query(kb.collection_name, query)
        if not hits:
            return []
        scores: dict[str, float | None]
        if req.mode == Mode.hybrid and dense is not None:
            # RRF scores say nothing about relevance; report the chunk's cosine similarity.
            cosine = await self.store.query(
                kb.collection_name,
                Query(mode=Mode.dense, limit=len(hits), dense=dense,
                      filter=flt.and_(HasIds(tuple(h.id for h in hits))),
                      hnsw_ef=self.settings.hnsw_ef),
            )
            by_id = {h.id: h.score for h in cosine}
            scores = {h.id: by_id.get(h.id) for h in hits}
        elif req.mode == Mode.keyword:
            best = max((h.score or 0.0) for h in hits) or 1.0
            scores = {h.id: (h.score or 0.0) / best for h in hits}
        else:
            scores = {h.id: h.score for h in hits}
        return [to_hit(h, scores[h.id], MATCH_TYPE[req.mode]) for h in hits]

    async def _coalesce(
        self, matched: list[SearchHit], n: int, kbs: list[KnowledgeBase]
    ) -> list[SearchHit]:
        collections = {kb.kb_id: kb.collection_name for kb in kbs}
        windows = neighbour_windows(matched, n)
        fetched = await asyncio.gather(
            *(
                self.store.retrieve(
                    collections[kb_id], [point_id(kb_id, document_id, i) for i in indexes]
                )
                for (kb_id, document_id), indexes in windows.items()
            )
        )
        neighbours = [to_hit(h, None, None) for hits in fetched for h in hits]
        return coalesce(matched, neighbours)

    async def get_chunk(self, req: ChunkRequest) -> ChunkResponse:
        kbs = await self.resolve_kbs(
            req.org_id, [req.kb_id] if req.kb_id else None, req.scope_kb_ids
        )
        for kb in kbs:
            found = await self.store.retrieve(kb.collection_name, [req.chunk_id])
            found = [h for h in found if h.payload.get("org_id") == req.org_id]
            if not found:
                continue
            chunk = to_hit(found[0], None, None)
            neighbours: list[SearchHit] = []
            if req.neighbors:
                ids = [
                    point_id(kb.kb_id, chunk.document_id, i)
                    for i in range(
                        max(0, chunk.chunk_index - req.neighbors),
                        min(chunk.total_chunks, chunk.chunk_index + req.neighbors + 1),
                    )
                    if i != chunk.chunk_index
                ]
                got = await self.store.retrieve(kb.collection_name, ids)
                neighbours = sorted(
                    (to_hit(h, None, None).model_copy(update={"is_matched": False}) for h in got),
                    key=lambda h: h.chunk_index,
                )
            return ChunkResponse(chunk=chunk, neighbors=neighbours)
        if req.kb_id and req.scope_kb_ids is not None and req.kb_id not in req.scope_kb_ids:
            raise Forbidden(f"knowledge base {req.kb_id!r} is outside this key's scope")
        raise NotFound(f"chunk {req.chunk_id!r} not found", field="chunk_id")


def to_hit(hit: Hit, score: float | None, match_type: str | None) -> SearchHit:
    p = hit.payload
    return SearchHit(
        chunk_id=hit.id,
        kb_id=p["kb_id"],
        document_id=p["document_id"],
        document_name=p.get("document_name", ""),
        source_id=p.get("source_id"),
        uri=p.get("uri"),
        chunk_index=p["chunk_index"],
        total_chunks=p.get("total_chunks", 1),
        content=p.get("content", ""),
        score=score,
        match_type=match_type,  # type: ignore[arg-type]
        tags=p.get("tags") or [],
        collection=p.get("collection"),
        metadata=p.get("metadata") or {},
    )


__all__ = ["Match", "SearchService", "to_hit"]
