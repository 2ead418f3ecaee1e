"""Chunks/s of the raw local model vs. the whole pipeline (REST → NATS → ingest → embed →
Qdrant Edge), on the same documents, in one run.

    .venv/bin/python benchmarks/embedding_throughput.py [--docs 30]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import time

import httpx

from benchmarks.common import kbmesh_up, stdlib_documents
from services.common.embedders import EmbedderPool
from services.common.models import KnowledgeBase
from services.embed.chunking import chunk_text
from services.embed.service import TITLE_TOKEN_BUDGET


async def raw_model(docs: list[tuple[str, str]]) -> tuple[int, float]:
    """Chunk exactly as the pipeline does, then time only the model on those chunks."""
    embedder = EmbedderPool().get("local/all-MiniLM-L6-v2")
    embedder.load()  # type: ignore[attr-defined]
    kb = KnowledgeBase(org_id="bench", kb_id="bench", name="bench")
    texts = []
    for name, text in docs:
        budget = min(embedder.count_tokens(name) + 1, TITLE_TOKEN_BUDGET)
        chunks = chunk_text(text, kb, embedder.tokenizer(), max_tokens=embedder.max_tokens - budget)
        texts += [f"{name}\n{c.text}" for c in chunks]
    started = time.perf_counter()
    await embedder.embed(texts)
    return len(texts), time.perf_counter() - started


def pipeline(docs: list[tuple[str, str]]) -> tuple[int, float]:
    with kbmesh_up() as base, httpx.Client(base_url=base, timeout=600) as client:
        started = time.perf_counter()
        for name, text in docs:
            client.post(
                "/v1/kbs/default/documents", json={"name": name, "content": text}
            ).raise_for_status()
        while True:
            stats = client.get("/v1/kbs/default/stats").json()
            if stats["document_count"] >= len(docs):
                return stats["chunk_count"], time.perf_counter() - started
            time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=30)
    args = parser.parse_args()
    docs = stdlib_documents(args.docs)
    raw_chunks, raw_seconds = asyncio.run(raw_model(docs))
    pipe_chunks, pipe_seconds = pipeline(docs)
    raw_rate, pipe_rate = raw_chunks / raw_seconds, pipe_chunks / pipe_seconds
    print(f"date: {datetime.date.today()}  documents: {len(docs)}")
    print(f"raw model:  {raw_chunks} chunks in {raw_seconds:.1f}s = {raw_rate:.1f} chunks/s")
    print(f"pipeline:   {pipe_chunks} chunks in {pipe_seconds:.1f}s = {pipe_rate:.1f} chunks/s")
    print(f"pipeline / raw: {pipe_rate / raw_rate:.2f}")


if __name__ == "__main__":
    main()
