"""Fusion experiments without re-ingesting: candidate lists cached once, fusions replayed.

`collect` opens a copy of KB shards (stop kbmesh or copy the shard directories first: an
open shard is locked), runs every query of a BEIR set the way search does (dense and BM25
candidates over all chunks and over documents' first chunks, top 100 each) and caches the
lists. `eval` replays fusion variants over the cached lists and prints MRR@10 per set.

    .venv/bin/python -m benchmarks.fusion_lab collect SHARDS_DIR COLLECTION[,COLLECTION..] \\
        BEIR_DIR OUT.pkl
    .venv/bin/python -m benchmarks.fusion_lab eval A.pkl B.pkl ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import pickle
from collections.abc import Callable
from pathlib import Path

from benchmarks.quality import load_beir, metrics
from services.common.embedders import LocalEmbedder
from services.common.store import Filter, Mode, Query, bm25
from services.common.store.base import lead_filter
from services.common.store.edge import EdgeStore
from services.search.fusion import Candidate, CandidateList
from services.search.fusion import fuse as fuse_lists

LIMIT = 100
# (beir document id, chunk id, score)
Entry = tuple[str, str, float]
Lists = dict[str, list[Entry]]  # "dense", "keyword", "lead_dense", "lead_keyword"


async def collect(shards: Path, collections: list[str], beir: Path, out: Path) -> None:
    _, queries, qrels = load_beir(beir)
    store = EdgeStore(shards)
    embedder = LocalEmbedder(backend="onnx")
    texts = list(queries.values())
    vectors = await embedder.embed(texts)
    rows = []
    for (qid, text), dense in zip(queries.items(), vectors, strict=True):
        sparse = bm25.encode_query(text)
        per_kb: list[Lists] = []
        for name in collections:
            lists: Lists = {}
            for key, mode, flt in (
                ("dense", Mode.dense, Filter()),
                ("keyword", Mode.keyword, Filter()),
                ("lead_dense", Mode.dense, lead_filter(Filter())),
                ("lead_keyword", Mode.keyword, lead_filter(Filter())),
            ):
                hits = await store.query(
                    name, Query(mode=mode, limit=LIMIT, filter=flt, dense=dense, sparse=sparse)
                )
                lists[key] = [
                    (
                        h.payload["metadata"].get("beir_id", h.payload["document_id"]),
                        h.id,
                        h.score or 0.0,
                    )
                    for h in hits
                ]
            per_kb.append(lists)
        rows.append((qid, text, per_kb, qrels[qid]))
    await store.close()
    out.write_bytes(pickle.dumps(rows))
    print(f"{len(rows)} queries -> {out}")


# ---- fusion variants ------------------------------------------------------------------------


def merged(per_kb: list[Lists], key: str, by_kb: bool) -> list[list[Entry]]:
    """One list per KB (rank-only merging), or one list of every KB's candidates by score."""
    if by_kb:
        return [lists[key] for lists in per_kb]
    return [sorted((e for lists in per_kb for e in lists[key]), key=lambda e: -e[2])]


def agreement(per_kb: list[Lists], kinds: list[str]) -> float:
    """How close the best document opening comes to the best chunk: mean over signals of
    top lead score / top chunk score (1.0: the best match is an opening)."""
    ratios = []
    for kind in kinds:
        top = max((lists[kind][0][2] for lists in per_kb if lists[kind]), default=0.0)
        lead = max(
            (lists["lead_" + kind][0][2] for lists in per_kb if lists["lead_" + kind]),
            default=0.0,
        )
        if top > 0:
            ratios.append(min(1.0, max(0.0, lead / top)))
    return sum(ratios) / len(ratios) if ratios else 0.0


def agreement2(per_kb: list[Lists], kinds: list[str], r0: tuple) -> float:
    out = []
    for kind in kinds:
        top = max((lists[kind][0][2] for lists in per_kb if lists[kind]), default=0.0)
        lead = max(
            (lists["lead_" + kind][0][2] for lists in per_kb if lists["lead_" + kind]), default=0.0
        )
        t = r0[0] if kind == "dense" else r0[1]
        ratio = lead / top if top > 0 else 0.0
        out.append(min(1.0, max(0.0, (ratio - t) / (1 - t))))
    return sum(out) / len(out)


def lead_on_top(per_kb: list[Lists], kinds: list[str], depth: int) -> float:
    """Share of signals whose best `depth` chunks include a document's first chunk."""
    hits = 0
    for kind in kinds:
        leads = {e[1] for lists in per_kb for e in lists["lead_" + kind]}
        merged = sorted((e for lists in per_kb for e in lists[kind]), key=lambda e: -e[2])
        hits += any(e[1] in leads for e in merged[:depth])
    return hits / len(kinds)


def fuse(
    per_kb: list[Lists],
    mode: str,
    k: int,
    w: float,
    prior: str,
    by_kb: bool = False,
    lead_k: int | None = None,
    r0: float | None = None,
) -> list[str]:
    kinds = {"dense": ["dense"], "keyword": ["keyword"], "hybrid": ["dense", "keyword"]}[mode]
    lk = lead_k or k
    if isinstance(r0, tuple):
        w = w * agreement2(per_kb, kinds, r0)
    elif r0 is not None and r0 >= 1:
        w = w * lead_on_top(per_kb, kinds, int(r0))
    elif r0 is not None:
        w = w * min(1.0, max(0.0, (agreement(per_kb, kinds) - r0) / (1 - r0)))
    chunk: dict[str, float] = {}
    doc_of: dict[str, str] = {}
    for kind in kinds:
        for ranked in merged(per_kb, kind, by_kb):
            for r, (d, c, _) in enumerate(ranked, 1):
                chunk[c] = chunk.get(c, 0.0) + 1 / (k + r)
                doc_of[c] = d
    lead_chunk: dict[str, float] = {}
    docprior: dict[str, float] = {}
    if w > 0:
        for kind in kinds:
            for ranked in merged(per_kb, "lead_" + kind, by_kb):
                for r, (d, c, _) in enumerate(ranked, 1):
                    lead_chunk[c] = lead_chunk.get(c, 0.0) + 1 / (lk + r)
                    docprior[d] = docprior.get(d, 0.0) + 1 / (lk + r)
                    doc_of.setdefault(c, d)
    norm = len(kinds) / (lk + 1)
    scores: dict[str, float] = {}
    for c in dict.fromkeys([*chunk, *lead_chunk]):  # first-seen order breaks ties
        base = chunk.get(c, 0.0)
        d = doc_of[c]
        if prior == "chunk":  # today: the lead lists are more candidate lists
            s = base + w * lead_chunk.get(c, 0.0)
        elif prior == "doc":  # additive document prior on every chunk of the document
            s = base + w * docprior.get(d, 0.0)
        elif prior == "boost":  # multiplicative document prior: scales a chunk match
            s = base * (1 + w * docprior.get(d, 0.0) / norm)
        else:
            raise ValueError(prior)
        scores[c] = s
    ranked_docs: list[str] = []
    for c in sorted(scores, key=lambda c: -scores[c]):
        if doc_of[c] not in ranked_docs:
            ranked_docs.append(doc_of[c])
    return ranked_docs


def production(per_kb: list[Lists], mode: str, k: int, w: float, floor: float) -> list[str]:
    """services/search/fusion.py's `fuse` on the cached lists (each cache row's KBs)."""
    kinds = {"dense": ["dense"], "keyword": ["keyword"], "hybrid": ["dense", "keyword"]}[mode]
    lists = [
        CandidateList(
            kind,
            lead,
            "model" if kind == "dense" else "bm25",
            [
                Candidate((str(i), c), (str(i), d), score)
                for d, c, score in kb[("lead_" if lead else "") + kind]
            ],
        )
        for i, kb in enumerate(per_kb)
        for kind in kinds
        for lead in (False, True)
    ]
    docs = []
    for f in fuse_lists(lists, k=k, lead_weight=w, lead_floor=floor):
        if f.document[1] not in docs:
            docs.append(f.document[1])
    return docs


def before(per_kb: list[Lists], mode: str) -> list[str]:
    """The former ranking: each KB fused alone (lead lists at weight 0.5, k=10), then the
    KBs' lists merged by reciprocal rank (k=10), whatever their scores."""
    scores: dict[str, float] = {}
    for kb in per_kb:
        for rank, d in enumerate(fuse([kb], mode, 10, 0.5, "chunk"), 1):
            scores[d] = scores.get(d, 0.0) + 1 / (10 + rank)
    return sorted(scores, key=lambda d: -scores[d])


def evaluate(rows: list, ranker: Callable[[list[Lists]], list[str]]) -> float:
    return sum(metrics(ranker(per_kb), rel)[0] for _, _, per_kb, rel in rows) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("shards", type=Path)
    c.add_argument("collections")
    c.add_argument("beir", type=Path)
    c.add_argument("out", type=Path)
    e = sub.add_parser("eval")
    e.add_argument("caches", nargs="+", type=Path)
    e.add_argument("--by-kb", action="store_true")
    e.add_argument("--modes", default="dense,keyword,hybrid")
    a = ap.parse_args()
    if a.cmd == "collect":
        asyncio.run(collect(a.shards, a.collections.split(","), a.beir, a.out))
        return
    sets = {p.stem: pickle.loads(p.read_bytes()) for p in a.caches}
    print("variant | " + " | ".join(sets))
    variants: list[tuple[str, Callable[[list[Lists], str], list[str]]]] = [
        ("plain RRF k=60 (baseline)", lambda p, m: fuse(p, m, 60, 0.0, "chunk")),
        ("plain RRF k=10", lambda p, m: fuse(p, m, 10, 0.0, "chunk")),
        ("before: lead lists k=10 w=0.5, KBs merged by rank", before),
    ]
    for w, floor in itertools.product((0.5, 1.0, 2.0), (0.0, 0.6, 0.7, 0.8)):
        variants.append(
            (
                f"prior k=10 w={w} floor={floor}",
                lambda p, m, w=w, f=floor: production(p, m, 10, w, f),
            )
        )
    for mode in a.modes.split(","):
        for name, ranker in variants:
            vals = [evaluate(rows, lambda p, r=ranker, m=mode: r(p, m)) for rows in sets.values()]
            print(f"{mode} | {name} | " + " | ".join(f"{v:.3f}" for v in vals), flush=True)


if __name__ == "__main__":
    main()
