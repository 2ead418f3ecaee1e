"""Reading a document's text: the type sniffed from its bytes and name, gzip undone within
bounds, and every format that is not already text converted to markdown by kreuzberg
(headings, lists and tables kept; pages and slides numbered). Scanned input (a PDF without a
text layer, an image) raises NeedsOcr: it waits for `ocr.done`.

This runs in the extraction child process (see `sandbox.py`), never in a serving process:
import nothing here that a child should not load.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import lxml.html
from lxml import etree

from services.common.domain.errors import InvalidInput, TooLarge
from services.common.domain.formats import (
    GENERIC_TYPES,
    GZIP_TYPE,
    Format,
    by_mime,
    by_name,
    clean_mime,
    is_gzip_name,
    readable_types,
)
from services.common.domain.layout import Layout

SETTING = "KBMESH_LIMITS__"
# A page marker kreuzberg writes between slides; plain letters survive its markdown escaping.
_MARKER = "KBMESHPAGEBREAK7F3A"
_MARKER_LINE = re.compile(rf"\n*{_MARKER} (\d+)\n*")
# kreuzberg 4.10 opens an HTML page's markdown with its <head> metadata as YAML front matter
# whose closing "---" its own formatter turns into a heading ("## title: ..."): dropped, the
# page's <h1> and text follow it.
_HTML_FRONT_MATTER = re.compile(r"\A---\n(?:[\w:-]+: [^\n]*\n)*\n?## [\w:-]+: [^\n]*\n+")
_ZIP_MAGIC = b"PK\x03\x04"
_GZIP_MAGIC = b"\x1f\x8b"
_COMPOUND_FILE_MAGIC = bytes.fromhex("D0CF11E0A1B11AE1")
_OUTLOOK_STREAM = "__substg1.0_".encode("utf-16-le")
_OUTLOOK_TYPE = "application/vnd.ms-outlook"


class NeedsOcr(Exception):
    """The content has no text layer; it waits for `ocr.done`."""


@dataclass(frozen=True)
class Bounds:
    """How far decompression may expand a document (the bomb guard)."""

    expanded_bytes: int
    expansion_ratio: int


@dataclass(frozen=True)
class Extracted:
    text: str
    mime_type: str  # the type as read (sniffed), which the document is recorded with
    layout: Layout


def extract(data: bytes, declared: str | None, name: str, bounds: Bounds) -> Extracted:
    """The document's text and layout, or NeedsOcr / InvalidInput / TooLarge (a document
    with no text at all is invalid: it would be stored and reported complete with nothing
    to find)."""
    mime = clean_mime(declared)
    if data.startswith(_GZIP_MAGIC) or mime == GZIP_TYPE or is_gzip_name(name):
        data = gunzip(data, bounds)
        mime = "" if mime == GZIP_TYPE else mime
        name = re.sub(r"\.gz$", "", name, flags=re.IGNORECASE)
    fmt = sniff(data, mime, name)
    if fmt.kind == "image":
        raise NeedsOcr(fmt.mime_type)
    if fmt.kind == "document":
        text, layout = _converted(data, fmt, bounds)
    else:
        text = _decode(data, fmt)
        layout = Layout(checksum="", format="text" if fmt.kind == "text" else fmt.kind)
        if fmt.kind == "code":
            layout.language = fmt.name
    if not text.strip():
        if fmt.mime_type == "application/pdf":
            raise NeedsOcr(fmt.mime_type)
        raise InvalidInput("the document has no text (empty or only whitespace)", field="content")
    return Extracted(text=text, mime_type=fmt.mime_type, layout=layout)


def sniff(data: bytes, declared: str, name: str) -> Format:
    """The document's format: its bytes decide for binary formats (a PDF under any name is
    read as a PDF), then a specific declared type, then the file name, then whether the bytes
    are text at all."""
    magic = _magic(data)
    if magic is not None and (magic.binary or magic.kind == "image"):
        return magic
    stated = by_mime(declared) if declared not in GENERIC_TYPES else None
    named = by_name(name)
    if declared and declared not in GENERIC_TYPES and stated is None:
        raise InvalidInput(
            f"unsupported mime_type {declared!r}; readable types: "
            f"{', '.join(readable_types()['mime_types'])}",
            field="mime_type",
        )
    # "text/plain" is what many clients send for any text: a telling name of a text format is
    # more exact (a binary format's name on text content is not: the text is read as text).
    text_named = named is not None and not named.binary
    if stated is not None and not (stated.mime_type == "text/plain" and text_named):
        return stated
    if named is not None and not named.binary:
        return named
    if magic is not None:
        return magic
    if named is not None:  # a binary format by name whose bytes are not that format
        raise InvalidInput(f"not a readable {named.name} file", field="content")
    if b"\x00" in data[:8192]:
        raise InvalidInput(
            "unsupported type: binary content in no format kbmesh reads", field="mime_type"
        )
    return by_mime("text/plain")  # type: ignore[return-value]


def _magic(data: bytes) -> Format | None:
    """What kreuzberg's content sniffing says, when it names a format kbmesh reads."""
    import kreuzberg

    if data.startswith(_COMPOUND_FILE_MAGIC):
        # kreuzberg does not sniff compound files; an Outlook message's directory names its
        # property streams "__substg1.0_...".
        return by_mime(_OUTLOOK_TYPE) if _OUTLOOK_STREAM in data else None
    try:
        detected = kreuzberg.detect_mime_type_from_bytes(data)
    except (kreuzberg.KreuzbergError, RuntimeError, ValueError):
        return None  # "Could not determine MIME type": not a format it knows
    found = by_mime(detected)
    if found is None and detected == "application/zip":
        found = _zip_format(data)
    return found


def _zip_format(data: bytes) -> Format | None:
    """Office and e-book files are zips; their first entries name what they are."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = set(z.namelist())
            if "mimetype" in names:
                # Its first bytes only: the member may be a bomb (it is measured later).
                with z.open("mimetype") as member:
                    return by_mime(member.read(100).decode("ascii", "replace"))
    except (zipfile.BadZipFile, OSError, ValueError, zlib.error):
        return None
    for prefix, mime in (
        ("word/", "application/vnd.openxmlformats-officedocument.wordprocessingml.document"),
        ("ppt/", "application/vnd.openxmlformats-officedocument.presentationml.presentation"),
        ("xl/", "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"),
    ):
        if any(n.startswith(prefix) for n in names):
            return by_mime(mime)
    return None


def gunzip(data: bytes, bounds: Bounds) -> bytes:
    """Decompress gzip (also several members), refusing a bomb before it is inflated: output
    is read in bounded steps, and reading stops past the absolute size or the ratio."""
    limit = min(bounds.expanded_bytes, max(len(data), 1) * bounds.expansion_ratio)
    out = bytearray()
    rest = data
    try:
        while rest:
            inflater = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
            pending = rest
            while pending and not inflater.eof:
                out += inflater.decompress(pending, 1 << 20)
                _check_expansion(len(out), len(data), limit, bounds)
                pending = inflater.unconsumed_tail
            if not inflater.eof:
                raise InvalidInput("gzip content is truncated", field="content")
            rest = inflater.unused_data.lstrip(b"\x00")
    except zlib.error as err:
        raise InvalidInput(f"not readable gzip content: {err}", field="content") from err
    return bytes(out)


def _check_expansion(size: int, packed: int, limit: int, bounds: Bounds) -> None:
    if size <= limit:
        return
    if size > bounds.expanded_bytes:
        raise TooLarge(
            f"the content expands past {bounds.expanded_bytes} bytes when decompressed "
            f"({SETTING}EXTRACT_EXPANDED_BYTES)",
            field="content",
        )
    raise TooLarge(
        f"the content expands more than {bounds.expansion_ratio} times its {packed} bytes "
        f"when decompressed: refused as a decompression bomb ({SETTING}EXTRACT_EXPANSION_RATIO)",
        field="content",
    )


def _check_zip(data: bytes, bounds: Bounds) -> None:
    """An office file or e-book is a zip: refuse one whose members inflate past the bounds
    before the reader gets it. Declared sizes can lie (a few kB declared, hundreds of MB in the
    deflate stream), and Python's zipfile stops at the declared size: so each member's
    compressed bytes are inflated here in bounded steps, counted and dropped. (The reader
    inflates them again; a document within the bounds costs its inflation twice.)"""
    if not data.startswith(_ZIP_MAGIC):
        return
    limit = min(bounds.expanded_bytes, len(data) * bounds.expansion_ratio)
    inflated = 0
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise InvalidInput(f"not a readable zip container: {err}", field="content") from err
    for info in members:
        packed = _packed(data, info)
        if info.compress_type == zipfile.ZIP_STORED:
            inflated += len(packed)
            _check_expansion(inflated, len(data), limit, bounds)
            continue
        if info.compress_type != zipfile.ZIP_DEFLATED:
            # OOXML, OpenDocument and EPUB allow these two only; another method could not be
            # measured here before the reader inflates it.
            raise InvalidInput(
                f"{info.filename!r} is compressed with method {info.compress_type}: office "
                "files and e-books store their members stored or deflated",
                field="content",
            )
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            while not inflater.eof:
                step = len(inflater.decompress(packed, 1 << 20))
                packed = inflater.unconsumed_tail
                if not step and not packed:
                    break  # a truncated member: the reader says so
                inflated += step
                _check_expansion(inflated, len(data), limit, bounds)
        except zlib.error as err:
            raise InvalidInput(
                f"not a readable zip container: {info.filename!r} is damaged ({err})",
                field="content",
            ) from err


def _packed(data: bytes, info: zipfile.ZipInfo) -> bytes:
    """A member's compressed bytes: they follow its local header, whose name and extra field
    lengths can differ from the central directory's."""
    header = info.header_offset
    if data[header : header + 4] != b"PK\x03\x04":
        raise InvalidInput(
            f"not a readable zip container: no header for {info.filename!r}", field="content"
        )
    name_length, extra_length = struct.unpack_from("<HH", data, header + 26)
    start = header + 30 + name_length + extra_length
    return data[start : start + info.compress_size]


def _converted(data: bytes, fmt: Format, bounds: Bounds) -> tuple[str, Layout]:
    import kreuzberg

    _check_zip(data, bounds)
    if fmt.name == "HTML":
        data = main_content(data)
    result = _read(kreuzberg, data, fmt, "markdown")
    layout = Layout(checksum="", format="markdown")
    pages = [
        (int(p["page_number"]), str(p.get("content") or "").replace("\r\n", "\n"))
        for p in result.pages or []
    ]
    if fmt.mime_type == "application/pdf" and any(content.strip() for _, content in pages):
        # The pages' own text: kreuzberg's joined markdown of a PDF drops lines it takes for
        # running headers, and carries no page markers.
        layout.unit = "page"
        return _joined(pages, layout), layout
    content = str(result.content).replace("\x00", "")
    if fmt.name == "HTML":
        content = _HTML_FRONT_MATTER.sub("", content)
    found = list(_MARKER_LINE.finditer(content))
    if not found:
        return content, layout
    layout.unit = "slide" if "presentation" in fmt.mime_type else "page"
    pieces = _pieces(content)
    if layout.unit == "slide":
        # kreuzberg's markdown leaves speaker notes out; its plain text has them, each
        # slide's after a "Notes:" paragraph.
        plain = _read(kreuzberg, data, fmt, "plain")
        notes = {}
        for number, text in _pieces(str(plain.content)):
            _, said, note = text.rpartition("\n\nNotes:\n\n")
            if said and note.strip():
                notes[number] = note.strip()
        pieces = [
            (n, f"{text.rstrip()}\n\nNotes:\n\n{notes[n]}" if n in notes else text)
            for n, text in pieces
        ]
    return _joined(pieces, layout), layout


def main_content(page: bytes) -> bytes:
    """A web page reduced to what it marks as its content: the first <main>, else the
    element with role="main", else its only <article>, under an <h1> of the page's <title>
    (unless the content opens with an <h1> of its own), so the title and headings are every
    chunk's heading path. A page that marks none is returned as it is. Docs sites repeat a
    header, a sidebar and a footer on every page; read, they drown BM25 and pull every page's
    vector toward the same place (docs/benchmarks.md, "Main content of web pages", has the
    measurement that chose this over trafilatura)."""
    try:
        root = lxml.html.document_fromstring(page)
    except (etree.ParserError, ValueError):
        return page
    main = root.xpath("//main") or root.xpath("//*[@role='main']")
    if not main:
        articles = root.xpath("//article")
        main = articles if len(articles) == 1 else []
    if not main:
        return page
    content = main[0]
    title = " ".join("".join(root.xpath("//title//text()")).split())
    body = lxml.html.Element("body")
    first = next(iter(content.iter(*_HEADINGS)), None)
    if title and (first is None or first.tag != "h1"):
        heading = lxml.html.Element("h1")
        heading.text = title
        body.append(heading)
    content.tail = None
    body.append(content)
    return etree.tostring(body, method="html", encoding="utf-8")


_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")


def _read(kreuzberg: Any, data: bytes, fmt: Format, output_format: str) -> Any:
    """kreuzberg's result, its reports put in Python's terms: a failed allocation (at the
    child's memory limit) is a MemoryError, whatever kreuzberg wraps it in (`OSError('out of
    memory')`, `ParsingError('... IO error: out of memory')`); its own errors say the
    document cannot be read. Anything else it raises goes on as it is: the sandbox says what
    that means for the document."""
    content = _text_bytes(data, fmt)
    try:
        return kreuzberg.extract_bytes_sync(
            content, fmt.mime_type, _config(kreuzberg, output_format)
        )
    except Exception as err:
        if "out of memory" in str(err).lower():
            raise MemoryError(str(err)) from err
        if isinstance(err, kreuzberg.KreuzbergError):
            raise InvalidInput(
                f"not a readable {fmt.name} file: {first_line(err)}", field="content"
            ) from err
        raise


def _config(kreuzberg: Any, output_format: str) -> Any:
    return kreuzberg.ExtractionConfig(
        output_format=output_format,
        # What a page marks as navigation (<nav>, role="navigation": breadcrumbs, "next" and
        # "previous", sidebars) is not its content.
        html_options={
            "preprocessing": {"enabled": True, "preset": "aggressive", "remove_navigation": True}
        },
        use_cache=False,
        # Scanned pages wait for `ocr.done`; kreuzberg must not OCR them itself. (Its type
        # stubs lag behind the binding, which takes this argument.)
        disable_ocr=True,  # type: ignore[call-arg]
        pages=kreuzberg.PageConfig(
            extract_pages=True,
            insert_page_markers=True,
            marker_format=f"\n\n{_MARKER} {{page_num}}\n\n",
        ),
    )


def _pieces(content: str) -> list[tuple[int, str]]:
    """(page or slide number, its text) from text with kreuzberg's page markers."""
    found = list(_MARKER_LINE.finditer(content))
    pieces = [
        (int(m.group(1)), content[m.end() : nxt.start() if nxt else len(content)])
        for m, nxt in zip(found, [*found[1:], None], strict=True)
    ]
    lead = content[: found[0].start()] if found else ""
    if lead.strip():
        pieces.insert(0, (int(found[0].group(1)), lead))
    return pieces


def _joined(pieces: list[tuple[int, str]], layout: Layout) -> str:
    parts: list[str] = []
    offset = 0
    for number, piece in pieces:
        # NULs that a parser passes through from a binary format carry nothing.
        piece = piece.replace("\x00", "").strip("\n")
        if not piece.strip():
            continue
        if parts:
            offset += 2  # the "\n\n" between pages
        layout.pages.append((offset, number))
        parts.append(piece)
        offset += len(piece)
    return "\n\n".join(parts)


def _text_bytes(data: bytes, fmt: Format) -> bytes:
    # Text formats must be UTF-8 for kreuzberg, as for every text kbmesh stores.
    if not fmt.binary:
        _decode(data, fmt)
    return data


def _decode(data: bytes, fmt: Format) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidInput(f"{fmt.name} content is not valid UTF-8", field="content") from err
    if "\x00" in text:
        raise InvalidInput(
            f"{fmt.mime_type} content contains NUL characters: not a text file", field="content"
        )
    return text.removeprefix("\ufeff")


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
