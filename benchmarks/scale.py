"""The cost curve of the embedded default as one KB grows: 10k, 100k, 300k, 1M chunks.

One KB is grown through the sizes (`--sizes`), and at each size a fresh `kbmesh up` on the
data dir is measured: time from start to ready, hybrid / dense / keyword p50 and p99 through
`POST /v1/search` at concurrency 1 and 16 (requests/s at 16), with two filters (a tag and
two source ids) and without, resident memory of the server process and of its nats-server,
and bytes on disk per chunk (the KB's shard directory, and the whole data dir).

The index is loaded straight into the KB's Qdrant Edge shard, as `benchmarks.search_latency`
does (the local model cannot embed a million chunks in a benchmark's time): the real text
chunks of the corpus (man pages from `/work/shared/bench/manpages.py` in
`benchmarks/data/manpages` if built, else stdlib pydoc pages), each replicated with distinct
ids (copy r of document d is the document `r-d`, its chunks keep their text and BM25
vector), and dense vectors from real embeddings of `--real` of those chunks, reused with small
Gaussian perturbations. Queries are the corpus's own queries, each text distinct and
embedded for real.

    python -m benchmarks.scale [--sizes 10000,100000,300000,1000000] [--data-dir DIR]
        [--ingest DOCS] [--skip-search]
    python -m benchmarks.scale --alternate DATA_A[:CHECKOUT_A] DATA_B[:CHECKOUT_B]

`--ingest DOCS` then uploads the corpus's first DOCS documents through REST into the full
KB and into an empty one, in alternating blocks, and prints the chunks/s of each.
`--alternate` serves two grown data dirs at once (each from this checkout or another, for
before / after figures of a change) and compares their hybrid, dense and keyword p50 and p99
query by query.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import ROOT, kbmesh_ingest, kbmesh_up_at
from benchmarks.search_latency import (
    SOURCES,
    TAGS,
    distinct,
    measure,
    texts_and_queries,
    wait_for_document_ids,
)
from services.common.domain.ids import point_id
from services.common.domain.models import KnowledgeBase
from services.common.embedders import EmbedderPool
from services.common.store import ChunkPoint, SparseVector, bm25
from services.common.store.edge import INDEX_THRESHOLD, EdgeStore
from services.embed.chunking import chunk_text

KB = "scale"
PER_DOC = 10  # chunks a synthetic document holds
BATCH = 1000  # points per upsert while loading
TAIL = INDEX_THRESHOLD  # points added after the big build, indexed as a growing KB's are
SEGMENT_POINTS = 90_000  # 384-dim points that fill one segment of `MAX_SEGMENT_KB`
TWO_FILTERS = {"tags": ["team-3"], "source_ids": ["repo-3", "repo-1"]}


class Corpus:
    """Real chunks (title, text, BM25 vector) and real dense vectors to perturb."""

    def __init__(self, kb_id: str) -> None:
        docs, _ = texts_and_queries()
        embedder = EmbedderPool(local_backend="onnx").get("local/all-MiniLM-L6-v2")
        kb = KnowledgeBase(org_id="local", kb_id=kb_id, name=KB)
        self.chunks: list[tuple[str, str]] = [
            (title, c.text)
            for title, text in docs
            for c in chunk_text(text[:60000], kb, embedder.tokenizer(), max_tokens=230)
        ]
        self.sparse = [bm25.encode_document(f"{t}\n{c}") for t, c in self.chunks]
        self.embedder = embedder
        self.documents = len(docs)
        self.base = np.empty((0, 0), dtype=np.float32)

    @classmethod
    async def build(cls, kb_id: str, n_real: int) -> Corpus:
        corpus = cls(kb_id)
        real = random.Random(7).sample(corpus.chunks, min(n_real, len(corpus.chunks)))
        started = time.perf_counter()
        vectors = await corpus.embedder.embed([f"{t}\n{c}" for t, c in real])
        corpus.base = np.array(vectors, dtype=np.float32)
        print(
            f"{corpus.documents} documents, {len(corpus.chunks)} real text chunks; {len(real)} "
            f"embedded for real in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        return corpus

    def points(self, kb_id: str, start: int, stop: int) -> Iterator[list[ChunkPoint]]:
        """Points `start`..`stop` of the grown KB, `BATCH` at a time. Point i is chunk
        i % len(chunks) of the corpus, in copy i // len(chunks)."""
        noise = np.random.default_rng(start)
        n = len(self.chunks)
        for first in range(start, stop, BATCH):
            batch = []
            last = min(stop, first + BATCH)
            vecs = self.base[np.arange(first, last) % len(self.base)] + noise.normal(
                0, 0.03, (last - first, self.base.shape[1])
            ).astype(np.float32)
            vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
            for i, vec in zip(range(first, last), vecs, strict=True):
                title, text = self.chunks[i % n]
                sparse = self.sparse[i % n]
                doc = f"{i // n}-{(i % n) // PER_DOC}"
                group = i // PER_DOC
                batch.append(
                    ChunkPoint(
                        id=point_id(kb_id, doc, i % PER_DOC),
                        dense=vec.tolist(),
                        sparse=SparseVector(sparse.indices, sparse.values),
                        payload={
                            "org_id": "local",
                            "kb_id": kb_id,
                            "document_id": doc,
                            "document_name": title,
                            "document_name_exact": title,
                            "source_id": SOURCES[group % len(SOURCES)],
                            "uri": None,
                            "tags": [TAGS[group % len(TAGS)]],
                            "collection": None,
                            "metadata": {},
                            "uploaded_at": "2026-11-01T00:00:00+00:00",
                            "revision": 1,
                            "chunk_index": i % PER_DOC,
                            "total_chunks": PER_DOC,
                            "content": text,
                            "settings_version": 1,
                        },
                    )
                )
            yield batch


async def grow(
    shards: Path, name: str, corpus: Callable[[], Awaitable[Corpus]], kb_id: str, size: int
) -> dict:
    """Load points until the KB's shard holds `size`, building its index a segment at a
    time for all but the last `TAIL` points, then those as the store's own builds take
    them in (every `INDEX_THRESHOLD` new vectors), timed on their own: what a build costs a
    growing KB."""
    store = EdgeStore(shards, index_threshold=0)
    loaded = built = 0.0
    try:
        have = await store.count(name)
        split = max(have, size - TAIL)
        # Built a capped segment's worth at a time, so the KB has the layout uploads give it
        # (full segments of the store's cap, `MAX_SEGMENT_KB`); one build of everything would
        # make one segment of any size, which no growing KB has.
        for start in range(have, split, SEGMENT_POINTS):
            started = time.perf_counter()
            stop = min(split, start + SEGMENT_POINTS)
            for batch in (await corpus()).points(kb_id, start, stop):
                await store.upsert(name, batch)
            loaded += time.perf_counter() - started
            started = time.perf_counter()
            await store.optimize(name)
            built += time.perf_counter() - started
            print(f"  {stop} points, index {built:.0f} s so far", flush=True)
        tail = None
        if size > split:
            for batch in (await corpus()).points(kb_id, split, size):
                await store.upsert(name, batch)
            started = time.perf_counter()
            await store.optimize(name)
            tail = time.perf_counter() - started
        count = await store.count(name)
    finally:
        await store.close()
    print(
        f"  {count} points: loaded {size - have} in {loaded:.0f} s, index {built:.0f} s, "
        f"then {size - split} more indexed in {tail or 0:.1f} s",
        flush=True,
    )
    return {"points": count, "load_s": loaded, "index_s": built, "tail_index_s": tail}


def ingest_ratio(data: Path, kb_id: str, n_docs: int, block: int) -> dict[str, float]:
    """The same `n_docs` documents uploaded through REST into an empty KB and into the full
    one, in alternating blocks (the order swapping each block) so both see the same load;
    chunks/s of each."""
    docs, _ = texts_and_queries()
    corpus = [{"_id": title, "text": text} for title, text in docs[:n_docs]]
    seconds = {"empty": 0.0, "full": 0.0}

    async def run(base: str) -> dict[str, int]:
        async with httpx.AsyncClient(base_url=base, timeout=1200) as client:
            r = await client.post("/v1/kbs", json={"name": f"empty-{uuid.uuid4().hex[:8]}"})
            r.raise_for_status()
            kbs = {"empty": r.json()["kb_id"], "full": kb_id}
            for n, start in enumerate(range(0, len(corpus), block)):
                part = corpus[start : start + block]
                for side in ("empty", "full") if n % 2 == 0 else ("full", "empty"):
                    took, _, _ = await kbmesh_ingest(client, kbs[side], part)
                    seconds[side] += took
                print(f"    {start + len(part)} documents: {seconds}", flush=True)
            stats = (await client.get(f"/v1/kbs/{kbs['empty']}/stats")).json()
            return {"chunks": stats["chunk_count"], "documents": stats["document_count"]}

    with kbmesh_up_at(data) as base:
        counted = asyncio.run(run(base))
    chunks = counted["chunks"]
    return {
        "documents": counted["documents"],
        "chunks": chunks,
        "empty_chunks_per_s": chunks / seconds["empty"],
        "full_chunks_per_s": chunks / seconds["full"],
        "ratio": seconds["empty"] / seconds["full"],
    }


def processes(data: Path) -> dict[str, int]:
    """Resident bytes of the `kbmesh up` serving `data` and of each process it started."""
    rss: dict[str, int] = {"server": 0, "nats-server": 0, "encoders": 0}
    table: dict[int, tuple[int, str, int]] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text()
            resident = int((entry / "statm").read_text().split()[1]) * page
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        table[int(entry.name)] = (parent, command, resident)
    roots = {p for p, (_, c, _) in table.items() if f"--data-dir {data}" in c and " up " in c}
    below = set(roots)
    while more := {p for p, (parent, _, _) in table.items() if parent in below} - below:
        below |= more
    for pid in below:
        _, command, resident = table[pid]
        role = (
            "nats-server"
            if "nats-server" in command
            else "encoders"
            if "multiprocessing" in command
            else "server"
        )
        rss[role] += resident
    return rss


def disk(path: Path) -> int:
    """Bytes the files under `path` occupy: allocated blocks, not sizes (the engine's
    files are sparse, and their sizes overstate the disk they use about threefold)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def measure_size(data: Path, name: str, queries: list[str], n: int) -> dict[str, Any]:
    started = time.perf_counter()
    with kbmesh_up_at(data) as base:
        ready = time.perf_counter() - started
        pool = iter(distinct(queries, 40 * n + 2000))

        def take(k: int) -> list[str]:
            return [next(pool) for _ in range(k)]

        first = measure(base, KB, take(20), 1, None, [])
        id_read = wait_for_document_ids(base, timeout=900)
        measure(base, KB, take(200), 1, None, [])  # unmeasured: the same steady state for all
        rows: dict[str, dict[str, float]] = {}
        for mode in ("hybrid", "dense", "keyword"):
            for filters in (None, TWO_FILTERS):
                for concurrency in (1, 16):
                    label = f"{mode}{' + 2 filters' if filters else ''}, c{concurrency}"
                    batch = take(n if concurrency == 1 else 2 * n)
                    rows[label] = measure(base, KB, batch, concurrency, filters, take(5), mode=mode)
                    print(f"    {label}: {fmt(rows[label])}", flush=True)
        rss = processes(data)
    return {
        "ready_s": ready,
        "first_p50_ms": first["p50_ms"],
        "ids_read_s": id_read,
        "rss": rss,
        "shard_bytes": disk(data / "shards" / name),
        "data_bytes": disk(data),
        "rows": rows,
    }


def fmt(m: dict[str, float]) -> str:
    return f"p50 {m['p50_ms']:.1f} ms, p99 {m['p99_ms']:.1f} ms, {m['rps']:.0f}/s"


def alternate(sides: list[tuple[Path, Path]], queries: list[str], n: int) -> None:
    """Two stacks (data dir, checkout) at once, hybrid, dense and keyword searches at
    concurrency 1 alternating query by query (which side goes first swapping each round),
    after each has answered the same warm-up and read its document ids: the ratio of their
    p50s holds whatever the machine's load does meanwhile."""
    modes = ("hybrid", "dense", "keyword")
    pool = distinct(queries, 2 * n + 400)
    with contextlib.ExitStack() as stack:
        bases = [stack.enter_context(kbmesh_up_at(d, root=r)) for d, r in sides]
        clients = [stack.enter_context(httpx.Client(base_url=b, timeout=60)) for b in bases]
        times: dict[str, list[list[float]]] = {mode: [[], []] for mode in modes}
        for i, query in enumerate(pool):
            if i == 200:
                for base in bases:
                    wait_for_document_ids(base, timeout=900)
            for mode in modes:
                for side in (0, 1) if i % 2 == 0 else (1, 0):
                    started = time.perf_counter()
                    body = {"query": query, "kb_ids": [KB], "top_k": 10, "mode": mode}
                    clients[side].post("/v1/search", json=body).raise_for_status()
                    if i >= 400:  # after the warm-up and the document ids' read
                        times[mode][side].append(time.perf_counter() - started)
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {machine()}")
    for mode in modes:
        p50 = [statistics.median(t) * 1000 for t in times[mode]]
        p99 = [sorted(t)[int(len(t) * 0.99) - 1] * 1000 for t in times[mode]]
        for (data, root), a, b in zip(sides, p50, p99, strict=True):
            print(f"| {data} ({root}) | {mode} c1 p50 {a:.1f} ms | p99 {b:.1f} ms |")
        print(
            f"{mode} p50 ratio second / first: {p50[1] / p50[0]:.3f}, "
            f"p99 {p99[1] / p99[0]:.3f}  ({len(times[mode][0])} queries each)"
        )


def machine() -> str:
    model = flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
            flags = " ".join(f for f in wanted if f in have)
    return f"{model}, {os.cpu_count()} cores, {flags}; python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10000,100000,300000,1000000")
    parser.add_argument("--real", type=int, default=2000, help="chunks embedded for real")
    parser.add_argument("--queries", type=int, default=200, help="per run at concurrency 1")
    parser.add_argument("--data-dir", type=Path, help="kept, and grown further on a rerun")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--ingest",
        type=int,
        default=0,
        metavar="DOCS",
        help="then upload DOCS documents into the full KB and into an empty one (chunks/s)",
    )
    parser.add_argument("--ingest-block", type=int, default=50)
    parser.add_argument(
        "--skip-search", action="store_true", help="grow the KB only (then --ingest)"
    )
    parser.add_argument(
        "--alternate",
        nargs=2,
        metavar="DATA[:CHECKOUT]",
        help="compare two grown data dirs (each served by this or another checkout) query "
        "by query instead",
    )
    args = parser.parse_args()
    if args.alternate:
        _, queries = texts_and_queries()
        random.Random(1).shuffle(queries)
        sides = [
            (Path(a.split(":")[0]), Path(a.split(":")[1]) if ":" in a else ROOT)
            for a in args.alternate
        ]
        alternate(sides, queries, args.queries)
        return
    sizes = sorted(int(s) for s in args.sizes.split(","))
    _, queries = texts_and_queries()
    random.Random(1).shuffle(queries)
    print(f"machine: {machine()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp)
        with kbmesh_up_at(data) as base:
            r = httpx.post(f"{base}/v1/kbs", json={"name": KB})
            if r.status_code not in (201, 409):
                r.raise_for_status()
            kb_id = httpx.get(f"{base}/v1/kbs/{KB}").json()["kb_id"]
            httpx.post(  # creates the collection with the KB's own settings
                f"{base}/v1/kbs/{KB}/documents",
                params={"wait": "true"},
                json={"name": "seed", "content": "creates the collection"},
                timeout=300,
            ).raise_for_status()
        name = f"kb_{kb_id}"
        made: list[Corpus] = []

        async def corpus() -> Corpus:  # made only when the KB grows
            if not made:
                made.append(await Corpus.build(kb_id, args.real))
            return made[0]

        for size in sizes:
            print(f"size {size}", flush=True)
            loaded = asyncio.run(grow(data / "shards", name, corpus, kb_id, size))
            if not args.skip_search:
                measured = measure_size(data, name, queries, args.queries)
                results.append({"size": size, **loaded, **measured})
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
        if args.ingest:
            ingested = ingest_ratio(data, kb_id, args.ingest, args.ingest_block)
            print(f"ingest into {sizes[-1]:,} chunks vs an empty KB: {ingested}", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"curve": results, "ingest": ingested}, indent=1))
        if args.data_dir is None:
            shutil.rmtree(data, ignore_errors=True)
    if results:
        report(results)


def report(results: list[dict]) -> None:
    print(f"\ndate {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {machine()}")
    sizes = [r["size"] for r in results]
    head = " | ".join(f"{s:,}" for s in sizes)
    print(f"| chunks | {head} |\n| --- |{' --- |' * len(sizes)}")
    for label in results[0]["rows"]:
        cells = []
        for r in results:
            m = r["rows"][label]
            extra = f", {m['rps']:.0f}/s" if label.endswith("c16") else ""
            cells.append(f"{m['p50_ms']:.1f} / {m['p99_ms']:.1f}{extra}")
        print(f"| {label}: p50 / p99 ms | {' | '.join(cells)} |")
    rows = {
        "start to ready, s": lambda r: f"{r['ready_s']:.1f}",
        "first 20 searches p50, ms": lambda r: f"{r['first_p50_ms']:.1f}",
        "server RSS, MiB": lambda r: f"{r['rss']['server'] / 2**20:.0f}",
        "nats-server RSS, MiB": lambda r: f"{r['rss']['nats-server'] / 2**20:.0f}",
        "server RSS per chunk, bytes": lambda r: f"{r['rss']['server'] / r['points']:.0f}",
        "KB shard on disk per chunk, bytes": lambda r: f"{r['shard_bytes'] / r['points']:.0f}",
        "data dir per chunk, bytes": lambda r: f"{r['data_bytes'] / r['points']:.0f}",
        "load + index build, s": lambda r: f"{r['load_s']:.0f} + {r['index_s']:.0f}",
        f"index build of the last {TAIL:,}, s": lambda r: f"{r['tail_index_s'] or 0:.1f}",
    }
    for label, cell in rows.items():
        print(f"| {label} | {' | '.join(cell(r) for r in results)} |")
    # What each further chunk costs, free of the fixed costs (the model, the runtime, the
    # engine's files) that dominate the per-chunk figures at small sizes.
    for label, key in (("server RSS", "rss"), ("KB shard on disk", "shard_bytes")):
        cells = ["-"]
        for a, b in itertools.pairwise(results):
            grown = b[key]["server"] - a[key]["server"] if key == "rss" else b[key] - a[key]
            cells.append(f"{grown / (b['points'] - a['points']):.0f}")
        print(f"| {label} per chunk added, bytes | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
