"""Retrieval on a crawled docs site: does a KB fed by a web source answer as well as the same
pages uploaded as files, and what does reading pages as their main content change?

Debian's python3.11-doc site (`make pydoc`) is served from loopback and crawled by
`WebFetcher`. A known-item set is built from the pages: for each sampled page, a sentence of
its main content that no other sampled page contains is a query whose one relevant document
is that page. The same pages go into four KBs of a real `kbmesh up` (REST → NATS → ingest →
embed → Qdrant):

- uploaded, main content: each page's HTML file as uploaded by a person (name = its path);
- crawled, main content: each page as the web source sends it (its canonical URL as uri, its
  title as name and metadata, the bytes it fetched);
- uploaded / crawled, whole page: the same, read as before main-content extraction (kreuzberg's
  markdown of the whole page, header, sidebar and footer included), sent as that markdown.

MRR@10 (document level, a document at its best chunk) for hybrid, dense and keyword search.

    python -m benchmarks.crawl_quality [--pages 150] [--data-dir DIR | --base-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx
import kreuzberg
import lxml.html

from benchmarks.common import kbmesh_up_at
from benchmarks.quality import evaluate
from services.common.domain.sources import Source
from services.common.settings import Settings
from services.ingest.extract import _HTML_FRONT_MATTER
from services.sources.fetch import Put
from services.sources.web import WebFetcher
from tests.support.website import PYTHON_DOCS, PYTHON_DOCS_MISSING, serve_site

SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# Pages whose main text is within these bounds: enough to hold a sentence worth asking for,
# small enough that four KBs of them embed in minutes on two cores.
MIN_CHARS, MAX_CHARS = 1500, 12000


def main_text(page: bytes) -> tuple[str, list[str]]:
    """The text Sphinx marks as the page's content, and its paragraphs."""
    root = lxml.html.document_fromstring(page)
    main = root.xpath("//div[@role='main']")
    if not main:
        return "", []
    paragraphs = [" ".join(p.text_content().split()) for p in main[0].xpath(".//p")]
    return " ".join(main[0].text_content().split()), paragraphs


def whole_page(page: bytes) -> str:
    """The page as kbmesh read it before main-content extraction."""
    config = kreuzberg.ExtractionConfig(output_format="markdown", use_cache=False)
    content = str(kreuzberg.extract_bytes_sync(page, "text/html", config).content)
    return _HTML_FRONT_MATTER.sub("", content)


async def crawl(base: str) -> dict[str, Put]:
    settings = Settings(egress={"allowlist": ["127.0.0.1/32"]})
    source = Source(
        kind="web",
        kb="python-docs",
        url=f"{base}/index.html",
        org_id="bench",
        source_id="python-docs",
        kb_id="python-docs",
        rate=100,
        max_pages=5000,
    )
    puts: dict[str, Put] = {}
    async for item in WebFetcher(settings).fetch(source, None, None):
        if isinstance(item, Put):
            puts[item.uri] = item
    return puts


def known_items(
    pages: dict[str, bytes], count: int, seed: int
) -> tuple[list[str], dict[str, str], dict[str, dict[str, int]]]:
    """(the sampled pages, queries, qrels): a sentence of each page's main content that no
    other page of the site holds."""
    texts = {path: main_text(body) for path, body in pages.items()}
    eligible = sorted(p for p, (text, _) in texts.items() if MIN_CHARS <= len(text) <= MAX_CHARS)
    rng = random.Random(seed)
    rng.shuffle(eligible)
    everything = {p: t for p, (t, _) in texts.items()}
    chosen: list[str] = []
    queries: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    for path in eligible:
        sentences = [
            s.strip()
            for para in texts[path][1]
            for s in SENTENCE.split(para)
            if 10 <= len(s.split()) <= 30 and not s.strip().startswith(">>>")
        ]
        rng.shuffle(sentences)
        for sentence in sentences:
            if not any(sentence in t for p, t in everything.items() if p != path):
                qid = f"q{len(queries)}"
                queries[qid] = sentence
                qrels[qid] = {path: 1}
                chosen.append(path)
                break
        if len(chosen) == count:
            break
    return chosen, queries, qrels


def load(client: httpx.Client, kb: str, docs: list[dict[str, Any]]) -> float:
    client.post("/v1/kbs", json={"name": kb}).raise_for_status()
    started = time.perf_counter()
    for body in docs:
        r = client.post(f"/v1/kbs/{kb}/documents", json=body)
        if r.status_code >= 400:
            raise SystemExit(f"upload to {kb} failed: {r.status_code} {r.text[:300]}")
    while True:
        stats = client.get(f"/v1/kbs/{kb}/stats").json()
        done = stats["document_count"] + stats["failed_count"]
        print(
            f"\r  {kb}: {stats['document_count']}/{len(docs)} documents, "
            f"{stats['chunk_count']} chunks, {time.perf_counter() - started:.0f}s",
            end="",
            flush=True,
        )
        if done >= len(docs):
            print()
            if stats["failed_count"]:
                print(f"  {stats['failed_count']} failed")
            return time.perf_counter() - started
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", help="a running kbmesh; default: start `kbmesh up`")
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args()
    if not PYTHON_DOCS.is_dir():
        raise SystemExit(PYTHON_DOCS_MISSING)
    files = {
        str(p.relative_to(PYTHON_DOCS)): p.read_bytes()
        for p in sorted(PYTHON_DOCS.rglob("*.html"))
        if not p.is_symlink() and not str(p.relative_to(PYTHON_DOCS)).startswith("_")
    }

    async def crawled_site() -> tuple[str, dict[str, Put]]:
        async with serve_site(PYTHON_DOCS) as base:
            started = time.perf_counter()
            puts = await crawl(base)
            print(f"crawled {len(puts)} pages in {time.perf_counter() - started:.0f}s")
            return base, puts

    base, puts = asyncio.run(crawled_site())
    by_path = {uri.removeprefix(f"{base}/"): put for uri, put in puts.items()}
    chosen, queries, qrels = known_items(
        {p: files[p] for p in by_path if p in files}, args.pages, args.seed
    )
    print(f"{len(chosen)} pages, {len(queries)} known-item queries")
    run = f"{int(time.time()) % 100000}"
    kbs: dict[str, list[dict[str, Any]]] = {
        "uploaded-main": [
            {"name": p, "content": files[p].decode(), "mime_type": "text/html", "uri": p}
            for p in chosen
        ],
        "crawled-main": [
            {
                "name": by_path[p].name,
                "content": by_path[p].content.decode(),
                "mime_type": "text/html",
                "uri": by_path[p].uri,
                "metadata": dict(by_path[p].metadata),
            }
            for p in chosen
        ],
        "uploaded-whole": [
            {"name": p + ".md", "content": whole_page(files[p]), "uri": p} for p in chosen
        ],
        "crawled-whole": [
            {
                "name": by_path[p].name + ".md",
                "content": whole_page(by_path[p].content),
                "uri": by_path[p].uri,
                "metadata": dict(by_path[p].metadata),
            }
            for p in chosen
        ],
    }
    for name, docs in kbs.items():
        for i, (path, doc) in enumerate(zip(chosen, docs, strict=True)):
            doc["metadata"] = {**doc.get("metadata", {}), "beir_id": path}
            doc["document_id"] = f"{name}-{run}-{i}"
    up = kbmesh_up_at(args.data_dir) if not args.base_url else None
    with (
        up or contextlib.nullcontext(args.base_url) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        results: dict[str, dict[str, float]] = {}
        chunks: dict[str, int] = {}
        for name, docs in kbs.items():
            kb = f"{name}-{run}"
            load(client, kb, docs)
            chunks[name] = client.get(f"/v1/kbs/{kb}/stats").json()["chunk_count"]
            for mode in MODES_ORDER:
                results[f"{name}/{mode}"] = evaluate(client, [kb], queries, qrels, mode, 50)
        print(f"\n{len(chosen)} pages, {len(queries)} queries (python3.11-doc, seed {args.seed})")
        print("| KB | chunks | hybrid | dense | keyword |\n| --- | --- | --- | --- | --- |")
        for name in kbs:
            row = " | ".join(f"{results[f'{name}/{m}']['MRR@10']:.4f}" for m in MODES_ORDER)
            print(f"| {name} | {chunks[name]} | {row} |")


MODES_ORDER = ("hybrid", "dense", "keyword")


if __name__ == "__main__":
    main()
