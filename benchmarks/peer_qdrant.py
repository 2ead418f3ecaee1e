"""kbmesh side by side with the official Qdrant MCP server (mcp-server-qdrant, FastEmbed ONNX)
on the same man-page documents and the same model (all-MiniLM-L6-v2), in one run.

The peer is not part of kbmesh and is not built here: point `--peers-root` (or PEERS_ROOT) at
a directory where it was built offline (a `venv-qdrant` with `mcp-server-qdrant` and a
`fastembed_cache` holding the ONNX export of the packaged weights). Without it, the benchmark
says so and exits.

    python3 ../shared/bench/manpages.py benchmarks/data/man200 --sections 1 --max-docs 200
    PEERS_ROOT=/path/to/peers .venv/bin/python -m benchmarks.peer_qdrant benchmarks/data/man200

Ingest: each system gets every document once, kbmesh through REST uploads with `wait=true`
(64 in flight, each answered once its document is indexed: chunked, every chunk embedded),
the peer through its `qdrant-store` tool (one call per document, as its interface takes
them; it keeps only the first 256 word pieces of each). Over kbmesh's ingest the benchmark
also reads the CPU time of kbmesh's processes (the server, its document encoder children,
its nats-server) and their share of the cores: near 100 %, the ingest is bound by CPU, not
by waiting. Then kbmesh's engine alone (onnxruntime at the precision kbmesh chose, batches
of 32, every core, in this process) embeds the same chunks: the ceiling of any pipeline
around it.

Search: kbmesh `POST /v1/search` (hybrid, top 10 chunks) and the peer's `qdrant-find`
(top 10), after `--warmup` unmeasured searches each (100), in three passes over the queries:

- query by query, alternating which system goes first;
- query by query, the same, with a pause of `--apart` seconds (0.1) before each search;
- in blocks of `--block` queries (20) a system, alternating, with a pause of
  `--switch-pause` seconds (0.2) at each switch.

The passes differ in what the other system leaves running. After each answer the peer's
onnxruntime threads spin on, by default: about 39 ms of CPU within 50 ms of every
`qdrant-find` (measured on 2 cores), so a query that follows one shares the cores with them.
kbmesh's query lane stops spinning when its run ends. The second pass lets each search start
on idle cores (and pays what work after an idle moment costs on these machines); the blocks
pass times each system with its own work only, in steady state. The later passes send each
query title-cased and upper-cased: the model and BM25 see the same lower-case word pieces,
and kbmesh's query cache (keyed on the text) does not answer from an earlier pass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from benchmarks.common import kbmesh_cpu, kbmesh_ingest, kbmesh_up_at, pct
from benchmarks.embedding_throughput import alone, pipeline_chunks
from services.common.embedders import LocalEmbedder
from services.common.embedders.selection import cpu_precision

K = 10
METADATA = re.compile(r"<metadata>(.*?)</metadata>", re.S)


def load_set(directory: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    corpus = [json.loads(line) for line in (directory / "corpus.jsonl").open()]
    queries = {q["_id"]: q["text"] for q in map(json.loads, (directory / "queries.jsonl").open())}
    rel: dict[str, str] = {}
    for line in (directory / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        qid, doc, _ = line.split("\t")
        rel[qid] = doc
    return corpus, [(queries[q], rel[q]) for q in queries if q in rel]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def peer_server(root: Path, data: Path):
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "FASTEMBED_CACHE_PATH": str(root / "fastembed_cache"),
        "QDRANT_LOCAL_PATH": str(data),
        "QDRANT_SEARCH_LIMIT": str(K),
        "COLLECTION_NAME": "kb",
        "EMBEDDING_MODEL": "sentence-transformers/all-MiniLM-L6-v2",
        "FASTMCP_SERVER_HOST": "127.0.0.1",
        "FASTMCP_SERVER_PORT": str(port),
    }
    data.parent.mkdir(parents=True, exist_ok=True)
    log = (data.parent / "peer.log").open("wb")
    proc = subprocess.Popen(
        [str(root / "venv-qdrant" / "bin" / "mcp-server-qdrant"), "--transport", "streamable-http"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError((data.parent / "peer.log").read_text()[-3000:])
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("mcp-server-qdrant did not open its port") from None
                await asyncio.sleep(0.2)
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(120.0, read=300.0)) as http,
            streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http) as (r, w),
            ClientSession(r, w) as session,
        ):
            await session.initialize()
            yield session
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def tool_text(result) -> str:
    text = "".join(getattr(c, "text", "") for c in result.content)
    if result.is_error:
        raise RuntimeError(f"peer tool error: {text[:300]}")
    return text


def chunk_texts(corpus: list[dict]) -> tuple[list[str], int, int]:
    """What kbmesh embeds for `corpus` (every chunk of the plain-text upload with its title
    line before it, as a default KB chunks them) and the word pieces each system embeds:
    kbmesh those of its chunks, the peer each document's first 254 (FastEmbed cuts at 256
    with [CLS] and [SEP])."""
    embedder = LocalEmbedder(backend="onnx")  # its tokenizer only: no model is loaded
    texts = pipeline_chunks(embedder, [(doc["_id"], doc["text"]) for doc in corpus])
    count = embedder.count_tokens
    ours = sum(count(t) for t in texts)
    theirs = sum(min(count(doc["text"]), embedder.max_tokens) for doc in corpus)
    return texts, ours, theirs


def engine_alone(texts: list[str]) -> float:
    """Seconds the chosen engine at the chosen precision takes alone, in this process, for
    kbmesh's chunk `texts`: what no pipeline around it can beat."""
    engine = LocalEmbedder(backend="onnx", precision=cpu_precision())
    engine.load(documents=False)
    return len(texts) / alone(engine, texts)


async def peer_ingest(session: ClientSession, corpus: list[dict]) -> float:
    started = time.perf_counter()
    for doc in corpus:
        tool_text(
            await session.call_tool(
                "qdrant-store", {"information": doc["text"], "metadata": {"id": doc["_id"]}}
            )
        )
    return time.perf_counter() - started


async def peer_find(session: ClientSession, query: str) -> tuple[float, list[str]]:
    started = time.perf_counter()
    text = tool_text(await session.call_tool("qdrant-find", {"query": query}))
    elapsed = time.perf_counter() - started
    ids = [json.loads(m).get("id") for m in METADATA.findall(text.replace('\\"', '"'))]
    return elapsed, ids


async def kbmesh_find(
    client: httpx.AsyncClient, kb_id: str, query: str, names: dict[str, str]
) -> tuple[float, list[str]]:
    body = {"query": query, "kb_ids": [kb_id], "top_k": K}
    started = time.perf_counter()
    r = await client.post("/v1/search", json=body)
    elapsed = time.perf_counter() - started
    r.raise_for_status()
    ranked: list[str] = []
    for hit in r.json()["hits"]:
        doc = names.get(hit["document_id"], "")
        if hit.get("is_matched", True) and doc not in ranked:
            ranked.append(doc)
    return elapsed, ranked


@dataclass
class Pass:
    """One pass over the queries: each system's times and rankings, (kbmesh, peer)."""

    name: str
    times: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    ranked: tuple[list[list[str]], list[list[str]]] = field(default_factory=lambda: ([], []))

    def add(self, kbmesh: bool, found: tuple[float, list[str]]) -> None:
        self.times[not kbmesh].append(found[0])
        self.ranked[not kbmesh].append(found[1])


def mrr(ranked: list[list[str]], relevant: list[str]) -> float:
    total = 0.0
    for got, want in zip(ranked, relevant, strict=True):
        if want in got[:K]:
            total += 1 / (got.index(want) + 1)
    return total / len(relevant)


async def run(
    beir: Path,
    peers: Path,
    max_queries: int | None,
    warmup: int,
    block: int,
    switch_pause: float,
    apart: float,
) -> None:
    corpus, queries = load_set(beir)
    queries = queries[:max_queries] if max_queries else queries
    with tempfile.TemporaryDirectory() as tmp, kbmesh_up_at(Path(tmp) / "kbmesh") as base:
        data = Path(tmp) / "kbmesh"
        async with (
            peer_server(peers, Path(tmp) / "peer" / "qdrant") as peer,
            httpx.AsyncClient(base_url=base, timeout=600) as client,
        ):
            kb_id = (await client.post("/v1/kbs", json={"name": "peer-bench"})).json()["kb_id"]
            before = kbmesh_cpu(data)
            kb_seconds, names, stats = await kbmesh_ingest(client, kb_id, corpus)
            used = {role: cpu - before[role] for role, cpu in kbmesh_cpu(data).items()}
            print(f"kbmesh ingest {kb_seconds:.1f}s {stats}", flush=True)
            peer_seconds = await peer_ingest(peer, corpus)
            print(f"peer ingest {peer_seconds:.1f}s", flush=True)
            chunks, ours, theirs = chunk_texts(corpus)
            alone_seconds = engine_alone(chunks)
            # Warm-up of both search paths, not counted: the first hundreds of searches after
            # a start are slower on both (caches, page faults), and steady state is what
            # clients live with.
            for i in range(warmup):
                q = f"{queries[i % len(queries)][0]} warm {i}"  # never a measured text
                await kbmesh_find(client, kb_id, q, names)
                await peer_find(peer, q)

            async def find(kbmesh: bool, q: str) -> tuple[float, list[str]]:
                if kbmesh:
                    return await kbmesh_find(client, kb_id, q, names)
                return await peer_find(peer, q)

            texts = [q for q, _ in queries]
            one_by_one = Pass("query by query")
            for i, q in enumerate(texts):
                order = (True, False) if i % 2 == 0 else (False, True)
                for kbmesh in order:
                    one_by_one.add(kbmesh, await find(kbmesh, q))
            apart_pass = Pass(f"query by query, {apart:g} s apart")
            for i, q in enumerate(texts):
                order = (True, False) if i % 2 == 0 else (False, True)
                for kbmesh in order:
                    await asyncio.sleep(apart)
                    apart_pass.add(kbmesh, await find(kbmesh, q.title()))
            blocks = Pass(f"in blocks of {block}")
            starts = range(0, len(texts), block)
            for n, start in enumerate(starts):
                order = (True, False) if n % 2 == 0 else (False, True)
                for kbmesh in order:
                    await asyncio.sleep(switch_pause)
                    for q in texts[start : start + block]:
                        blocks.add(kbmesh, await find(kbmesh, q.upper()))
    relevant = [r for _, r in queries]
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  set {beir}")
    print(
        f"documents {len(corpus)}  kbmesh chunks {stats['chunk_count']}  "
        f"queries {len(queries)}  warm-up {warmup} per system"
    )
    print("| figure | kbmesh | mcp-server-qdrant | kbmesh / peer |\n| --- | --- | --- | --- |")
    print(
        f"| ingest, seconds | {kb_seconds:.1f} | {peer_seconds:.1f} | "
        f"{kb_seconds / peer_seconds:.2f} |"
    )
    print(
        f"| word pieces embedded, thousands | {ours / 1000:.0f} | {theirs / 1000:.0f} | "
        f"{ours / theirs:.2f} |"
    )
    ratio = (ours / kb_seconds) / (theirs / peer_seconds)
    print(
        f"| word pieces embedded per second, thousands | {ours / kb_seconds / 1000:.2f} | "
        f"{theirs / peer_seconds / 1000:.2f} | **{ratio:.2f}** |"
    )
    alone = (ours / alone_seconds) / (theirs / peer_seconds)
    print(
        f"| kbmesh's engine alone on its chunks (no pipeline), word pieces/s, thousands | "
        f"{ours / alone_seconds / 1000:.2f} | | {alone:.2f} |"
    )
    cores = len(os.sched_getaffinity(0))
    print(
        "| kbmesh CPU over its ingest, seconds | "
        + ", ".join(f"{role} {cpu:.2f}" for role, cpu in used.items())
        + f" ({sum(used.values()) / (kb_seconds * cores):.0%} of {cores} cores) | | |"
    )
    for done in (one_by_one, apart_pass, blocks):
        kb_times, peer_times = done.times
        for label, (kb, other) in (
            ("p50", (statistics.median(kb_times) * 1000, statistics.median(peer_times) * 1000)),
            ("p99", (pct(kb_times, 0.99), pct(peer_times, 0.99))),
        ):
            print(f"| search {label} ms, {done.name} | {kb:.1f} | {other:.1f} | {kb / other:.2f} |")
        kb_mrr, peer_mrr = (mrr(ranked, relevant) for ranked in done.ranked)
        print(f"| MRR@10 (known item), {done.name} | {kb_mrr:.3f} | {peer_mrr:.3f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("beir_dir", type=Path)
    parser.add_argument("--peers-root", type=Path, default=os.environ.get("PEERS_ROOT"))
    parser.add_argument("--max-queries", type=int)
    parser.add_argument(
        "--warmup", type=int, default=100, help="unmeasured searches per system first"
    )
    parser.add_argument("--block", type=int, default=20, help="queries a block, third pass")
    parser.add_argument(
        "--apart", type=float, default=0.1, help="seconds idle before each search, second pass"
    )
    parser.add_argument(
        "--switch-pause", type=float, default=0.2, help="seconds idle between blocks"
    )
    args = parser.parse_args()
    server = args.peers_root and Path(args.peers_root) / "venv-qdrant" / "bin" / "mcp-server-qdrant"
    if not server or not server.exists():
        print("skipped: mcp-server-qdrant not found; set PEERS_ROOT (or --peers-root) to a")
        print("directory with venv-qdrant/ and fastembed_cache/ built offline")
        sys.exit(0)
    asyncio.run(
        run(
            args.beir_dir,
            Path(args.peers_root),
            args.max_queries,
            args.warmup,
            args.block,
            args.switch_pause,
            args.apart,
        )
    )


if __name__ == "__main__":
    main()
