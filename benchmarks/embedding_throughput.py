"""Chunks/s of the whole pipeline (REST → NATS → ingest → embed → Qdrant Edge, on the
default local backend, `auto`) against the chosen engine alone at the chosen precision
(onnxruntime, batches of 32, every core) and torch fp32 sentence-transformers alone, on the
same chunks, in one run: both references before and after the pipeline (their mean is the
reference, so the machine's drift during the run falls on both sides).

    .venv/bin/python -m benchmarks.embedding_throughput [--docs 30] [--precision int8]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import time

import httpx

from benchmarks.common import kbmesh_ingest, kbmesh_up, stdlib_documents
from services.common.domain.models import KnowledgeBase
from services.common.embedders import LocalEmbedder
from services.common.embedders.cpu import cpu_kind, cpu_model
from services.common.embedders.selection import cpu_precision
from services.embed.chunking import chunk_text
from services.embed.service import TITLE_TOKEN_BUDGET

MODEL = "local/all-MiniLM-L6-v2"


def pipeline_chunks(embedder: LocalEmbedder, docs: list[tuple[str, str]]) -> list[str]:
    """The texts embed will embed for `docs` in a default KB (title line included)."""
    kb = KnowledgeBase(org_id="bench", kb_id="bench", name="bench")
    texts = []
    for name, text in docs:
        budget = min(embedder.count_tokens(name) + 1, TITLE_TOKEN_BUDGET)
        chunks = chunk_text(text, kb, embedder.tokenizer(), max_tokens=embedder.max_tokens - budget)
        texts += [f"{name}\n{c.text}" for c in chunks]
    return texts


def alone(embedder: LocalEmbedder, texts: list[str]) -> float:
    """Chunks/s of the model alone, in batches of 32 as sentence-transformers would run."""
    started = time.perf_counter()
    for i in range(0, len(texts), 32):
        embedder.encode(texts[i : i + 32])
    return len(texts) / (time.perf_counter() - started)


def pipeline(docs: list[tuple[str, str]], **env: str) -> tuple[int, float]:
    """(chunks indexed, chunks/s) from the first upload until every document is searchable,
    each upload waiting on the server (`kbmesh_ingest`)."""

    async def run(base: str) -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=base, timeout=None) as client:
            corpus = [{"_id": name, "text": text} for name, text in docs]
            seconds, _, stats = await kbmesh_ingest(client, "default", corpus)
            return stats["chunk_count"], stats["chunk_count"] / seconds

    with kbmesh_up(**env) as base:
        return asyncio.run(run(base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=30)
    parser.add_argument("--precision", choices=("fp32", "int8"), help="default: this CPU's")
    args = parser.parse_args()
    docs = stdlib_documents(args.docs)
    precision = args.precision or cpu_precision()
    torch = LocalEmbedder(MODEL, backend="torch", device="cpu")
    engine = LocalEmbedder(MODEL, backend="onnx", precision=precision)
    torch.load()
    engine.load()
    texts = pipeline_chunks(engine, docs)
    before = alone(torch, texts), alone(engine, texts)
    chunks, pipe_rate = pipeline(docs, KBMESH_LOCAL_PRECISION=precision)
    after = alone(torch, texts), alone(engine, texts)
    torch_rate, engine_rate = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    print(f"date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  {cpu_model()}")
    print(f"cpu kind: {cpu_kind()}  documents: {len(docs)}  chunks: {len(texts)}")
    print(f"torch fp32 alone:         {before[0]:.1f} / {after[0]:.1f} chunks/s (before/after)")
    print(f"onnxruntime {precision} alone: {before[1]:.1f} / {after[1]:.1f} chunks/s")
    print(f"whole pipeline ({precision}):  {pipe_rate:.1f} chunks/s ({chunks} chunks indexed)")
    print(f"pipeline / engine alone: {pipe_rate / engine_rate:.2f}  (target >= 0.9)")
    print(f"pipeline / torch fp32 alone: {pipe_rate / torch_rate:.2f}  (target >= 1.5)")


if __name__ == "__main__":
    main()
