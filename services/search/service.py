"""Search: resolves KBs, embeds the query once per model, collects each KB's candidate lists,
fuses them as one candidate set (see fusion.py), applies the floors, and coalesces
neighbours."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from services.common.bus.registry import Registries
from services.common.domain.errors import Forbidden, InvalidInput, KbmeshError, NotFound
from services.common.domain.ids import point_id
from services.common.domain.models import KnowledgeBase
from services.common.embedders import EmbedderPool, is_local
from services.common.messages.queries import (
    ChunkRequest,
    ChunkResponse,
    KbFailure,
    MatchType,
    SearchHit,
    SearchRequest,
    SearchResponse,
)
from services.common.ops.telemetry import tracer
from services.common.settings import SearchSettings
from services.common.store import (
    Filter,
    HasIds,
    Hit,
    Mode,
    Query,
    SparseVector,
    VectorStore,
    bm25,
)
from services.common.store.base import lead_filter
from services.search.budget import load_counter, pack
from services.search.documents import DocumentIds
from services.search.filters import build_filter
from services.search.fusion import (
    Candidate,
    CandidateList,
    ChunkKey,
    Fused,
    Signal,
    coalesce,
    fuse,
    neighbour_windows,
)
from services.search.query_vectors import QueryVectors
from services.search.rerank import LiteLLMReranker, Reranker, RerankFailed
from services.search.termstats import TermStatsCache

log = logging.getLogger(__name__)
_tracer = tracer("kbmesh.search")

# Ranking, chosen as the best compromise over every quality set measured (docs/benchmarks.md,
# "Figures behind the code"); `python -m benchmarks.quality --rrf-k/--lead-weight/
# --prefetch-limit` runs a stack with other values to study them.
RRF_K = 10  # reciprocal rank fusion constant
LEAD_WEIGHT = 1.0  # a document whose opening matches lifts its chunks' scores up to 1 + this
LEAD_FLOOR = 0.7  # the lift fades out when the best opening scores this share of the best chunk
# Candidates per list and KB (or `top_k` when larger): 100 ranked as well and cost more.
PREFETCH_LIMIT = 50
RERANK_DEPTH = 30  # best fused candidates handed to a KB's rerank model (or `top_k`)


class SearchService:
    def __init__(
        self,
        registries: Registries,
        store: VectorStore,
        embedders: EmbedderPool,
        settings: SearchSettings,
        reranker: Reranker | None = None,
    ) -> None:
        self.reg = registries
        self.store = store
        self.embedders = embedders
        self.reranker = reranker or LiteLLMReranker(settings.rerank_timeout_seconds)
        self.term_stats = TermStatsCache(store)
        self.documents = DocumentIds(store)
        self.query_vectors = QueryVectors(embedders)

    async def close(self) -> None:
        await self.documents.close()

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
            dense: dict[str, list[float] | None] = {}
            failures: dict[str, Exception] = {}

            async def embed_group(model: str, api_base: str | None) -> None:
                vector = None
                if req.mode != Mode.keyword:
                    try:
                        vector = await self.query_vectors.embed(model, req.query, api_base)
                    except Exception as err:
                        failures.update((kb.kb_id, err) for kb in groups[(model, api_base)])
                for kb in groups[(model, api_base)]:
                    dense[kb.kb_id] = vector

            # The engine's term statistics (for several KBs) are read while the query embeds.
            (keyword, keyword_failures), _ = await asyncio.gather(
                self._keyword_queries(kbs, sparse),
                asyncio.gather(*(embed_group(m, a) for m, a in groups)),
            )
            failures.update(keyword_failures)
            searchable = [kb for kb in kbs if kb.kb_id not in failures]
            candidates, candidate_failures = await _each_kb(
                searchable,
                lambda kb: self._candidates(kb, req, flt, dense[kb.kb_id], keyword.get(kb.kb_id)),
            )
            failures.update(candidate_failures)
            found = list(candidates.values())
            # One broken KB (an unreachable or misconfigured model) must not take every
            # search down with it: the others answer and the reply names the one left out.
            # Only when nothing could be searched is the search itself a failure.
            if failures and len(failures) == len(kbs):
                raise next(iter(failures.values()))
            failed_kbs = [_failure(kb, failures[kb.kb_id]) for kb in kbs if kb.kb_id in failures]
            lists = [ranked for per_kb, _ in found for ranked in per_kb]
            points = {key: hit for _, per_kb in found for key, hit in per_kb.items()}
            fused = fuse(lists, k=RRF_K, lead_weight=LEAD_WEIGHT, lead_floor=LEAD_FLOOR)
            known = known_scores(lists)
            collections = {kb.kb_id: kb.serving_collection for kb in kbs}
            if req.min_similarity is not None:
                # Only the candidates that can still make the cut need their cosine.
                head = fused[: max(req.top_k * 4, RERANK_DEPTH)]
                await self._complete(head, known, collections, dense, {}, flt)
                fused = [
                    f for f in fused if (known.cosine.get(f.chunk) or -1.0) >= req.min_similarity
                ]
            warnings: list[str] = []
            score_kind: Literal["fused", "rerank"] = "fused"
            reranker = rerank_model(kbs, req.rerank)
            if reranker is not None and fused:
                head = fused[: max(RERANK_DEPTH, req.top_k)]
                await self._load(head, points, collections)
                try:
                    fused = await self._rerank(req.query, head, points, reranker)
                    score_kind = "rerank"
                except RerankFailed as err:
                    log.warning("rerank_failed model=%s error=%s", reranker[0], err)
                    warnings.append(
                        f"reranking with {reranker[0]} failed ({err}); hits are in fused order"
                    )
            if req.min_score is not None:
                fused = [f for f in fused if f.score >= req.min_score]
            top = fused[: req.top_k]
            await asyncio.gather(
                self._complete(top, known, collections, dense, keyword, flt),
                self._load(top, points, collections),
            )
            # A chunk deleted since it was ranked has no payload left to load: left out.
            top = [f for f in top if "kb_id" in points[f.chunk].payload]
            matched = [
                self._hit(f.chunk, points[f.chunk], f.score, known, req.mode, rank)
                for rank, f in enumerate(top, 1)
            ]
            # Per KB: the query's value, else that KB's own default.
            windows = {
                kb.kb_id: kb.coalesce_neighbors
                if req.coalesce_neighbors is None
                else req.coalesce_neighbors
                for kb in kbs
            }
            hits = await self._coalesce(req.org_id, matched, windows, kbs) if matched else []
            budget = None
            if req.max_tokens is not None:
                hits, budget = pack(hits, req.max_tokens, await load_counter())
            span.set_attribute("kbmesh.hits", len(matched))
        return SearchResponse(
            query=req.query,
            mode=req.mode,
            score_kind=score_kind,
            kb_ids=[kb.kb_id for kb in kbs],
            coalesced=max((windows[h.kb_id] for h in matched), default=0),
            hits=hits,
            budget=budget,
            warnings=warnings,
            failed_kbs=failed_kbs,
        )

    async def _rerank(
        self,
        query: str,
        head: list[Fused],
        points: dict[ChunkKey, Hit],
        model: tuple[str, str | None],
    ) -> list[Fused]:
        """The best candidates (`head`) in the reranker's order, scored by it; the rest are
        dropped (they could only follow with a score on another scale)."""
        texts = [_rerank_text(points[f.chunk]) for f in head]
        order = await self.reranker.rerank(model[0], model[1], query, texts)
        return [Fused(head[i].chunk, head[i].document, score) for i, score in order]

    async def _keyword_queries(
        self, kbs: list[KnowledgeBase], sparse: SparseVector | None
    ) -> tuple[dict[str, SparseVector], dict[str, Exception]]:
        """Each KB's BM25 query, and the KBs whose statistics could not be read. One KB is
        searched with the query as it is; several with weights that give them one IDF over
        all of them (`bm25.shared_idf_queries`), so that their BM25 scores compare."""
        if sparse is None or not sparse.indices:
            return {}, {}
        if len(kbs) == 1:
            return {kbs[0].kb_id: sparse}, {}
        stats, failures = await _each_kb(
            kbs, lambda kb: self.term_stats.get(kb.serving_collection, sparse.indices)
        )
        return bm25.shared_idf_queries(sparse, stats), failures

    async def _candidates(
        self,
        kb: KnowledgeBase,
        req: SearchRequest,
        flt: Filter,
        dense: list[float] | None,
        sparse: SparseVector | None,
    ) -> Candidates:
        """The KB's candidate lists for the mode: chunks by each signal, and (with a lead
        weight) documents' first chunks by each signal."""
        name = kb.serving_collection
        limit = max(PREFETCH_LIMIT, req.top_k)
        model = "/".join(filter(None, kb.serving_model))
        searches: list[tuple[Signal, bool, Query]] = []
        leads = [False, True] if LEAD_WEIGHT > 0 else [False]
        for lead in leads:
            where = lead_filter(flt) if lead else flt
            if dense is not None:
                query = Query(
                    mode=Mode.dense,
                    limit=limit,
                    filter=where,
                    dense=dense,
                    payload=(),
                )
                searches.append(("dense", lead, query))
            if sparse is not None and sparse.indices:
                query = Query(
                    mode=Mode.keyword,
                    limit=limit,
                    filter=where,
                    sparse=sparse,
                    payload=(),
                )
                searches.append(("keyword", lead, query))
        if not searches:
            return [], {}
        # Ids and scores only: documents come from `self.documents`, whole payloads are read
        # for the returned hits alone (`_load`).
        results = await self.store.query_many(name, [q for _, _, q in searches])
        self.documents.read_all(name)
        documents = await self.documents.get(name, (h.id for hits in results for h in hits))
        lists: list[CandidateList] = []
        points: dict[ChunkKey, Hit] = {}
        kb_id = kb.kb_id
        for (signal, lead, _), hits in zip(searches, results, strict=True):
            found = []
            for h in hits:
                document = documents.get(h.id)
                if document is None:
                    continue  # deleted since the engine ranked it
                key = (kb_id, h.id)
                if key not in points:
                    points[key] = h
                found.append(Candidate(key, (kb_id, document), h.score or 0.0))
            # Cosines are comparable between KBs of one model; BM25 between all KBs.
            scale = model if signal == "dense" else "bm25"
            lists.append(CandidateList(signal, lead, scale, found))
        return lists, points

    async def _complete(
        self,
        fused: list[Fused],
        known: KnownScores,
        collections: dict[str, str],
        dense: dict[str, list[float] | None],
        keyword: Mapping[str, SparseVector],
        flt: Filter,
    ) -> None:
        """Look up the cosine (and BM25) of fused chunks that a candidate list did not
        report: among these few chunks only, exact and cheap."""
        lookups = []
        for kb_id in {f.chunk[0] for f in fused}:
            ids = [f.chunk[1] for f in fused if f.chunk[0] == kb_id]
            vector = dense.get(kb_id)
            need = tuple(i for i in ids if (kb_id, i) not in known.cosine)
            if vector is not None and need:
                query = Query(
                    mode=Mode.dense,
                    limit=len(need),
                    dense=vector,
                    filter=flt.and_(HasIds(need)),
                    payload=(),
                )
                lookups.append((kb_id, known.cosine, query))
            need = tuple(i for i in ids if (kb_id, i) not in known.bm25)
            sparse = keyword.get(kb_id)
            if sparse is not None and sparse.indices and need:
                query = Query(
                    mode=Mode.keyword,
                    limit=len(need),
                    sparse=sparse,
                    filter=flt.and_(HasIds(need)),
                    payload=(),
                )
                lookups.append((kb_id, known.bm25, query))
        results = await asyncio.gather(
            *(self.store.query(collections[kb_id], q) for kb_id, _, q in lookups)
        )
        for (kb_id, into, _), hits in zip(lookups, results, strict=True):
            for h in hits:
                into[(kb_id, h.id)] = h.score or 0.0

    async def _load(
        self, fused: list[Fused], points: dict[ChunkKey, Hit], collections: dict[str, str]
    ) -> None:
        """Whole payloads (text, labels, metadata) of the chunks about to be returned, in
        place of the ranking fields their candidate lists carried."""
        wanted: dict[str, list[str]] = defaultdict(list)
        for f in fused:
            if "kb_id" not in points[f.chunk].payload:
                wanted[f.chunk[0]].append(f.chunk[1])
        found = await asyncio.gather(
            *(self.store.retrieve(collections[kb_id], ids) for kb_id, ids in wanted.items())
        )
        for kb_id, hits in zip(wanted, found, strict=True):
            for h in hits:
                key = (kb_id, h.id)
                points[key] = Hit(id=h.id, score=points[key].score, payload=h.payload)

    @staticmethod
    def _hit(
        key: ChunkKey, point: Hit, score: float, known: KnownScores, mode: Mode, rank: int
    ) -> SearchHit:
        similarity = known.cosine.get(key)
        if mode == Mode.keyword:
            match: MatchType = "keyword"
        elif mode == Mode.dense:
            match = "semantic"
        else:
            # Hybrid: a chunk holding none of the query's terms matched by meaning only.
            match = "hybrid" if known.bm25.get(key) else "semantic"
        return to_hit(point, score, match).model_copy(
            update={"similarity": similarity, "rank": rank}
        )

    async def _coalesce(
        self,
        org_id: str,
        matched: list[SearchHit],
        windows: dict[str, int],
        kbs: list[KnowledgeBase],
    ) -> list[SearchHit]:
        collections = {kb.kb_id: kb.serving_collection for kb in kbs}
        if not any(windows.get(h.kb_id) for h in matched):
            return matched  # no context asked for: plain rank order
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


Candidates = tuple[list[CandidateList], dict[ChunkKey, Hit]]


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
        heading_path=p.get("heading_path") or [],
        pages=p.get("pages") or [],
        slides=p.get("slides") or [],
    )


T = TypeVar("T")


async def _each_kb(
    kbs: list[KnowledgeBase], work: Callable[[KnowledgeBase], Awaitable[T]]
) -> tuple[dict[str, T], dict[str, Exception]]:
    """`work` for every KB at once: results by KB id (in the KBs' order), and the KBs it
    failed for. Only an Exception is one KB's failure; anything else (cancellation)
    propagates."""
    results = await asyncio.gather(*(work(kb) for kb in kbs), return_exceptions=True)
    done: dict[str, T] = {}
    failed: dict[str, Exception] = {}
    for kb, result in zip(kbs, results, strict=True):
        if isinstance(result, Exception):
            failed[kb.kb_id] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            done[kb.kb_id] = result
    return done, failed


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


def rerank_model(kbs: list[KnowledgeBase], wanted: bool | None) -> tuple[str, str | None] | None:
    """The rerank model (and api_base) for a search: the first KB searched that names one,
    when the query asks for reranking or leaves it to the KBs."""
    if wanted is False:
        return None
    named = next(((kb.rerank_model, kb.rerank_api_base) for kb in kbs if kb.rerank_model), None)
    if wanted and named is None:
        raise InvalidInput(
            "rerank: none of the knowledge bases searched has a rerank_model", field="rerank"
        )
    return named


def _rerank_text(point: Hit) -> str:
    # The document name says what the chunk is part of, as it does for embedding.
    name = point.payload.get("document_name") or ""
    content = point.payload.get("content", "")
    return f"{name}\n\n{content}" if name else content


@dataclass
class KnownScores:
    """Cosine and BM25 of candidate chunks, as the candidate lists reported them."""

    cosine: dict[ChunkKey, float] = field(default_factory=dict)
    bm25: dict[ChunkKey, float] = field(default_factory=dict)


def known_scores(lists: list[CandidateList]) -> KnownScores:
    known = KnownScores()
    for ranked in lists:
        into = known.cosine if ranked.signal == "dense" else known.bm25
        for c in ranked.candidates:
            into[c.chunk] = c.score
    return known


__all__ = ["SearchService", "to_hit"]
