"""A web source read from a real site on loopback (uvicorn serving files that change between
runs): what a first run sends, that a run with nothing changed reads no page body, that a
change, a removal and the sitemap's word reach the next run, and that the crawl stays inside
its scope, robots.txt and the egress rule."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from services.common.domain.sources import Source
from services.common.settings import Settings
from services.sources.fetch import Change, Done, Failed, Gone, Put, SourceError, Unchanged
from services.sources.web import WebFetcher, load_state
from tests.support.domain import uid
from tests.support.website import (
    PYTHON_DOCS,
    PYTHON_DOCS_MISSING,
    TOPICS,
    generate_site,
    page_html,
    serve_site,
    topic_body,
    write_page,
    write_sitemap,
)

LOOPBACK = Settings(egress={"allowlist": ["127.0.0.1/32"]})


def web_source(url: str, **fields: Any) -> Source:
    return Source(
        kind="web",
        kb="handbook",
        url=url,
        org_id="org-test",
        source_id=f"s-{uid()}",
        kb_id="kb-test",
        **{"rate": 100.0, **fields},
    )


class Clock:
    """The time the removal grace is measured with, moved on by the test."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


async def run(fetcher: WebFetcher, source: Any, state: bytes | None) -> tuple[list[Change], Done]:
    changes: list[Change] = []
    done: Done | None = None
    async for item in fetcher.fetch(source, None, state):
        if isinstance(item, Done):
            done = item
        else:
            changes.append(item)
    assert done is not None
    return changes, done


def of(kind: type, changes: list[Change]) -> set[str]:
    return {c.uri for c in changes if isinstance(c, kind)}


@pytest.fixture
def site_root(tmp_path: Path) -> Iterator[Path]:
    root = generate_site(tmp_path / "site")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def site(site_root: Path) -> AsyncIterator[str]:
    async with serve_site(site_root) as base:
        yield base


def docs_pages(base: str) -> set[str]:
    return {f"{base}/docs/index.html"} | {f"{base}/docs/{t}.html" for t in TOPICS}


async def test_first_run_puts_every_page_in_scope_and_nothing_else(site: str) -> None:
    """The first run sends the start page and every page it leads to under /docs/, each once,
    with its title and ETag as revision; the robots-disallowed page, the out-of-scope blog
    and the image link are never sent."""
    fetcher = WebFetcher(LOOPBACK)
    changes, done = await run(fetcher, web_source(f"{site}/docs/index.html"), None)
    puts = [c for c in changes if isinstance(c, Put)]
    assert {p.uri for p in puts} == docs_pages(site)
    assert len(puts) == len(docs_pages(site))
    tides = next(p for p in puts if p.uri.endswith("/tides.html"))
    assert tides.metadata == {"title": "Tides"} and tides.name == "Tides"
    assert tides.mime_type == "text/html" and TOPICS["tides"].encode() in tides.content
    assert tides.revision.startswith('"') or tides.revision.startswith("W/")
    assert not [c for c in changes if not isinstance(c, Put)]
    # robots.txt, then one request per page: the image and the blog were never asked for.
    assert done.requests == 1 + len(docs_pages(site))
    assert done.bytes_read == sum(len(p.content) for p in puts) + len(
        b"User-agent: *\nDisallow: /docs/private/\n"
    )
    assert set(load_state(done.state)) == docs_pages(site)


async def test_a_run_with_nothing_changed_reads_no_page_body(site: str) -> None:
    """The second run asks each page with its validators: every answer is a 304, every page
    Unchanged, and no byte of a page body is read (only robots.txt)."""
    fetcher = WebFetcher(LOOPBACK)
    source = web_source(f"{site}/docs/index.html")
    _, first = await run(fetcher, source, None)
    changes, done = await run(fetcher, source, first.state)
    assert of(Unchanged, changes) == docs_pages(site)
    assert len(changes) == len(docs_pages(site))
    assert done.bytes_read == len(b"User-agent: *\nDisallow: /docs/private/\n")
    assert done.requests == 1 + len(docs_pages(site))


async def test_a_changed_page_is_sent_again_and_a_removed_one_goes_after_the_grace(
    site: str, site_root: Path
) -> None:
    """A page edited on the server is the only Put of the next run; a deleted page (404) is
    kept (Unchanged) while missing for less than removal_grace and Gone once missing longer."""
    clock = Clock()
    fetcher = WebFetcher(LOOPBACK, now=clock)
    source = web_source(f"{site}/docs/index.html", removal_grace="1h")
    _, done = await run(fetcher, source, None)
    docs = site_root / "docs"
    write_page(
        docs / "caves.html",
        page_html("Caves", topic_body("caves", "Stalactites hang from cave ceilings."), []),
    )
    (docs / "storms.html").unlink()
    changes, done = await run(fetcher, source, done.state)
    assert of(Put, changes) == {f"{site}/docs/caves.html"}
    assert b"Stalactites" in next(c for c in changes if isinstance(c, Put)).content
    assert of(Unchanged, changes) == docs_pages(site) - {f"{site}/docs/caves.html"}
    assert not of(Gone, changes)

    clock.now += timedelta(minutes=30)
    changes, done = await run(fetcher, source, done.state)
    assert f"{site}/docs/storms.html" in of(Unchanged, changes) and not of(Gone, changes)

    clock.now += timedelta(minutes=31)
    changes, done = await run(fetcher, source, done.state)
    assert of(Gone, changes) == {f"{site}/docs/storms.html"}
    assert f"{site}/docs/storms.html" not in load_state(done.state)


async def test_a_page_the_sitemap_stops_listing_is_gone(site: str, site_root: Path) -> None:
    """With a sitemap, pages it lists are read even when no link leads there; one it stops
    listing (and no link reaches) is Gone on the next run, without a request for it."""
    for topic in TOPICS:
        (site_root / "docs" / f"{topic}.html").unlink()
    write_page(site_root / "docs/index.html", page_html("Index", "<p>Only the sitemap.</p>", []))
    write_page(
        site_root / "docs/orphan.html", page_html("Orphan", "<p>Listed, never linked.</p>", [])
    )
    write_page(site_root / "docs/other.html", page_html("Other", "<p>Also listed.</p>", []))
    write_sitemap(site_root, site, ["/docs/orphan.html", "/docs/other.html", "/blog/news.html"])
    fetcher = WebFetcher(LOOPBACK)
    source = web_source(f"{site}/docs/index.html", sitemap=f"{site}/sitemap.xml")
    changes, done = await run(fetcher, source, None)
    assert of(Put, changes) == {
        f"{site}/docs/index.html",
        f"{site}/docs/orphan.html",
        f"{site}/docs/other.html",
    }
    write_sitemap(site_root, site, ["/docs/other.html"])
    changes, again = await run(fetcher, source, done.state)
    assert of(Gone, changes) == {f"{site}/docs/orphan.html"}
    # robots.txt, the sitemap, index and other: the orphan was not asked for.
    assert again.requests == 4


async def test_canonical_urls_are_one_document(site: str, site_root: Path) -> None:
    """A page reachable under a second URL that names the first as canonical is sent once,
    under its canonical URL; fragments and ./ segments lead to the same page."""
    docs = site_root / "docs"
    write_page(
        docs / "tides-print.html",
        page_html("Tides", topic_body("tides", TOPICS["tides"]), [], canonical="tides.html"),
    )
    index = (docs / "index.html").read_text()
    write_page(
        docs / "index.html",
        index.replace(
            "</ul></article>",
            '<li><a href="./tides-print.html#x">print</a></li>'
            '<li><a href="./tides.html#details">again</a></li></ul></article>',
        ),
    )
    changes, _ = await run(WebFetcher(LOOPBACK), web_source(f"{site}/docs/index.html"), None)
    puts = [c.uri for c in changes if isinstance(c, Put)]
    assert sorted(puts) == sorted(docs_pages(site))


async def test_redirects_to_a_forbidden_address_are_refused_by_the_egress_rule(
    site: str, site_root: Path
) -> None:
    """A page that redirects to the cloud metadata address is a Failed naming the refusal,
    never fetched; a start URL the egress rule refuses fails the whole run (SourceError)."""
    index = (site_root / "docs/index.html").read_text()
    write_page(
        site_root / "docs/index.html",
        index.replace("</ul></article>", '<li><a href="leak.html">leak</a></li></ul></article>'),
    )
    changes, _ = await run(WebFetcher(LOOPBACK), web_source(f"{site}/docs/index.html"), None)
    failed = [c for c in changes if isinstance(c, Failed)]
    assert [f.uri for f in failed] == [f"{site}/docs/leak.html"]
    assert "169.254.169.254" in failed[0].error and "refusing" in failed[0].error
    assert of(Put, changes) == docs_pages(site)

    with pytest.raises(SourceError, match="KBMESH_EGRESS__ALLOWLIST"):
        await run(WebFetcher(Settings()), web_source(f"{site}/docs/index.html"), None)


async def test_robots_txt_may_forbid_the_whole_site(site: str, site_root: Path) -> None:
    """A start URL robots.txt disallows fails the run and says so; nothing is sent."""
    (site_root / "robots.txt").write_text("User-agent: kbmesh\nDisallow: /\n")
    with pytest.raises(SourceError, match=r"robots\.txt"):
        await run(WebFetcher(LOOPBACK), web_source(f"{site}/docs/index.html"), None)


@pytest.mark.slow  # ~500 pages twice: a minute or two on a loaded 2-core machine
@pytest.mark.skipif(not PYTHON_DOCS.is_dir(), reason=PYTHON_DOCS_MISSING)
async def test_the_python_documentation_is_crawled_whole_and_rechecked_for_nothing(
    tmp_path: Path,
) -> None:
    """Debian's python3.11-doc site served from loopback: the first run sends hundreds of
    pages (each once), the second sends none and reads no page body."""
    async with serve_site(PYTHON_DOCS) as base:
        fetcher = WebFetcher(LOOPBACK)
        source = web_source(f"{base}/index.html", max_pages=5000)
        changes, done = await run(fetcher, source, None)
        puts = [c for c in changes if isinstance(c, Put)]
        assert len(puts) >= 300 and len({p.uri for p in puts}) == len(puts)
        assert not [c for c in changes if isinstance(c, Failed)]
        again, redone = await run(fetcher, source, done.state)
        assert of(Unchanged, again) == {p.uri for p in puts}
        assert redone.bytes_read < 10_000  # robots.txt's answer at most
