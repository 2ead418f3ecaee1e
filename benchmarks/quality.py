"""Retrieval quality through the real pipeline, on any BEIR-format directory.

Ingests the corpus with REST uploads into a fresh KB (REST → NATS → ingest → embed →
Qdrant), then runs every query through `POST /v1/search` in each mode and reports
document-level MRR@10, Recall@10 and nDCG@10 (a document's rank is its best chunk's).

    python3 ../shared/bench/manpages.py benchmarks/data/manpages --sections 1,8 \\
        --skip '^gcloud' --max-docs 3000
    .venv/bin/python -m benchmarks.quality benchmarks/data/manpages \\
        --data-dir benchmarks/data/kbmesh-manpages

With --data-dir the index persists: a second run with the same directory and KB settings
skips ingestion. --base-url evaluates against an already running kbmesh instead.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.common import kbmesh_up_at

MODES = ("dense", "keyword", "hybrid")
K = 10


def load_beir(directory: Path) -> tuple[dict, dict, dict[str, dict[str, int]]]:
    corpus = {}
    with open(directory / "corpus.jsonl") as f:
        for line in f:
            doc = json.loads(line)
            corpus[str(doc["_id"])] = doc
    queries = {}
    with open(directory / "queries.jsonl") as f:
        for line in f:
            q = json.loads(line)
            queries[str(q["_id"])] = q["text"]
    qrels: dict[str, dict[str, int]] = {}
    split = next(
        p for p in [directory / "qrels" / "test.tsv", directory / "qrels" / "dev.tsv"] if p.exists()
    )
    with open(split) as f:
        for i, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if i == 0 and not parts[-1].strip().lstrip("-").isdigit():
                continue  # header
            qid, did, score = parts[0], parts[1], int(parts[2])
            if score > 0:
                qrels.setdefault(qid, {})[did] = score
    queries = {q: t for q, t in queries.items() if q in qrels}
    return corpus, queries, qrels


def document_id(beir_id: str) -> str:
    """BEIR ids may hold any character; kbmesh ids are [A-Za-z0-9_-]{1,64}."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", beir_id)
    if safe == beir_id and len(safe) <= 64:
        return safe
    import hashlib

    return (safe[:40] + "_" + hashlib.sha1(beir_id.encode()).hexdigest()[:16])[:64]


def ingest(
    client: httpx.Client,
    kb: str,
    corpus: dict,
    chunk_size: int,
    id_prefix: str = "",
    model: str | None = None,
) -> float:
    settings: dict[str, object] = {"name": kb, "chunk_size": chunk_size}
    if model:
        settings["embedding_model"] = model
    r = client.post("/v1/kbs", json=settings)
    if r.status_code == 409:
        stats = client.get(f"/v1/kbs/{kb}/stats").json()
        if stats["document_count"] >= len(corpus):
            print(f"KB {kb!r} already holds {stats['document_count']} documents; reusing it")
            return 0.0
    else:
        r.raise_for_status()
    started = time.perf_counter()
    for beir_id, doc in corpus.items():
        body = {
            "name": doc.get("title") or beir_id,
            "content": doc["text"] or " ",
            "document_id": document_id(id_prefix + beir_id),
            "metadata": {"beir_id": beir_id},
        }
        if client.get(f"/v1/documents/{body['document_id']}").status_code == 200:
            continue  # uploaded by an earlier, interrupted run
        r = client.post(f"/v1/kbs/{kb}/documents", json=body)
        if r.status_code >= 400:
            raise SystemExit(f"upload of {beir_id!r} failed: {r.status_code} {r.text}")
    while True:
        try:
            stats = client.get(f"/v1/kbs/{kb}/stats").json()
        except httpx.TransportError as err:
            # Seen once at 10k chunks, while an Edge index build held the server (docs/
            # benchmarks.md, "Known limits"): a poll is worth asking again, not the run.
            print(f"\n  stats poll failed ({err!r}); asking again")
            time.sleep(2)
            continue
        done = stats["document_count"] + stats["failed_count"]
        print(
            f"\r  indexed {stats['document_count']}/{len(corpus)} documents, "
            f"{stats['chunk_count']} chunks, {time.perf_counter() - started:.0f}s",
            end="",
        )
        if done >= len(corpus):
            print()
            return time.perf_counter() - started
        time.sleep(2)


def ranked_documents(
    client: httpx.Client, kbs: list[str], query: str, mode: str, top_k: int
) -> tuple[list[str], float]:
    """Documents in rank order (a document at its best chunk) and the request's seconds."""
    started = time.perf_counter()
    r = client.post(
        "/v1/search",
        json={
            "query": query,
            "kb_ids": kbs,
            "mode": mode,
            "top_k": top_k,
            "coalesce_neighbors": 0,
        },
    )
    r.raise_for_status()
    took = time.perf_counter() - started
    seen: list[str] = []
    for hit in r.json()["hits"]:
        beir_id = hit["metadata"].get("beir_id", hit["document_id"])
        if beir_id not in seen:
            seen.append(beir_id)
    return seen, took


def metrics(ranked: list[str], relevant: dict[str, int]) -> tuple[float, float, float]:
    top = ranked[:K]
    rr = next((1.0 / (i + 1) for i, d in enumerate(top) if d in relevant), 0.0)
    recall = len([d for d in top if d in relevant]) / len(relevant)
    dcg = sum((2 ** relevant.get(d, 0) - 1) / math.log2(i + 2) for i, d in enumerate(top))
    ideal = sorted(relevant.values(), reverse=True)[:K]
    idcg = sum((2**g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    return rr, recall, dcg / idcg if idcg else 0.0


def evaluate(
    client: httpx.Client,
    kbs: list[str],
    queries: dict,
    qrels: dict,
    mode: str,
    top_k: int,
    workers: int = 4,
) -> dict[str, float]:
    def one(item: tuple[str, str]) -> tuple[tuple[float, float, float], float]:
        qid, text = item
        ranked, took = ranked_documents(client, kbs, text, mode, top_k)
        return metrics(ranked, qrels[qid]), took

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(one, queries.items()))
    rows = [m for m, _ in done]
    took = sorted(t for _, t in done)
    n = len(rows)
    return {
        "MRR@10": sum(r[0] for r in rows) / n,
        "Recall@10": sum(r[1] for r in rows) / n,
        "nDCG@10": sum(r[2] for r in rows) / n,
        "queries": n,
        "seconds": time.perf_counter() - started,
        "p50_ms": 1000 * took[n // 2],
        "p90_ms": 1000 * took[int(n * 0.9)],
    }


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[str]:
    if args.base_url:
        yield args.base_url
    else:
        # Ranking is fixed in the product; the stack started here runs with the values given.
        constants = {
            f"services.search.service.{name}": value
            for name, value in (
                ("RRF_K", args.rrf_k),
                ("LEAD_WEIGHT", args.lead_weight),
                ("PREFETCH_LIMIT", args.prefetch_limit),
            )
            if value is not None
        }
        env = {"KBMESH_LOCAL_PRECISION": args.precision} if args.precision else {}
        with kbmesh_up_at(args.data_dir, constants, **env) as base:
            yield base


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("beir_dir", type=Path)
    parser.add_argument("--base-url", help="a running kbmesh; default: start `kbmesh up`")
    parser.add_argument("--data-dir", type=Path, help="persist the index here (reuse it)")
    parser.add_argument("--kb", help="KB name (default: derived from the dir and settings)")
    parser.add_argument("--chunk-size", type=int, default=200)
    parser.add_argument("--model", help="the KB's embedding model (default: the server's)")
    parser.add_argument("--top-k", type=int, default=50, help="chunks fetched per query")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--max-queries", type=int)
    parser.add_argument(
        "--sample", type=int, help="use this many documents (evenly spaced) and their queries"
    )
    parser.add_argument(
        "--split", type=int, default=1, help="index the corpus round-robin into this many KBs"
    )
    parser.add_argument(
        "--id-prefix",
        help="prefix of the document ids (documents exist once per org: two KBs holding the "
        "same pages need different ids); default: none, or the KB name with --sample/--split",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="one query at a time, and report each mode's request latency (p50, p90)",
    )
    parser.add_argument(
        "--also-search",
        default="",
        help="comma-separated KBs (names) searched together with the set's, e.g. an unrelated one",
    )
    parser.add_argument("--rrf-k", type=int, help="RRF_K (search/service.py) of the started stack")
    parser.add_argument("--lead-weight", type=float, help="LEAD_WEIGHT of the started stack")
    parser.add_argument("--prefetch-limit", type=int, help="PREFETCH_LIMIT of the started stack")
    parser.add_argument(
        "--precision", choices=("fp32", "int8"), help="KBMESH_LOCAL_PRECISION for the stack"
    )
    args = parser.parse_args()

    corpus, queries, qrels = load_beir(args.beir_dir)
    if args.sample:
        step = len(corpus) / args.sample
        ids = list(corpus)
        corpus = {ids[int(i * step)]: corpus[ids[int(i * step)]] for i in range(args.sample)}
        queries = {q: t for q, t in queries.items() if qrels[q].keys() & corpus.keys()}
    if args.max_queries:
        queries = dict(list(queries.items())[: args.max_queries])
    model_tag = f"-{args.model.rsplit('/', 1)[-1]}" if args.model else ""
    kb = args.kb or f"{args.beir_dir.name}-cs{args.chunk_size}{model_tag}"
    parts = [kb] if args.split == 1 else [f"{kb}-part{i + 1}" for i in range(args.split)]
    print(f"{args.beir_dir}: {len(corpus)} documents, {len(queries)} queries; KBs {parts}")
    with target(args) as base, httpx.Client(base_url=base, timeout=120) as client:
        seconds = 0.0
        items = list(corpus.items())
        for i, part in enumerate(parts):
            # Documents exist once per org: copies in other KBs of the same org get their own ids.
            prefix = args.id_prefix
            if prefix is None:
                prefix = f"{kb}_" if args.sample or args.split > 1 else ""
            share = dict(items[i :: len(parts)])
            seconds += ingest(client, part, share, args.chunk_size, prefix, args.model)
        chunks = sum(client.get(f"/v1/kbs/{p}/stats").json()["chunk_count"] for p in parts)
        if seconds:
            print(f"ingested in {seconds:.0f}s ({chunks / seconds:.1f} chunks/s)")
        searched = parts + [x for x in args.also_search.split(",") if x]
        print(
            f"date {datetime.date.today()}  KBs searched {searched}  chunks {chunks}  "
            f"model {args.model or 'default'}  "
            f"chunk_size {args.chunk_size}  top_k {args.top_k}  rrf_k {args.rrf_k}  "
            f"lead_weight {args.lead_weight}  prefetch_limit {args.prefetch_limit}  "
            f"precision {args.precision or 'default'}"
        )
        print("| mode | MRR@10 | Recall@10 | nDCG@10 |\n| --- | --- | --- | --- |")
        results = {}
        for mode in args.modes.split(","):
            results[mode] = evaluate(
                client, searched, queries, qrels, mode, args.top_k, 1 if args.sequential else 4
            )
            m = results[mode]
            timing = (
                f"p50 {m['p50_ms']:.1f} ms, p90 {m['p90_ms']:.1f} ms"
                if args.sequential
                else f"{m['seconds']:.0f}s"
            )
            print(
                f"| {mode} | {m['MRR@10']:.4f} | {m['Recall@10']:.3f} | {m['nDCG@10']:.3f} |"
                f"  ({timing})",
                flush=True,
            )
    if {"hybrid", "dense", "keyword"} <= results.keys():
        best = max(results["dense"]["MRR@10"], results["keyword"]["MRR@10"])
        print(f"hybrid - best single mode: {results['hybrid']['MRR@10'] - best:+.3f}")


if __name__ == "__main__":
    main()
