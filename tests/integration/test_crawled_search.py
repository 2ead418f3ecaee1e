"""A crawled docs site searched through the real stack (REST → NATS → ingest → embed →
Qdrant): each page the web source sends is found by its own content, and the header, sidebar
and footer every page repeats are not indexed at all."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.domain.sources import Source
from services.common.settings import Settings
from services.sources.fetch import Put
from services.sources.web import WebFetcher
from tests.conftest import running_stack
from tests.support.domain import create_kb, uid, upload
from tests.support.website import TOPICS, generate_site, serve_site


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with running_stack(tmp_path_factory.mktemp("crawled"), embedders=embedders) as pair:
        yield pair


async def search(client: httpx.AsyncClient, kb_id: str, query: str, mode: str) -> list[dict]:
    r = await client.post("/v1/search", json={"query": query, "kb_ids": [kb_id], "mode": mode})
    assert r.status_code == 200, r.text
    hits: list[dict] = r.json()["hits"]
    return hits


async def test_crawled_pages_are_found_by_their_content_not_their_chrome(
    stack: tuple[Any, httpx.AsyncClient], tmp_path: Path
) -> None:
    """Every page the crawl sends is indexed under its canonical URL and title; a query for a
    page's topic finds that page first in every mode, and words that only the repeated
    header, sidebar and footer hold ("Table of contents", the copyright line) find nothing."""
    _rt, client = stack
    kb = await create_kb(client)
    root = generate_site(tmp_path / "site")
    async with serve_site(root) as base:
        source = Source(
            kind="web",
            kb=kb["name"],
            url=f"{base}/docs/index.html",
            org_id="default",
            source_id=f"s-{uid()}",
            kb_id=kb["kb_id"],
            rate=100,
        )
        fetcher = WebFetcher(Settings(egress={"allowlist": ["127.0.0.1/32"]}))
        puts = [c async for c in fetcher.fetch(source, None, None) if isinstance(c, Put)]
    assert len(puts) == 1 + len(TOPICS)
    for put in puts:
        await upload(
            client,
            put.name,
            put.content.decode(),
            kb_id=kb["kb_id"],
            mime_type=put.mime_type,
            uri=put.uri,
            metadata=put.metadata,
        )
    for mode in ("keyword", "dense", "hybrid"):
        hits = await search(client, kb["kb_id"], "U-shaped valleys carved by glaciers", mode)
        assert hits and hits[0]["uri"] == f"{base}/docs/glaciers.html", (mode, hits[:2])
    for chrome in ("Table of contents", "Copyright Licensed CC-BY", "Previous Next Report bug"):
        assert await search(client, kb["kb_id"], chrome, "keyword") == [], chrome
