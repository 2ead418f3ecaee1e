"""A documentation site served from loopback for the web source tests and benchmarks: real
HTTP (uvicorn + Starlette's StaticFiles, which sends ETag and Last-Modified and answers 304),
files on disk that a test changes or removes between runs, a robots.txt and a sitemap.xml.

`generate_site` writes a small site whose pages repeat a header, a sidebar and a footer around
one topic each, like a docs generator's; `PYTHON_DOCS` is Debian's python3.11-doc HTML, made
available by `make pydoc` (tests that need it skip when it is absent).
"""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tests.support.asgi import serve_app

REPO = Path(__file__).resolve().parents[2]
PYTHON_DOCS = Path(
    os.environ.get("KBMESH_PYTHON_DOCS", REPO / ".cache/python-doc/usr/share/doc/python3.11/html")
)
PYTHON_DOCS_MISSING = (
    f"Debian's python3.11-doc site is not at {PYTHON_DOCS}: run `make pydoc` "
    "(apt-get download python3.11-doc, dpkg -x; no root needed)"
)

TOPICS = {
    "tides": "Tide pools hold anemones, crabs and sea stars between the tides.",
    "volcanoes": "Basaltic lava flows from shield volcanoes build wide gentle slopes.",
    "glaciers": "Glaciers carve U-shaped valleys and leave moraines where they melt.",
    "deserts": "Desert dunes migrate downwind as sand saltates over their crests.",
    "reefs": "Coral reefs grow where warm clear water lets symbiotic algae photosynthesise.",
    "caves": "Limestone caves form as carbonic acid in groundwater dissolves the rock.",
    "rivers": "Meandering rivers cut oxbow lakes when a loop is pinched off in a flood.",
    "storms": "Thunderstorms build when warm moist air rises through a cooler unstable layer.",
}


def page_html(title: str, body: str, nav: list[str], *, canonical: str | None = None) -> str:
    """A page as docs generators write them: the same header, sidebar and footer around the
    main content."""
    links = "".join(f'<li><a href="{n}.html">{n.title()} guide</a></li>' for n in nav)
    head_extra = f'<link rel="canonical" href="{canonical}">' if canonical else ""
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"{head_extra}</head><body>"
        "<header><a href='index.html'>Earth Handbook</a> | <a href='/blog/news.html'>News</a>"
        " | Search the handbook | Version 2.4 documentation</header>"
        f"<nav class='sidebar'><h3>Table of contents</h3><ul>{links}</ul>"
        "<p>Previous topic | Next topic | This page | Report a bug | Show source</p></nav>"
        f"<main><article><h1>{html.escape(title)}</h1>{body}</article></main>"
        "<footer>Copyright 2001-2024 the Earth Handbook authors. Licensed under CC-BY. "
        "Last updated on Jan 01, 2024. Found a bug? Created using a static site generator."
        "</footer></body></html>"
    )


def topic_body(topic: str, sentence: str) -> str:
    return (
        f"<p>{sentence}</p><h2>Details</h2><p>More about {topic}: "
        f"{sentence.lower()} Field notes follow.</p><p><a href='#top'>top</a> "
        f"<a href='{topic}.html#details'>this section</a></p>"
    )


def generate_site(root: Path) -> Path:
    """A site under `root`: /docs/ (index + one page per topic, a disallowed /docs/private/,
    a moved page), /blog/ (out of the docs' scope), robots.txt, sitemap.xml. Returns root."""
    docs = root / "docs"
    (docs / "private").mkdir(parents=True, exist_ok=True)
    (root / "blog").mkdir(exist_ok=True)
    nav = list(TOPICS)
    index_body = "<p>Welcome to the handbook.</p><ul>" + "".join(
        f'<li><a href="{t}.html">{t}</a></li>' for t in TOPICS
    )
    index_body += '<li><a href="private/secret.html">staff</a></li>'
    index_body += '<li><a href="/blog/news.html">news</a></li>'
    index_body += '<li><a href="pictures/map.png">map</a></li></ul>'
    write_page(docs / "index.html", page_html("Earth Handbook", index_body, nav))
    for topic, sentence in TOPICS.items():
        write_page(
            docs / f"{topic}.html", page_html(topic.title(), topic_body(topic, sentence), nav)
        )
    write_page(
        docs / "private/secret.html",
        page_html("Staff only", "<p>The staff room code is 4711.</p>", nav),
    )
    write_page(
        root / "blog/news.html",
        page_html("News", "<p>The handbook has a new chapter on auroras.</p>", nav),
    )
    (root / "robots.txt").write_text("User-agent: *\nDisallow: /docs/private/\n")
    return root


def write_page(path: Path, text: str) -> None:
    """Write a page so that its validators change even within the same second."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text, encoding="utf-8")
    after = path.stat().st_mtime_ns
    if after <= before:
        os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def write_sitemap(root: Path, base: str, paths: list[str]) -> None:
    urls = "".join(f"<url><loc>{base}{p}</loc></url>" for p in paths)
    (root / "sitemap.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">{urls}</urlset>'
    )


async def _gone(request: Request) -> Response:
    return Response("gone", status_code=410)


async def _leak(request: Request) -> Response:
    # A redirect to the cloud metadata address: the egress rule must refuse the second hop.
    return RedirectResponse("http://169.254.169.254/latest/meta-data/", status_code=302)


@contextlib.asynccontextmanager
async def serve_site(root: Path) -> AsyncIterator[str]:
    """`root` served on 127.0.0.1 (files as they are on disk at each request); yields the base
    URL. /docs/gone.html answers 410, /docs/leak.html redirects to 169.254.169.254."""
    app = Starlette(
        routes=[
            Route("/docs/gone.html", _gone),
            Route("/docs/leak.html", _leak),
            Mount("/", StaticFiles(directory=root, html=True)),
        ]
    )
    async with serve_app(app, lifespan="off") as base:
        yield base
