"""`kbmesh backup` and `kbmesh restore` times on the embedded default, at 100k chunks.

Embedding 100k chunks with the local model takes about an hour here, so the stack is loaded
straight, as embed would have left it: a KB made through REST, then, with the stack stopped,
one document record and text per `--per-doc` chunks, its index entry, and its points in the
KB's Qdrant Edge shard, labelled with embed's own payload (real text chunks; dense vectors
from real embeddings of `--real` of them, reused with small Gaussian perturbations; real BM25
vectors of each chunk's text). Then, as an operator would:

1. `kbmesh up` on it, and `kbmesh backup FILE` while it runs (vectors asked of its embed
   service over the bus);
2. the stack stopped, `kbmesh restore FILE --data-dir NEW` (vectors loaded, HNSW built);
3. `kbmesh up` on NEW: the KB's document count and one search checked.

    .venv/bin/python -m benchmarks.backup_restore [--chunks 100000] [--per-doc 10] [--real 500]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import ROOT, bench_env, kbmesh_up_at, stdlib_documents
from services.cli.runtime import start_private_nats
from services.common.bus import auth as busauth
from services.common.bus.client import Bus
from services.common.bus.registry import Registries
from services.common.domain.content import checksum
from services.common.domain.ids import point_id
from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KnowledgeBase,
    kb_tag,
)
from services.common.embedders import EmbedderPool
from services.common.ops.telemetry import configure_telemetry
from services.common.store import ChunkPoint, SparseVector, bm25
from services.common.store.edge import EdgeStore
from services.embed.chunking import chunk_text
from services.embed.service import document_payload

KB_NAME = "backup-bench"
# Documents written at once (three registry writes each): more time out on a busy machine.
WRITES_AT_ONCE = 16


async def chunk_texts(n_real: int) -> tuple[list[str], np.ndarray]:
    """Real text chunks, and real embeddings of `n_real` of them."""
    cache = Path(bench_env()["KBMESH_MODEL_CACHE_DIR"])
    embedder = EmbedderPool(local_backend="onnx", cache_dir=cache).get("local/all-MiniLM-L6-v2")
    kb = KnowledgeBase(org_id="local", kb_id="x", name="x")
    chunks = [
        c.text
        for _, text in stdlib_documents(50)
        for c in chunk_text(text, kb, embedder.tokenizer(), max_tokens=230)
    ]
    real = random.Random(7).sample(chunks, min(n_real, len(chunks)))
    started = time.perf_counter()
    vectors = np.array(await embedder.embed(real), dtype=np.float32)
    took = time.perf_counter() - started
    print(f"{len(chunks)} real text chunks; {len(real)} embedded in {took:.0f} s")
    return chunks, vectors


async def load(data: Path, kb: KnowledgeBase, n_chunks: int, per_doc: int, n_real: int) -> None:
    """Documents, texts, index entries and points for `n_chunks` chunks, as embed writes them."""
    chunks, base = await chunk_texts(n_real)
    noise = np.random.default_rng(7)
    nats = start_private_nats(data)
    bus = Bus(nats.url, configure_telemetry("bench"), busauth.local_credentials(data)["operator"])
    # No index builds while loading: one holds the interpreter lock for seconds, and the
    # registry writes waiting meanwhile time out. One build at the end, as a restore does.
    store = EdgeStore(data / "shards", index_threshold=0)
    started = time.perf_counter()
    try:
        await bus.connect()
        reg = await Registries.open(bus.js)
        await store.ensure_collection(kb.collection_name, base.shape[1])  # as embed makes it
        for first in range(0, n_chunks, per_doc * WRITES_AT_ONCE):
            last = min(n_chunks, first + per_doc * WRITES_AT_ONCE)
            batch = range(first // per_doc, last // per_doc)
            points: list[ChunkPoint] = []
            writes = []
            for d in batch:
                texts = [chunks[(d * per_doc + i) % len(chunks)] for i in range(per_doc)]
                text = "\n\n".join(texts)
                record = DocumentRecord(
                    org_id=kb.org_id,
                    document_id=f"doc{d:06d}",
                    name=f"doc{d:06d}.txt",
                    tags=[kb_tag(kb.kb_id)],
                    checksum=checksum(text),
                    size_bytes=len(text.encode()),
                    status=DocStatus.ready,
                    kb_ids=[kb.kb_id],
                )
                entry = IndexEntry(
                    org_id=kb.org_id,
                    kb_id=kb.kb_id,
                    document_id=record.document_id,
                    revision=record.revision,
                    checksum=record.checksum or "",
                    settings_version=kb.settings_version,
                    chunk_count=per_doc,
                )
                writes += [
                    reg.documents.put(record.key, record),
                    reg.texts.put(record.text_object, text.encode()),
                    reg.index.put(entry.key, entry),
                ]
                payload = document_payload(record)
                for i, content in enumerate(texts):
                    vec = base[(d * per_doc + i) % len(base)] + noise.normal(0, 0.03, base.shape[1])
                    vec = (vec / np.linalg.norm(vec)).astype(np.float32)  # as the engine keeps it
                    sparse = bm25.encode_document(f"{record.name}\n{content}")
                    points.append(
                        ChunkPoint(
                            id=point_id(kb.kb_id, record.document_id, i),
                            dense=vec.tolist(),
                            sparse=SparseVector(sparse.indices, sparse.values),
                            payload={
                                **payload,
                                "kb_id": kb.kb_id,
                                "chunk_index": i,
                                "total_chunks": per_doc,
                                "content": content,
                                "start": 0,
                                "end": len(content),
                                "settings_version": kb.settings_version,
                                "text_checksum": record.checksum,
                            },
                        )
                    )
            await asyncio.gather(*writes)
            await store.upsert(kb.collection_name, points)
        print(f"loaded {n_chunks} chunks in {time.perf_counter() - started:.0f} s")
        started = time.perf_counter()
        await store.optimize(kb.collection_name)
        print(f"optimize() {time.perf_counter() - started:.0f} s")
    finally:
        await store.close()
        await bus.close()
        nats.stop()


def kbmesh(*args: str) -> tuple[float, str]:
    """Run `kbmesh ARGS`; its wall time and output."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"kbmesh {' '.join(args)}: {done.stdout}\n{done.stderr}")
    return took, done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--per-doc", type=int, default=10, help="chunks per document")
    parser.add_argument("--real", type=int, default=500, help="chunks embedded for real")
    args = parser.parse_args()
    (ROOT / "benchmarks" / "data").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks" / "data") as tmp:
        data, restored, archive = Path(tmp) / "a", Path(tmp) / "b", Path(tmp) / "stack.tar.gz"
        with kbmesh_up_at(data) as base:
            r = httpx.post(f"{base}/v1/kbs", json={"name": KB_NAME}, timeout=60)
            r.raise_for_status()
        # The KB as the gateway made it (its defaults are the model's).
        kb = KnowledgeBase(org_id="local", kb_id=r.json()["kb_id"], name=KB_NAME)
        asyncio.run(load(data, kb, args.chunks, args.per_doc, args.real))

        with kbmesh_up_at(data):
            backup_s, wrote = kbmesh("backup", str(archive), "--data-dir", str(data))
        print(wrote)
        restore_s, said = kbmesh("restore", str(archive), "--data-dir", str(restored))
        print(said)
        with kbmesh_up_at(restored) as base:
            got = httpx.get(f"{base}/v1/kbs/{KB_NAME}", timeout=60).json()
            hits = httpx.post(
                f"{base}/v1/search",
                json={"query": "parse command line arguments", "kb_ids": [KB_NAME]},
                timeout=60,
            ).json()["hits"]
        documents = args.chunks // args.per_doc
        if got["document_count"] != documents or not hits:
            raise RuntimeError(f"restored KB: {got}, {len(hits)} hits")
        size = archive.stat().st_size
    print(f"date {datetime.date.today()}  chunks {args.chunks}  documents {documents}")
    print("| step | seconds |\n| --- | --- |")
    print(f"| `kbmesh backup` (stack running) | {backup_s:.0f} |")
    print(f"| `kbmesh restore` | {restore_s:.0f} |")
    print(f"archive {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
