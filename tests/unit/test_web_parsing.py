"""The pure parts of the web source: what a URL is as a page's identity, what the scope holds,
what a page and a sitemap say, and the state kept between runs."""

from __future__ import annotations

import gzip
from datetime import timedelta

import pytest

from services.sources.fetch import SourceError
from services.sources.web import (
    Known,
    default_scope,
    dump_state,
    in_scope,
    load_state,
    normalise_url,
    parse_grace,
    parse_page,
    parse_sitemap,
)


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("HTTP://Docs.Example:80/a/b.html#part", "http://docs.example/a/b.html"),
        ("https://docs.example:443", "https://docs.example/"),
        ("https://docs.example/a/./b/../c.html?", "https://docs.example/a/c.html"),
        ("https://docs.example:8443/x?q=1#f", "https://docs.example:8443/x?q=1"),
    ],
)
def test_urls_are_normalised_to_one_identity(raw: str, normal: str) -> None:
    assert normalise_url(raw) == normal


def test_the_default_scope_is_the_start_urls_host_and_directory() -> None:
    assert default_scope("https://h/docs/3/index.html?x=1") == "https://h/docs/3/"
    assert default_scope("https://h") == "https://h/"


def test_scope_include_and_exclude_globs() -> None:
    scope = "https://h/docs/"
    assert in_scope("https://h/docs/a.html", scope, [], [])
    assert not in_scope("https://h/blog/a.html", scope, [], [])
    assert not in_scope("https://other/docs/a.html", scope, [], [])
    assert in_scope("https://h/docs/api/x.html", scope, ["*/api/*"], [])
    assert not in_scope("https://h/docs/guide/x.html", scope, ["*/api/*"], [])
    assert not in_scope("https://h/docs/api/old/x.html", scope, [], ["/docs/api/old/*"])


def test_a_page_gives_its_title_canonical_url_and_links() -> None:
    body = b"""<html><head><title> The
        Title </title><link rel="canonical" href="/docs/page.html">
        <meta name="ROBOTS" content="NOINDEX"></head><body>
        <a href="a.html#s">a</a><a href="a.html">again</a><a href="../up.html">up</a>
        <a href="mailto:x@y">mail</a><a href="javascript:void(0)">js</a>
        <a rel="nofollow" href="b.html">b</a><a href="https://other.example/x">x</a>
        </body></html>"""
    page = parse_page(body, "https://h/docs/sub/page.html")
    assert page.title == "The Title"
    assert page.canonical == "https://h/docs/page.html"
    assert page.links == [
        "https://h/docs/sub/a.html",
        "https://h/docs/up.html",
        "https://other.example/x",
    ]
    assert not page.index and page.follow


def test_a_base_element_moves_relative_links() -> None:
    body = (
        b'<html><head><base href="https://h/v2/"></head><body><a href="x.html">x</a></body></html>'
    )
    assert parse_page(body, "https://h/v1/page.html").links == ["https://h/v2/x.html"]


def test_a_page_that_is_not_html_has_nothing_to_say() -> None:
    page = parse_page(b"", "https://h/x")
    assert (page.title, page.canonical, page.links) == ("", None, [])


SITEMAP = (
    b'<?xml version="1.0"?><urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
    b"<url><loc>https://h/a.html</loc><lastmod>2024-01-01</lastmod></url>"
    b"<url><loc>https://h/b.html</loc></url></urlset>"
)


def test_a_sitemap_lists_its_pages_plain_or_gzipped() -> None:
    assert parse_sitemap(SITEMAP).pages == ["https://h/a.html", "https://h/b.html"]
    assert parse_sitemap(gzip.compress(SITEMAP)).pages == ["https://h/a.html", "https://h/b.html"]


def test_a_sitemap_index_names_sitemaps_without_fetching_them() -> None:
    index = (
        b'<?xml version="1.0"?><sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        b"<sitemap><loc>https://h/s1.xml</loc></sitemap><sitemap><loc>https://h/s2.xml</loc>"
        b"</sitemap></sitemapindex>"
    )
    found = parse_sitemap(index)
    assert (found.pages, found.sitemaps) == ([], ["https://h/s1.xml", "https://h/s2.xml"])


def test_removal_grace_is_an_interval() -> None:
    assert parse_grace(None) == timedelta(0)
    assert parse_grace("90m") == timedelta(minutes=90)
    assert parse_grace("7d") == timedelta(days=7)
    with pytest.raises(SourceError, match="removal_grace"):
        parse_grace("soon")


def test_the_state_round_trips_compactly_and_a_foreign_one_starts_afresh() -> None:
    pages = {
        "https://h/a.html": Known(depth=1, etag='"x"', revision='"x"'),
        "https://h/b.html": Known(
            modified="Mon, 01 Jan 2024 00:00:00 GMT",
            revision="Mon, 01 Jan 2024 00:00:00 GMT",
            fetched_from="https://h/b",
            listed=True,
            missing_since=1_700_000_000,
        ),
    }
    state = dump_state(pages)
    assert load_state(state) == pages
    assert b" " not in state.replace(b"Mon, 01 Jan 2024 00:00:00 GMT", b"")
    assert b"null" not in state
    assert load_state(b'{"v": 99, "pages": {}}') == {}
    assert load_state(b"not json") == {}
    assert load_state(None) == {}
