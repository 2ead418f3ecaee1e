"""Search: resolves KBs, embeds the query once per model, queries each KB's collection,
fuses across KBs by rank, applies min_score, and coalesces neighbours."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict

from services.common import bm25
from services.common.embedders import EmbedderPool, is_local
from services.common.errors import Forbidden, InvalidInput, KbmeshError, NotFound
from services.common.models import KnowledgeBase, point_id
from services.common.queries import (
    ChunkRequest,
    ChunkResponse,
    KbFailure,
    MatchType,
    SearchHit,
    SearchRequest,
    SearchResponse,
)
from services.common.registry import Registries
from services.common.settings import SearchSettings
from services.common.store import (
    Filter,
    HasIds,
    Hit,
    Mode,
    Query,
    SparseVector,
    VectorStore,
)
from services.common.store.base import fusion_plan
from services.common.telemetry import tracer
from services.search.filters import build_filter
from services.search.fusion import coalesce, neighbour_windows, rrf_merge

_tracer = tracer("kbmesh.search")
log = logging.getLogger("kbmesh.search")


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
            span.set_attribute("kbmesh.kb_count", len(kbs))
            flt = build_filter(req.org_id, req.filters)
            sparse = bm25.encode_query(req.query) if req.mode != Mode.dense else None
            # One query embedding per distinct model (keyed as the embedder pool keys them),
            # shared by every KB that uses it.
            groups: dict[tuple[str, str | None], list[KnowledgeBase]] = defaultdict(list)
            for kb in kbs:
                # The model of the collection searched: during a model change, the old one.
                model, api_base = kb.serving_model
                groups[(model, None if is_local(model) else api_base)].append(kb)

            failures: dict[str, Exception] = {}

            async def run_group(
                model: str, api_base: str | None, members: list[KnowledgeBase]
            ) -> list[list[SearchHit]]:
                dense = None
                if req.mode != Mode.keyword:
                    try:
                        dense = await self.embedders.embed_query(model, req.query, api_base)
                    except Exception as err:
                        failures.update(dict.fromkeys((kb.kb_id for kb in members), err))
                        return []
                results = await asyncio.gather(
                    *(self._query_kb(kb, req, flt, dense, sparse) for kb in members),
                    return_exceptions=True,
                )
                for kb, result in zip(members, results, strict=True):
                    if isinstance(result, BaseException):
                        if not isinstance(result, Exception):
                            raise result
                        failures[kb.kb_id] = result
                return [r for r in results if not isinstance(r, BaseException)]

            per_group = await asyncio.gather(
                *(run_group(m, a, members) for (m, a), members in groups.items())
            )
            # One broken KB (an unreachable or misconfigured model) must not take every
            # search down with it: the others answer and the reply names the one left out.
            # Only when nothing could be searched is the search itself a failure.
            if failures and len(failures) == len(kbs):
                raise next(iter(failures.values()))
            failed_kbs = [_failure(kb, failures[kb.kb_id]) for kb in kbs if kb.kb_id in failures]
            ranked_lists = [hits for group in per_group for hits in group]
            if req.min_score is not None:
                # Before fusion, so that ranks are ranks among the hits that count.
                floor = req.min_score
                ranked_lists = [
                    [h for h in hits if h.score is not None and h.score >= floor]
                    for hits in ranked_lists
                ]
            ranked_lists = [hits for hits in ranked_lists if hits]
            # Scores of different KBs (other models, other IDF statistics) are not comparable:
            # several KBs are fused by rank.
            merged = (
                ranked_lists[0]
                if len(ranked_lists) == 1
                else rrf_merge(ranked_lists, k=self.settings.rrf_k, key=_hit_key)
            )
            matched = [
                h.model_copy(update={"rank": i}) for i, h in enumerate(merged[: req.top_k], 1)
            ]
            # Per KB: the query's value, else that KB's own default.
            windows = {
                kb.kb_id: kb.coalesce_neighbors
                if req.coalesce_neighbors is None
                else req.coalesce_neighbors
                for kb in kbs
            }
            hits = await self._coalesce(req.org_id, matched, windows, kbs) if matched else []
            span.set_attribute("kbmesh.hits", len(matched))
        return SearchResponse(
            query=req.query,
            mode=req.mode,
            score_kind="bm25_relative" if req.mode == Mode.keyword else "cosine",
            kb_ids=[kb.kb_id for kb in kbs],
            coalesced=max((windows[h.kb_id] for h in matched), default=0),
            hits=hits,
            failed_kbs=failed_kbs,
        )

    async def _query_kb(
        self,
        kb: KnowledgeBase,
        req: SearchRequest,
        flt: Filter,
        dense: list[float] | None,
        sparse: SparseVector | None,
    ) -> list[SearchHit]:
        name = kb.serving_collection
        query = Query(
            mode=req.mode,
            limit=req.top_k,
            filter=flt,
            dense=dense,
            sparse=sparse,
            prefetch_limit=max(self.settings.prefetch_limit, req.top_k),
            rrf_k=self.settings.rrf_k,
            hnsw_ef=self.settings.hnsw_ef,
            lead_weight=self.settings.lead_weight,
        )
        hits = await self.store.query(name, query)
        if not hits:
            return []
        fused = fusion_plan(query) is not None
        cosine: dict[str, float | None] = {h.id: h.score for h in hits}
        lexical: dict[str, float | None] = dict(cosine)
        if fused:
            # Fused (RRF) scores rank but say nothing about relevance: look up each hit's
            # cosine similarity and BM25 score among these hits alone (exact, cheap).
            only = flt.and_(HasIds(tuple(h.id for h in hits)))
            has_terms = sparse is not None and bool(sparse.indices)
            dense_scores, bm25_scores = await asyncio.gather(
                self.store.query(
                    name,
                    Query(
                        mode=Mode.dense,
                        limit=len(hits),
                        dense=dense,
                        filter=only,
                        hnsw_ef=self.settings.hnsw_ef,
                    ),
                )
                if dense is not None
                else _no_hits(),
                self.store.query(
                    name, Query(mode=Mode.keyword, limit=len(hits), sparse=sparse, filter=only)
                )
                if has_terms
                else _no_hits(),
            )
            cosine = {h.id: h.score for h in dense_scores}
            lexical = {h.id: h.score for h in bm25_scores}
        if req.mode == Mode.keyword:
            # Raw BM25 depends on the KB's IDF statistics and the query's length; relative to
            # the best hit it reads the same in every KB (1.0 = as good as the best match).
            best = max((lexical.get(h.id) or 0.0) for h in hits) or 1.0
            return [to_hit(h, (lexical.get(h.id) or 0.0) / best, "keyword") for h in hits]
        if req.mode == Mode.dense:
            return [to_hit(h, cosine.get(h.id), "semantic") for h in hits]
        # Hybrid: a chunk holding none of the query's terms matched by meaning only.
        return [
            to_hit(h, cosine.get(h.id), "hybrid" if lexical.get(h.id) else "semantic") for h in hits
        ]

    async def _coalesce(
        self,
        org_id: str,
        matched: list[SearchHit],
        windows: dict[str, int],
        kbs: list[KnowledgeBase],
    ) -> list[SearchHit]:
        collections = {kb.kb_id: kb.serving_collection for kb in kbs}
        wanted = neighbour_windows(matched, windows)
        if not wanted:
            return coalesce(matched, [])
        fetched = await asyncio.gather(
            *(
                self.store.retrieve(
                    collections[kb_id], [point_id(kb_id, document_id, i) for i in indexes]
                )
                for (kb_id, document_id), indexes in wanted.items()
            )
        )
        neighbours = [
            to_hit(h, None, None)
            for hits in fetched
            for h in hits
            if h.payload.get("org_id") == org_id
        ]
        return coalesce(matched, neighbours)

    async def get_chunk(self, req: ChunkRequest) -> ChunkResponse:
        try:
            uuid.UUID(req.chunk_id)
        except ValueError as err:
            raise InvalidInput(
                f"chunk_id {req.chunk_id!r} is not a chunk id (a UUID, as in search hits)",
                field="chunk_id",
            ) from err
        kbs = await self.resolve_kbs(
            req.org_id, [req.kb_id] if req.kb_id else None, req.scope_kb_ids
        )
        for kb in kbs:
            found = await self.store.retrieve(kb.serving_collection, [req.chunk_id])
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
                got = await self.store.retrieve(kb.serving_collection, ids)
                neighbours = sorted(
                    (
                        to_hit(h, None, None).model_copy(update={"is_matched": False})
                        for h in got
                        if h.payload.get("org_id") == req.org_id
                    ),
                    key=lambda h: h.chunk_index,
                )
            return ChunkResponse(chunk=chunk, neighbors=neighbours)
        if req.kb_id and req.scope_kb_ids is not None and req.kb_id not in req.scope_kb_ids:
            raise Forbidden(f"knowledge base {req.kb_id!r} is outside this key's scope")
        raise NotFound(f"chunk {req.chunk_id!r} not found", field="chunk_id")


def to_hit(hit: Hit, score: float | None, match_type: MatchType | None) -> SearchHit:
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
        rank=None,
        match_type=match_type,
        tags=p.get("tags") or [],
        collection=p.get("collection"),
        metadata=p.get("metadata") or {},
    )


def _failure(kb: KnowledgeBase, err: Exception) -> KbFailure:
    if isinstance(err, KbmeshError):
        return KbFailure(
            kb_id=kb.kb_id, name=kb.name, error_type=err.error_type, message=err.message
        )
    log.warning("search_kb_failed kb_id=%s error=%r", kb.kb_id, err)
    return KbFailure(
        kb_id=kb.kb_id,
        name=kb.name,
        error_type="InternalError",
        message=f"searching this knowledge base failed ({type(err).__name__})",
    )


def _hit_key(hit: SearchHit) -> tuple[str, str]:
    return (hit.kb_id, hit.chunk_id)


async def _no_hits() -> list[Hit]:
    return []


__all__ = ["SearchService", "to_hit"]
