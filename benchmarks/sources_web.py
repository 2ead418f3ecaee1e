"""A web source's first sync and its no-change re-sync, fetch side: Debian's python3.11-doc
site (`make pydoc`) served from loopback by uvicorn (ETag, Last-Modified, 304s), crawled by
`WebFetcher` through the egress rule. Prints pages, pages/s, requests and bytes read per run.

    python -m benchmarks.sources_web [--rate 100] [--max-pages 5000]

The per-host rate is the source's (default 4/s on a real site); here it is raised so the
figures measure the crawler, not the politeness delay.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from services.common.domain.sources import Source
from services.common.settings import Settings
from services.sources.fetch import Done, Failed, Gone, Put, Unchanged
from services.sources.web import WebFetcher
from tests.support.website import PYTHON_DOCS, PYTHON_DOCS_MISSING, serve_site


async def _sync(fetcher: WebFetcher, source: Source, state: bytes | None) -> tuple[Done, dict]:
    counts = {"put": 0, "unchanged": 0, "gone": 0, "failed": 0}
    started = time.perf_counter()
    done: Done | None = None
    async for item in fetcher.fetch(source, None, state):
        match item:
            case Put():
                counts["put"] += 1
            case Unchanged():
                counts["unchanged"] += 1
            case Gone():
                counts["gone"] += 1
            case Failed():
                counts["failed"] += 1
            case Done():
                done = item
    assert done is not None
    counts["seconds"] = time.perf_counter() - started
    return done, counts


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--max-pages", type=int, default=5000)
    args = parser.parse_args()
    if not PYTHON_DOCS.is_dir():
        raise SystemExit(PYTHON_DOCS_MISSING)
    settings = Settings(egress={"allowlist": ["127.0.0.1/32"]})
    fetcher = WebFetcher(settings)
    async with serve_site(PYTHON_DOCS) as base:
        source = Source(
            kind="web",
            kb="python-docs",
            url=f"{base}/index.html",
            org_id="bench",
            source_id="python-docs",
            kb_id="python-docs",
            rate=args.rate,
            max_pages=args.max_pages,
        )
        print(f"{PYTHON_DOCS} served at {base}; rate {args.rate}/s")
        print(
            "| run | pages | put | unchanged | failed | seconds | pages/s | requests | bytes read |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        state = None
        for run in ("first sync", "no-change re-sync"):
            done, c = await _sync(fetcher, source, state)
            pages = c["put"] + c["unchanged"]
            print(
                f"| {run} | {pages} | {c['put']} | {c['unchanged']} | {c['failed']} | "
                f"{c['seconds']:.1f} | {pages / c['seconds']:.1f} | {done.requests} | "
                f"{done.bytes_read:,} |"
            )
            state = done.state
        print(f"state: {len(state or b''):,} bytes")


if __name__ == "__main__":
    asyncio.run(main())
