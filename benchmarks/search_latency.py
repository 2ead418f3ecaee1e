"""Hybrid search latency through REST on the embedded default, at 100k+ chunks.

Embedding 100k chunks with the local model takes over an hour here, so the index is loaded
straight into the KB's Qdrant Edge shard: real text chunks (man pages if built, else stdlib
pydoc pages), with dense vectors from real embeddings of a subset of them, reused with small
Gaussian perturbations (renormalised), and real BM25 vectors of each chunk's own text.
Queries always go through `POST /v1/search` and are embedded for real (each query text is
distinct, so the query cache never answers).

    .venv/bin/python -m benchmarks.search_latency [--chunks 100000] [--real 2000] [--breakdown]

`--breakdown` then times five searches on the same server, interleaved query by query (the
order rotating): hybrid, dense and keyword on the KB, and hybrid and keyword on an empty KB.
Keyword on the empty KB is what every search pays around the engine and the model (HTTP,
middleware, the bus, the service); hybrid on the empty KB adds the query embedding; the KB's
keyword and dense add their candidate lists, lookups and fusion.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import ROOT, kbmesh_up_at, stdlib_documents
from services.common.domain.ids import point_id
from services.common.domain.models import KnowledgeBase
from services.common.embedders import EmbedderPool
from services.common.store import ChunkPoint, SparseVector, bm25
from services.common.store.edge import EdgeStore
from services.embed.chunking import chunk_text

MANPAGES = ROOT / "benchmarks" / "data" / "manpages"
TAGS = [f"team-{i}" for i in range(10)]
SOURCES = [f"repo-{i}" for i in range(5)]


def texts_and_queries() -> tuple[list[tuple[str, str]], list[str]]:
    if (MANPAGES / "corpus.jsonl").exists():
        lines = (MANPAGES / "corpus.jsonl").read_text().splitlines()
        docs = [json.loads(line) for line in lines]
        lines = (MANPAGES / "queries.jsonl").read_text().splitlines()
        queries = [json.loads(line)["text"] for line in lines]
        return [(d["title"], d["text"]) for d in docs], queries
    docs = stdlib_documents(50)
    queries = [
        line.strip()
        for _, text in docs
        for line in text.splitlines()
        if 30 < len(line.strip()) < 90
    ][:1200]
    return docs, queries


async def build_points(kb_id: str, n_chunks: int, n_real: int) -> list[ChunkPoint]:
    docs, _ = texts_and_queries()
    embedder = EmbedderPool(local_backend="onnx").get("local/all-MiniLM-L6-v2")
    kb = KnowledgeBase(org_id="local", kb_id=kb_id, name="latency")
    chunks: list[tuple[str, str]] = []
    for title, text in docs:
        for c in chunk_text(text[:60000], kb, embedder.tokenizer(), max_tokens=230):
            chunks.append((title, c.text))
    print(f"{len(chunks)} real text chunks; embedding {n_real} of them for real")
    rng = random.Random(7)
    real = rng.sample(chunks, min(n_real, len(chunks)))
    started = time.perf_counter()
    base = np.array(await embedder.embed([f"{t}\n{c}" for t, c in real]), dtype=np.float32)
    print(f"  {len(real)} embeddings in {time.perf_counter() - started:.0f}s")
    noise = np.random.default_rng(7)
    points = []
    per_doc = 10
    for i in range(n_chunks):
        title, text = chunks[i % len(chunks)]
        vec = base[i % len(base)] + noise.normal(0, 0.03, base.shape[1]).astype(np.float32)
        vec /= np.linalg.norm(vec)
        doc = f"doc{i // per_doc}"
        sparse = bm25.encode_document(f"{title}\n{text}")
        points.append(
            ChunkPoint(
                id=point_id(kb_id, doc, i % per_doc),
                dense=vec.tolist(),
                sparse=SparseVector(sparse.indices, sparse.values),
                payload={
                    "org_id": "local",
                    "kb_id": kb_id,
                    "document_id": doc,
                    "document_name": title,
                    "document_name_exact": title,
                    "source_id": SOURCES[(i // per_doc) % len(SOURCES)],
                    "uri": None,
                    "tags": [TAGS[(i // per_doc) % len(TAGS)]],
                    "collection": None,
                    "metadata": {},
                    "uploaded_at": "2026-11-01T00:00:00+00:00",
                    "revision": 1,
                    "chunk_index": i % per_doc,
                    "total_chunks": per_doc,
                    "content": text,
                    "settings_version": 1,
                },
            )
        )
    return points


def distinct(queries: list[str], count: int) -> list[str]:
    """`count` different query texts (the query cache must never answer), cycling through
    the real queries with a round marker once they run out."""
    return [
        q if i < len(queries) else f"{q} {i // len(queries)}"
        for i, q in ((i, queries[i % len(queries)]) for i in range(count))
    ]


def wait_for_document_ids(base: str, timeout: float = 300.0) -> float:
    """Seconds until search's background read of document ids has ended (its gauge in
    `/metrics` back at 0)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        body = httpx.get(f"{base}/metrics", timeout=30).text
        reads = [
            sample.value
            for family in text_string_to_metric_families(body)
            for sample in family.samples
            if sample.name == "kbmesh_search_document_id_reads"
        ]
        if not reads:
            raise RuntimeError("/metrics has no kbmesh_search_document_id_reads")
        if reads[0] == 0:
            return time.perf_counter() - started
        time.sleep(0.5)
    raise TimeoutError("search's document ids were still being read")


def measure(
    base: str,
    kb: str,
    queries: list[str],
    concurrency: int,
    filters: dict | None,
    warmup: list[str],
    mode: str = "hybrid",
) -> dict[str, float]:
    def one(query: str) -> float:
        body = {"query": query, "kb_ids": [kb], "top_k": 10, "mode": mode}
        if filters:
            body["filters"] = filters
        started = time.perf_counter()
        r = client.post("/v1/search", json=body)
        elapsed = time.perf_counter() - started
        r.raise_for_status()
        return elapsed

    with httpx.Client(
        base_url=base, timeout=60, limits=httpx.Limits(max_connections=concurrency + 4)
    ) as client:
        for q in warmup:  # distinct texts, never measured
            one(q)
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            latencies = sorted(pool.map(one, queries))
        wall = time.perf_counter() - started
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "rps": len(latencies) / wall,
        "n": len(latencies),
    }


def breakdown(base: str, queries: list[str], rounds: int) -> dict[tuple[str, str], float]:
    """p50 ms of each (KB, mode) search, interleaved query by query (see the docstring)."""
    made = httpx.post(f"{base}/v1/kbs", json={"name": "latency-empty"})
    if made.status_code != 409:  # 409: made by an earlier run on the same --data-dir
        made.raise_for_status()
    arms = [
        ("latency", "hybrid"),
        ("latency", "dense"),
        ("latency", "keyword"),
        ("latency-empty", "hybrid"),
        ("latency-empty", "keyword"),
    ]
    times: dict[tuple[str, str], list[float]] = {arm: [] for arm in arms}
    texts = iter(queries)
    with httpx.Client(base_url=base, timeout=60) as client:
        for n in range(rounds):
            for kb, mode in arms[n % len(arms) :] + arms[: n % len(arms)]:
                body = {"query": next(texts), "kb_ids": [kb], "top_k": 10, "mode": mode}
                started = time.perf_counter()
                client.post("/v1/search", json=body).raise_for_status()
                times[(kb, mode)].append(time.perf_counter() - started)
    return {arm: statistics.median(t) * 1000 for arm, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--real", type=int, default=2000, help="chunks embedded for real")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument(
        "--breakdown", action="store_true", help="then time searches by mode and on an empty KB"
    )
    args = parser.parse_args()
    _, queries = texts_and_queries()
    random.Random(1).shuffle(queries)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp)
        with kbmesh_up_at(data) as base:
            r = httpx.post(f"{base}/v1/kbs", json={"name": "latency"})
            kb_id = (
                r.json()["kb_id"]
                if r.status_code == 201
                else httpx.get(f"{base}/v1/kbs/latency").json()["kb_id"]
            )
            httpx.post(
                f"{base}/v1/kbs/latency/documents",
                params={"wait": "true"},
                json={"name": "seed", "content": "creates the collection"},
                timeout=120,
            )

        async def load() -> None:
            store = EdgeStore(data / "shards")
            name = f"kb_{kb_id}"
            if await store.count(name) < args.chunks:
                points = await build_points(kb_id, args.chunks, args.real)
                started = time.perf_counter()
                for i in range(0, len(points), 1000):
                    await store.upsert(name, points[i : i + 1000])
                print(f"  loaded {len(points)} points in {time.perf_counter() - started:.0f}s")
                started = time.perf_counter()
                await store.optimize(name)
                print(f"  optimize() {time.perf_counter() - started:.0f}s")
            print(f"  collection holds {await store.count(name)} points")
            await store.close()

        asyncio.run(load())
        with kbmesh_up_at(data) as base:
            n = args.queries
            two = {"tags": ["team-3"], "source_ids": ["repo-3", "repo-1"]}
            pool = distinct(queries, 14 * n + 315)
            # Unmeasured and never reused: 5 queries before each later run.
            warmups = [pool[9 * n + 5 * i : 9 * n + 5 * (i + 1)] for i in range(3)]
            # The first queries after a start are slower (the engine's mapped index pages,
            # caches, and search reading every chunk's document id in the background, ~15 s
            # at 100k): measured on their own; then, once that read has ended, 300 more
            # queries unmeasured, and every run in steady state.
            runs = [
                ("hybrid, concurrency 1, first queries after start", pool[:n], 1, None, []),
                ("hybrid, concurrency 1", pool[n : 2 * n], 1, None, pool[9 * n + 15 : 9 * n + 315]),
                ("hybrid, concurrency 16", pool[2 * n : 5 * n], 16, None, warmups[0]),
                ("hybrid + 2 filters, concurrency 1", pool[5 * n : 6 * n], 1, two, warmups[1]),
                ("hybrid + 2 filters, concurrency 16", pool[6 * n : 9 * n], 16, two, warmups[2]),
            ]
            rows = []
            for name, batch, concurrency, filters, warmup in runs:
                rows.append((name, measure(base, "latency", batch, concurrency, filters, warmup)))
                print(f"  {name}: {rows[-1][1]}", flush=True)
                if len(rows) == 1:
                    waited = wait_for_document_ids(base)
                    print(f"  document ids read {waited:.1f} s after the first run", flush=True)
            parts = breakdown(base, pool[9 * n + 315 :], n) if args.breakdown else {}
    print(f"date {datetime.date.today()}  chunks {args.chunks}  real embeddings {args.real}")
    print("| run | queries | p50 ms | p99 ms | requests/s |\n| --- | --- | --- | --- | --- |")
    for name, m in rows:
        print(f"| {name} | {m['n']} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['rps']:.0f} |")
    if parts:
        print("| search, concurrency 1, interleaved | p50 ms |\n| --- | --- |")
        for (kb, mode), p50 in parts.items():
            where = "an empty KB" if kb.endswith("empty") else "the KB"
            print(f"| {mode} on {where} | {p50:.1f} |")


if __name__ == "__main__":
    main()
