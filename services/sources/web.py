"""Reading a web site as a source: a crawl from the start URLs (and the sitemap) within the
source's scope, every request through the shared egress rule, that sends what changed since
the last run.

The state a run leaves is compact JSON: for each page (by canonical URL) its depth, its
validators (ETag, Last-Modified), its revision, where it was fetched from when that is not its
canonical URL, whether the sitemap listed it and since when it has been missing. The next run
asks each known page again with a conditional request, so an unchanged page answers 304 and
costs no body; new pages can only appear through a page that changed (a new link) or the
sitemap, which are both read again. A page that answers 404/410, or that the sitemap stopped
listing, is Gone once it has been missing longer than the source's `removal_grace`.

robots.txt is honoured (Protego, with its Crawl-delay); the sitemap is parsed by
ultimate-sitemap-parser from the bytes fetched here (its own fetching would bypass the egress
rule); pages are parsed with lxml. Bounded by the source's page and depth limits, a byte and
a time budget per run, and the size limit per page.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import json
import logging
import re
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx
import lxml.html
from lxml import etree
from protego import Protego
from usp.objects.sitemap import AbstractIndexSitemap, AbstractPagesSitemap
from usp.tree import sitemap_from_str

from services.common.domain.errors import Forbidden, KbmeshError
from services.common.domain.formats import clean_mime
from services.common.domain.models import utcnow
from services.common.domain.sources import Source, SourceSecrets
from services.common.outbound.egress import EgressPolicy, egress_policy, parse_http_url
from services.common.outbound.fetch import (
    FetchFailed,
    name_from,
    open_url,
    outbound_client,
    read_limited,
    to_utf8,
)
from services.common.settings import Settings
from services.sources.fetch import Change, Done, Failed, Gone, Put, SourceError, Unchanged

log = logging.getLogger(__name__)

DEFAULT_MAX_DEPTH = 10
DEFAULT_MAX_PAGES = 2000
DEFAULT_RATE = 4.0  # requests per second per host: polite to a docs site, 2000 pages in ~8 min
# What one run may read and how long it may take, whatever the site: a run that reaches either
# stops where it is and keeps every page it did not get to for the next run.
MAX_RUN_BYTES = 1 << 30
MAX_RUN_SECONDS = 3600.0
# How long one page (its redirects and body) may take: a server dripping bytes holds no run.
PAGE_SECONDS = 60.0
# Sitemaps an index may name, read per run (a sitemap index of sitemap indexes is bounded too).
MAX_SITEMAPS = 50
# The token robots.txt rules are matched against, and the User-Agent sent.
ROBOTS_AGENT = "kbmesh"
USER_AGENT = "kbmesh-crawler/0.1 (+robots.txt honoured)"
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
# Documents a page may link to that are read as they are (no links followed inside them).
LINKED_TYPES = frozenset({"text/markdown", "text/x-markdown", "application/pdf"})
# Links not worth a request: assets, archives, media. Anything else is asked for and kept only
# when it answers with a readable type.
_SKIPPED_SUFFIX = re.compile(
    r"\.(?:css|js|mjs|map|json|xml|png|jpe?g|gif|svg|webp|ico|bmp|tiff?|woff2?|ttf|eot|otf|"
    r"zip|gz|tgz|bz2|xz|tar|7z|rar|exe|dmg|msi|deb|rpm|mp3|mp4|m4a|wav|ogg|webm|avi|mov|"
    r"txt|rst|epub|mobi)$",
    re.IGNORECASE,
)
_GRACE = re.compile(r"^(\d+)\s*([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
STATE_VERSION = 1


# ---- pure helpers ------------------------------------------------------------------------------


def normalise_url(raw: str | httpx.URL) -> str:
    """A URL as a page's identity: scheme and host lower-cased, the default port, the fragment
    and an empty query dropped, dot segments resolved, an empty path made `/`."""
    url = httpx.URL(raw) if isinstance(raw, str) else raw
    url = url.copy_with(fragment=None)
    port = url.port
    if (url.scheme, port) in (("http", 80), ("https", 443)):
        port = None
    url = url.copy_with(scheme=url.scheme.lower(), host=url.host.lower(), port=port)
    if not url.path:
        url = url.copy_with(path="/")
    text = str(url.join(url.raw_path.decode("ascii")))  # join resolves ./ and ../
    return text[:-1] if text.endswith("?") else text


def default_scope(start: str) -> str:
    """The start URL's host and directory: `https://h/docs/index.html` → `https://h/docs/`."""
    url = normalise_url(start)
    head, _, _ = url.partition("?")
    return head[: head.rindex("/") + 1]


def in_scope(url: str, scope: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """Whether a normalised URL is one of the source's pages: under the scope prefix, matching
    an `include` glob (when there are any) and no `exclude` glob. Globs match the whole URL or
    its path (`*/api/*`, `/docs/*.html`)."""
    if not url.startswith(scope):
        return False
    path = httpx.URL(url).path

    def matches(pattern: str) -> bool:
        return fnmatch.fnmatchcase(url, pattern) or fnmatch.fnmatchcase(path, pattern)

    include = list(include)
    if include and not any(matches(p) for p in include):
        return False
    return not any(matches(p) for p in exclude)


def parse_grace(value: str | None) -> timedelta:
    """`removal_grace` as a duration: an interval (`0s`, `30m`, `12h`, `7d`); none is 0."""
    if not value:
        return timedelta(0)
    match = _GRACE.match(value.strip())
    if not match:
        raise SourceError(f"removal_grace {value!r} is not an interval such as 0s, 30m, 12h or 7d")
    return timedelta(**{_UNITS[match[2]]: int(match[1])})


@dataclass(frozen=True)
class Page:
    """What an HTML page says about itself and where it leads."""

    title: str
    canonical: str | None
    links: list[str]
    index: bool = True  # <meta name="robots" content="noindex"> says no
    follow: bool = True  # "nofollow" says its links are not to be followed


def parse_page(body: bytes, url: str) -> Page:
    """The title, canonical URL (absolute, normalised) and links (absolute, normalised,
    http(s) only, in order, once each) of the HTML page fetched from `url`."""
    try:
        root = lxml.html.document_fromstring(body)
    except (etree.ParserError, ValueError):
        return Page(title="", canonical=None, links=[])
    base = httpx.URL(url)
    for href in root.xpath("//base/@href"):
        base = _joined(base, str(href)) or base
        break
    title = " ".join("".join(root.xpath("//title//text()")).split())
    canonical = None
    for href in root.xpath(
        "//link[@href][contains(concat(' ', normalize-space(@rel), ' '), ' canonical ')]/@href"
    ):
        canonical = _absolute(base, str(href))
        break
    robots = " ".join(
        str(c).lower()
        for c in root.xpath("//meta[translate(@name, 'ROBTS', 'robts')='robots']/@content")
    )
    links: dict[str, None] = {}
    for element in root.xpath("//a[@href]"):
        rel = str(element.get("rel") or "").lower().split()
        if "nofollow" in rel:
            continue
        link = _absolute(base, str(element.get("href")))
        if link is not None:
            links[link] = None
    return Page(
        title=title,
        canonical=canonical,
        links=list(links),
        index="noindex" not in robots and "none" not in robots,
        follow="nofollow" not in robots and "none" not in robots,
    )


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.netloc.decode('ascii')}"


def _joined(base: httpx.URL, href: str) -> httpx.URL | None:
    try:
        url = base.join(href.strip())
    except (httpx.InvalidURL, ValueError):
        return None
    return url if url.scheme in ("http", "https") and url.host else None


def _absolute(base: httpx.URL, href: str) -> str | None:
    url = _joined(base, href)
    try:
        return normalise_url(url) if url is not None else None
    except (httpx.InvalidURL, ValueError):
        return None


@dataclass(frozen=True)
class Sitemap:
    pages: list[str]
    sitemaps: list[str]  # the sitemaps an index names, still to be read


def parse_sitemap(body: bytes) -> Sitemap:
    """The page URLs of a sitemap (XML, plain text; gzipped or not) and the sitemaps an index
    names. Parsed by ultimate-sitemap-parser from the bytes given: it fetches nothing."""
    if body[:2] == b"\x1f\x8b":
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        body = inflater.decompress(body, MAX_SITEMAP_BYTES)
    text = body.decode("utf-8", errors="replace")
    tree = sitemap_from_str(text)
    if isinstance(tree, AbstractIndexSitemap):
        return Sitemap(pages=[], sitemaps=[s.url for s in tree.sub_sitemaps])
    if isinstance(tree, AbstractPagesSitemap):
        return Sitemap(pages=[p.url for p in tree.pages], sitemaps=[])
    return Sitemap(pages=[], sitemaps=[])


# A gzipped sitemap is inflated up to this: the sitemap protocol's own limit is 50 MB.
MAX_SITEMAP_BYTES = 50 * 1024 * 1024


# ---- state ------------------------------------------------------------------------------------


@dataclass
class Known:
    """A page as the last run left it. Serialised with one-letter keys, nulls left out: a
    state holds thousands of these."""

    depth: int = 0
    etag: str | None = None
    modified: str | None = None
    revision: str | None = None
    fetched_from: str | None = None  # when it differs from the canonical URL
    listed: bool = False  # the sitemap listed it
    missing_since: int | None = None  # epoch seconds of the first run that missed it

    def dump(self) -> dict[str, Any]:
        raw = {
            "d": self.depth,
            "e": self.etag,
            "m": self.modified,
            "r": self.revision,
            "f": self.fetched_from,
            "s": 1 if self.listed else None,
            "g": self.missing_since,
        }
        return {k: v for k, v in raw.items() if v is not None}

    @classmethod
    def load(cls, raw: dict[str, Any]) -> Known:
        return cls(
            depth=int(raw.get("d", 0)),
            etag=raw.get("e"),
            modified=raw.get("m"),
            revision=raw.get("r"),
            fetched_from=raw.get("f"),
            listed=bool(raw.get("s")),
            missing_since=raw.get("g"),
        )


def load_state(state: bytes | None) -> dict[str, Known]:
    """The pages a state holds; a state of another version or shape starts afresh (every
    page is fetched in full once, and its document is the same by its canonical URL)."""
    if not state:
        return {}
    try:
        raw = json.loads(state)
        if raw.get("v") != STATE_VERSION:
            return {}
        return {str(url): Known.load(page) for url, page in raw["pages"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("web source state unreadable; crawling afresh")
        return {}


def dump_state(pages: dict[str, Known]) -> bytes:
    body = {"v": STATE_VERSION, "pages": {url: page.dump() for url, page in pages.items()}}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


# ---- the crawl --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    status: int
    url: str  # the last hop's URL, normalised
    headers: httpx.Headers
    body: bytes | None  # None: not read (304, an error status, a type not kept)


@dataclass
class _Todo:
    url: str
    depth: int
    listed: bool = False
    known: str | None = None  # the canonical URL of the known page this fetch re-checks


@dataclass
class _Run:
    """One crawl's bookkeeping."""

    source: Source
    policy: EgressPolicy
    client: httpx.AsyncClient
    known: dict[str, Known]
    now: datetime
    scope: str
    interval: float
    requests: int = 0
    bytes_read: int = 0
    pages: int = 0
    handled: set[str] = field(default_factory=set)  # canonical URLs settled this run
    queued: set[str] = field(default_factory=set)  # URLs asked for or to be asked for
    robots: dict[str, Protego | None] = field(default_factory=dict)
    next_slot: dict[str, float] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # fetched-from URL → canonical URL


class WebFetcher:
    """The Fetcher of `kind="web"` sources. `settings` gives the egress policy and the size
    limit of one page; `now` the clock the removal grace is measured with."""

    def __init__(self, settings: Settings, *, now: Callable[[], datetime] = utcnow) -> None:
        self._settings = settings
        self._now = now

    async def fetch(
        self, source: Source, secrets: SourceSecrets | None, state: bytes | None
    ) -> AsyncIterator[Change | Done]:
        grace = parse_grace(source.removal_grace)
        start_urls = [source.url, *source.start_urls]
        for raw in [*start_urls, *([source.sitemap] if source.sitemap else [])]:
            try:
                parse_http_url(raw, "url")
            except KbmeshError as err:
                raise SourceError(err.message) from err
        scope = normalise_url(source.scope) if source.scope else default_scope(source.url)
        rate = source.rate or DEFAULT_RATE
        async with outbound_client(user_agent=USER_AGENT) as client:
            run = _Run(
                source=source,
                policy=egress_policy(self._settings),
                client=client,
                known=load_state(state),
                now=self._now(),
                scope=scope,
                interval=1.0 / rate,
            )
            async for change in self._crawl(run, start_urls, grace):
                yield change
            yield Done(
                state=dump_state(run.known), requests=run.requests, bytes_read=run.bytes_read
            )

    async def _crawl(
        self, run: _Run, start_urls: list[str], grace: timedelta
    ) -> AsyncIterator[Change]:
        source = run.source
        max_depth = DEFAULT_MAX_DEPTH if source.max_depth is None else source.max_depth
        max_pages = source.max_pages or DEFAULT_MAX_PAGES
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MAX_RUN_SECONDS
        todo: deque[_Todo] = deque()
        for url in start_urls:
            self._queue(run, todo, _Todo(normalise_url(url), 0))
        listed: set[str] | None = None
        if source.sitemap:
            listed = await self._sitemap(run, source.sitemap)
            for url in sorted(listed):
                self._queue(run, todo, _Todo(url, 0, listed=True))
        for key, page in list(run.known.items()):
            todo.append(_Todo(page.fetched_from or key, page.depth, page.listed, known=key))
            if page.fetched_from:
                run.aliases[page.fetched_from] = key
        dropped: list[str] = []  # known pages the source no longer wants, unless a link leads there
        first = True
        while todo:
            item = todo.popleft()
            if item.known is None:
                item.known = run.aliases.get(item.url) or (
                    item.url if item.url in run.known else None
                )
            elif not self._still_wanted(run, item, listed):
                dropped.append(item.known)
                continue
            if item.known is not None and item.known in run.handled:
                continue
            try:
                allowed = await self._allowed(run, item.url)
            except Forbidden as err:  # the egress rule refuses the host
                if first:
                    raise SourceError(
                        f"cannot read the start URL {item.url}: {err.message}"
                    ) from err
                yield Failed(uri=item.known or item.url, error=err.message)
                continue
            if not allowed:
                if first:
                    raise SourceError(f"robots.txt does not allow fetching {item.url}")
                if item.known is not None:
                    dropped.append(item.known)
                continue
            if run.pages >= max_pages or run.bytes_read >= MAX_RUN_BYTES:
                break
            if loop.time() > deadline:
                log.warning("web source %s: run time limit reached", source.source_id)
                break
            run.pages += 1
            known = run.known.get(item.known) if item.known is not None else None
            try:
                answer = await self._get(run, item.url, known)
            except (KbmeshError, TimeoutError) as err:
                message = err.message if isinstance(err, KbmeshError) else "timed out"
                if first:
                    raise SourceError(f"cannot read the start URL {item.url}: {message}") from err
                yield Failed(uri=item.known or item.url, error=message)
                continue
            if first and answer.status >= 400:
                raise SourceError(f"the start URL {item.url} answered HTTP {answer.status}")
            first = False
            async for change in self._settle(run, item, answer, grace, todo, max_depth):
                yield change
        for key in dropped:
            if key not in run.handled:
                gone = self._missing(run, key, grace)
                if gone is not None:
                    yield gone

    def _queue(self, run: _Run, todo: deque[_Todo], item: _Todo) -> None:
        if item.url in run.queued:
            return
        run.queued.add(item.url)
        todo.append(item)

    def _still_wanted(self, run: _Run, item: _Todo, listed: set[str] | None) -> bool:
        """A known page is asked again unless the source no longer wants it: out of scope,
        excluded, or listed by a sitemap that no longer lists it."""
        key = item.known or item.url
        source = run.source
        if not in_scope(key, run.scope, source.include, source.exclude):
            return False
        return not (item.listed and listed is not None and key not in listed)

    async def _settle(
        self,
        run: _Run,
        item: _Todo,
        answer: _Answer,
        grace: timedelta,
        todo: deque[_Todo],
        max_depth: int,
    ) -> AsyncIterator[Change]:
        """What one answer means for the page asked for, and the links it leads to."""
        source = run.source
        key = item.known or item.url
        if answer.status == 304 and key in run.known:
            run.known[key].missing_since = None
            run.handled.add(key)
            yield Unchanged(uri=key)
            return
        if answer.status in (404, 410):
            if key in run.known:
                change = self._missing(run, key, grace)
                if change is not None:
                    yield change
            return
        if answer.status >= 400 or answer.status == 304:
            if key in run.known:
                yield Failed(uri=key, error=f"HTTP {answer.status}")
            return
        if answer.body is None:
            return  # a type not kept (an image, a zip behind a link)
        mime = clean_mime(answer.headers.get("content-type"))
        page = None
        if mime in HTML_TYPES:
            # Parsing a large page takes milliseconds of CPU: off the event loop.
            page = await asyncio.to_thread(parse_page, answer.body, answer.url)
        canonical = answer.url
        if (
            page is not None
            and page.canonical
            and in_scope(page.canonical, run.scope, source.include, source.exclude)
        ):
            canonical = page.canonical
        run.queued.update({answer.url, canonical})
        if item.known is not None and canonical != item.known and item.known in run.known:
            # The page moved (a redirect, a new canonical URL): its old document goes now,
            # since the new one holds the same content.
            del run.known[item.known]
            run.handled.add(item.known)
            yield Gone(uri=item.known)
        if page is not None and page.follow and item.depth < max_depth:
            for link in page.links:
                if _SKIPPED_SUFFIX.search(httpx.URL(link).path):
                    continue
                if in_scope(link, run.scope, source.include, source.exclude):
                    self._queue(run, todo, _Todo(link, item.depth + 1))
        if canonical in run.handled:
            return  # the same page under another URL: once is enough
        run.handled.add(canonical)
        if not in_scope(canonical, run.scope, source.include, source.exclude):
            return  # redirected out of scope
        if page is not None and not page.index:
            if canonical in run.known:
                del run.known[canonical]
                yield Gone(uri=canonical)
            return
        body = answer.body
        validators = (answer.headers.get("etag"), answer.headers.get("last-modified"))
        revision = validators[0] or validators[1] or hashlib.sha256(body).hexdigest()
        before = run.known.get(canonical)
        run.known[canonical] = Known(
            depth=min(item.depth, before.depth) if before else item.depth,
            etag=validators[0],
            modified=validators[1],
            revision=revision,
            fetched_from=answer.url if answer.url != canonical else None,
            listed=item.listed or (before.listed if before else False),
        )
        if before is not None and before.revision == revision:
            yield Unchanged(uri=canonical)
            return
        title = page.title if page is not None else ""
        yield Put(
            uri=canonical,
            name=title
            or name_from(answer.headers.get("content-disposition"), httpx.URL(canonical)),
            content=to_utf8(body, answer.headers.get("content-type")),
            revision=revision,
            mime_type="text/html" if page is not None else mime or None,
            metadata={"title": title} if title else {},
        )

    def _missing(self, run: _Run, key: str, grace: timedelta) -> Change | None:
        """A known page not there this run: Gone once missing for `grace`, kept till then."""
        page = run.known.get(key)
        if page is None:
            return None
        run.handled.add(key)
        now = int(run.now.timestamp())
        if page.missing_since is None:
            page.missing_since = now
        if now - page.missing_since >= grace.total_seconds():
            del run.known[key]
            return Gone(uri=key)
        return Unchanged(uri=key)

    async def _get(self, run: _Run, url: str, known: Known | None) -> _Answer:
        """GET a page (conditionally when its validators are known), its body read only when
        it is a page to keep, within the size limit and PAGE_SECONDS."""
        headers = {}
        if known is not None and known.etag:
            headers["If-None-Match"] = known.etag
        if known is not None and known.modified:
            headers["If-Modified-Since"] = known.modified
        await self._pace(run, url)
        run.requests += 1
        async with asyncio.timeout(PAGE_SECONDS):
            async with open_url(
                run.client, httpx.URL(url), run.policy, headers=headers
            ) as response:
                final = normalise_url(response.url)
                mime = clean_mime(response.headers.get("content-type"))
                keep = response.status_code == 200 and (mime in HTML_TYPES or mime in LINKED_TYPES)
                body = None
                if keep:
                    body = await read_limited(response, self._settings.max_content_bytes)
                    run.bytes_read += len(body)
                return _Answer(response.status_code, final, response.headers, body)

    async def _pace(self, run: _Run, url: str) -> None:
        """Wait for the host's next slot: the source's rate, or robots.txt's Crawl-delay when
        that is longer."""
        parsed = httpx.URL(url)
        host = parsed.host
        robots = run.robots.get(_origin(parsed))
        delay = (robots.crawl_delay(ROBOTS_AGENT) if robots is not None else None) or 0.0
        interval = max(run.interval, float(delay))
        loop = asyncio.get_running_loop()
        slot = run.next_slot.get(host, 0.0)
        now = loop.time()
        if slot > now:
            await asyncio.sleep(slot - now)
        run.next_slot[host] = max(slot, now) + interval

    async def _allowed(self, run: _Run, url: str) -> bool:
        origin = _origin(httpx.URL(url))
        if origin not in run.robots:
            run.robots[origin] = await self._robots(run, origin)
        robots = run.robots[origin]
        if robots is None:
            return True
        return bool(robots.can_fetch(url, ROBOTS_AGENT))

    async def _robots(self, run: _Run, origin: str) -> Protego | None:
        """The host's robots.txt (None: no rules). As RFC 9309 says, a missing one (4xx)
        allows everything and one that cannot be read (5xx, no answer) allows nothing."""
        url = f"{origin}/robots.txt"
        await self._pace(run, url)
        run.requests += 1
        try:
            async with asyncio.timeout(PAGE_SECONDS):
                async with open_url(run.client, httpx.URL(url), run.policy) as response:
                    if 400 <= response.status_code < 500:
                        return None
                    if response.status_code >= 500:
                        return Protego.parse("User-agent: *\nDisallow: /\n")
                    body = await read_limited(response, 512 * 1024)
                    run.bytes_read += len(body)
        except Forbidden:
            raise
        except (KbmeshError, TimeoutError) as err:
            log.warning("robots.txt at %s unreadable (%s): not crawling that host", url, err)
            return Protego.parse("User-agent: *\nDisallow: /\n")
        return Protego.parse(body.decode("utf-8", errors="replace"))

    async def _sitemap(self, run: _Run, url: str) -> set[str]:
        """The in-scope pages the sitemap (and the sitemaps its index names) lists. A sitemap
        that cannot be read fails the run: pages it stopped listing must not be taken as
        gone because of an outage."""
        pages: set[str] = set()
        todo = [url]
        read = 0
        while todo and read < MAX_SITEMAPS:
            current = todo.pop(0)
            read += 1
            await self._pace(run, current)
            run.requests += 1
            try:
                async with asyncio.timeout(PAGE_SECONDS):
                    async with open_url(run.client, httpx.URL(current), run.policy) as response:
                        if response.status_code != 200:
                            raise FetchFailed(f"HTTP {response.status_code}", field="sitemap")
                        body = await read_limited(response, MAX_SITEMAP_BYTES)
                        run.bytes_read += len(body)
            except (KbmeshError, TimeoutError) as err:
                message = err.message if isinstance(err, KbmeshError) else "timed out"
                raise SourceError(f"cannot read the sitemap {current}: {message}") from err
            found = await asyncio.to_thread(parse_sitemap, body)
            todo.extend(found.sitemaps)
            source = run.source
            for page in found.pages:
                normal = _absolute(httpx.URL(current), page)
                if normal and in_scope(normal, run.scope, source.include, source.exclude):
                    pages.add(normal)
        return pages
