"""Knowledge bases and documents as resources a client can list and open (MCP resources):
their addresses, the listing an API key pages through, and what reading one gives — a KB as
a markdown page (description, settings, counts, its documents), a document as its extracted
text, in pages when it is long.

Access follows the tools' rules (`access.py`): a KB-scoped key lists and reads only its KBs
and the documents in them; any other KB or document, like one of another org, reads exactly
as one that does not exist."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import quote

from services.common.bus.registry import Registries
from services.common.domain.errors import InvalidInput
from services.common.domain.models import DocStatus, DocumentRecord, KnowledgeBase
from services.gateway.auth import Principal
from services.gateway.catalog import DocumentSummary
from services.gateway.schemas import KbDocumentView, KbStats, KbView, Page
from services.gateway.service.access import visible
from services.gateway.service.documents import Documents
from services.gateway.service.kbs import KnowledgeBases

# The two address forms (RFC 6570 URI templates). What `kb_uri` and `document_uri` write is
# these templates expanded; the MCP server matches requests against them.
KB_TEMPLATE = "kbmesh://kbs/{kb}"
DOCUMENT_TEMPLATE = "kbmesh://documents/{document_id}{?page}"
# A page of a document's text: about 5,000 tokens, which a client can attach to a
# conversation whole; a 10 MB text is some 500 pages.
PAGE_CHARS = 20_000
# Resources on one page of the listing.
LIST_PAGE = 100
# Documents a KB's page names; the listing (and kb_list_documents) has them all.
KB_PAGE_DOCUMENTS = 50
# Longer than any cursor `_cursor` writes (ids and names of stored things are bounded).
MAX_CURSOR = 1_000
MARKDOWN = "text/markdown"
PLAIN = "text/plain"
_PAGE_NUMBER = re.compile(r"[1-9][0-9]{0,8}")
# Where a resource stands in the listing: KBs (0) before documents (1), then by creation.
Position = tuple[int, str, str]


def kb_uri(kb_id: str) -> str:
    return "kbmesh://kbs/" + quote(kb_id, safe="")


def document_uri(document_id: str, page: int | None = None) -> str:
    uri = "kbmesh://documents/" + quote(document_id, safe="")
    return uri if page is None else f"{uri}?page={page}"


@dataclass(frozen=True)
class ResourceInfo:
    """One resource as the listing shows it, or as a tool result links it."""

    uri: str
    name: str
    description: str | None = None
    mime_type: str | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True)
class ResourceListing:
    items: list[ResourceInfo]
    next_cursor: str | None = None


@dataclass(frozen=True)
class PageInfo:
    """Where a page of a long document's text lies: `next_uri` reads the one after it."""

    page: int
    pages: int
    next_uri: str | None


@dataclass(frozen=True)
class ResourceText:
    text: str
    mime_type: str
    page: PageInfo | None = None


class Resources:
    def __init__(
        self,
        registries: Registries,
        kbs: KnowledgeBases,
        documents: Documents,
        *,
        page_chars: int = PAGE_CHARS,
    ) -> None:
        self.reg = registries
        self.kbs = kbs
        self.documents = documents
        self.page_chars = page_chars

    async def listing(
        self, p: Principal, cursor: str | None = None, limit: int = LIST_PAGE
    ) -> ResourceListing:
        """The KBs the caller may see (oldest first), then the documents with text it may
        see (oldest first), `limit` at a time. The cursor holds the position of the last
        one listed, so a listing runs on past resources created or deleted meanwhile."""
        after = _position(cursor) if cursor is not None else None
        kbs = [k for k in await self.reg.kbs.of_org(p.org_id) if p.can_see(k.kb_id)]
        records = [
            r
            for r in self.documents.catalog.documents(p.org_id)
            if r.status == DocStatus.ready and visible(p, r)
        ]
        found: list[tuple[Position, KnowledgeBase | DocumentSummary]] = [
            ((0, k.created_at.isoformat(), k.kb_id), k) for k in kbs
        ]
        found += [((1, r.created_at.isoformat(), r.document_id), r) for r in records]
        rest = sorted(
            (item for item in found if after is None or item[0] > after), key=lambda i: i[0]
        )
        page = rest[:limit]
        more = len(rest) > limit
        return ResourceListing(
            items=[
                kb_info(x) if isinstance(x, KnowledgeBase) else document_info(x) for _, x in page
            ],
            next_cursor=_cursor(page[-1][0]) if more else None,
        )

    async def kb(self, p: Principal, ref: str) -> ResourceText:
        """A KB (by id or name) as a markdown page."""
        kb = await self.kbs.resolve(p, ref)
        view = await self.kbs.view(kb)
        stats = await self.kbs.stats(p, kb.kb_id)
        members = await self.kbs.documents(p, kb.kb_id, limit=KB_PAGE_DOCUMENTS)
        return ResourceText(kb_markdown(view, stats, members), MARKDOWN)

    async def document(self, p: Principal, document_id: str, page: str | None) -> ResourceText:
        """A document's extracted text, or page `page` of it (1-based; the first when None).
        The text of a document longer than one page ends with a line that names the next
        page's address, or says that it is the last."""
        record, text = await self.documents.text(p, document_id)
        mime = MARKDOWN if record.mime_type == MARKDOWN else PLAIN
        pages = max(1, math.ceil(len(text) / self.page_chars))
        number = _page_number(page, pages, record)
        if pages == 1:
            return ResourceText(text, mime)
        start = (number - 1) * self.page_chars
        body = text[start : start + self.page_chars]
        next_uri = document_uri(record.document_id, number + 1) if number < pages else None
        where = f'[page {number} of {pages} of "{record.name}"'
        ending = f": continued at {next_uri}]" if next_uri else ": the end of the document]"
        return ResourceText(f"{body}\n\n{where}{ending}", mime, PageInfo(number, pages, next_uri))


def kb_info(kb: KnowledgeBase) -> ResourceInfo:
    return ResourceInfo(
        uri=kb_uri(kb.kb_id),
        name=kb.name,
        description=kb.description or "a knowledge base",
        mime_type=MARKDOWN,
        updated_at=kb.updated_at,
    )


def document_info(record: DocumentRecord | DocumentSummary) -> ResourceInfo:
    return ResourceInfo(
        uri=document_uri(record.document_id),
        name=record.name,
        description=record.uri or None,
        mime_type=MARKDOWN if record.mime_type == MARKDOWN else PLAIN,
        updated_at=record.updated_at,
    )


def document_links(cited: Iterable[tuple[str, str]]) -> list[ResourceInfo]:
    """A link to each of the (document id, name) pairs, once each, in the order first cited:
    what a search or an answer attaches for a client to open."""
    seen: dict[str, ResourceInfo] = {}
    for document_id, name in cited:
        seen.setdefault(
            document_id,
            ResourceInfo(
                uri=document_uri(document_id),
                name=name,
                description="a cited document: read it for its whole text (long ones in pages)",
            ),
        )
    return list(seen.values())


def kb_markdown(view: KbView, stats: KbStats, members: Page[KbDocumentView]) -> str:
    lines = [f"# {view.name}", ""]
    if view.description:
        lines += [view.description, ""]
    progress = stats.progress
    lines += [
        f"- id: `{view.kb_id}`",
        f"- status: {view.status.value}",
        f"- documents indexed: {stats.document_count} · chunks: {stats.chunk_count}",
        f"- documents matching its tags: {stats.total_documents_with_tags} · pending: "
        f"{stats.pending_count} · failed: {stats.failed_count}",
    ]
    if progress.reindex is not None and progress.reindex.done < progress.reindex.total:
        lines.append(
            f"- reindexing: {progress.reindex.done} of {progress.reindex.total} documents "
            f"rebuilt with settings version {progress.reindex.settings_version}"
        )
    settings: list[tuple[str, object]] = [
        ("chunker", view.chunker.value),
        ("chunk_size", view.chunk_size),
        ("chunk_overlap", view.chunk_overlap),
        ("embedding_model", view.embedding_model),
        ("api_base", view.api_base),
        ("coalesce_neighbors", view.coalesce_neighbors),
        ("rerank_model", view.rerank_model),
        ("rerank_api_base", view.rerank_api_base),
        ("tag_ids", ", ".join(view.tag_ids) or None),
        ("settings_version", view.settings_version),
    ]
    lines += ["", "## Settings", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in settings if value is not None]
    lines += ["", "## Documents", ""]
    if not members.items:
        lines.append("(none yet)")
    for d in members.items:
        plural = "s" if d.chunk_count > 1 else ""
        chunks = f", {d.chunk_count} chunk{plural}" if d.chunk_count else ""
        lines.append(
            f"- [{_link_text(d.name)}]({document_uri(d.document_id)}) — {d.status}{chunks}"
        )
    if members.total > len(members.items):
        lines.append(
            f"- … and {members.total - len(members.items)} more (resources/list, or the "
            "kb_list_documents tool, lists them all)"
        )
    return "\n".join(lines) + "\n"


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _link_text(name: str) -> str:
    return re.sub(r"([\\\[\]])", r"\\\1", name)


def _page_number(page: str | None, pages: int, record: DocumentRecord) -> int:
    if page is None:
        return 1
    if not _PAGE_NUMBER.fullmatch(page):
        raise InvalidInput(
            f"page must be a whole number from 1 to {pages}, not {page[:20]!r}", field="page"
        )
    number = int(page)
    if number > pages:
        raise InvalidInput(
            f"page {number} is past the end: document {record.document_id!r} has {pages} "
            f"page{'s' if pages > 1 else ''}",
            field="page",
        )
    return number


def _cursor(position: Position) -> str:
    return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")


def _position(cursor: str) -> Position:
    """The position a cursor of `_cursor` holds; anything else is refused."""
    try:
        if len(cursor) > MAX_CURSOR:
            raise ValueError(cursor)
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        group, created, key = json.loads(raw)
        if group in (0, 1) and isinstance(created, str) and isinstance(key, str):
            return group, created, key
    except (binascii.Error, ValueError, TypeError):
        pass
    raise InvalidInput(
        "cursor: not a cursor this server gave; list again without one to start over",
        field="cursor",
    )
