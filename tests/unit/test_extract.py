"""Reading documents (services/ingest/extract.py): every fixture format yields its word as
text, types are sniffed from bytes and names, gzip is undone within bounds, pages and slides
are numbered, and what cannot be read is refused with the reason."""

from __future__ import annotations

import gzip
import io
import zipfile
from pathlib import Path

import pytest

from services.common.domain.errors import InvalidInput, TooLarge
from services.ingest.extract import Bounds, NeedsOcr, extract, gunzip
from tests.fixtures.formats.make_fixtures import FIXTURES, SPEAKER_NOTE

FORMATS = Path(__file__).parent.parent / "fixtures" / "formats"
BOUNDS = Bounds(expanded_bytes=10 * 1024 * 1024, expansion_ratio=200)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_fixture_format_yields_its_word(name: str) -> None:
    """No declared type: the bytes and the name decide, and the distinctive word (in a
    table cell, on a second page or slide, in a docstring, in gzip) is in the text."""
    result = extract((FORMATS / name).read_bytes(), None, name, BOUNDS)
    assert FIXTURES[name] in result.text, result.text[:500]


def test_structure_survives_as_markdown() -> None:
    """Headings, lists and tables come out as markdown; a DOCX table cell is a table cell."""
    docx = extract((FORMATS / "table.docx").read_bytes(), None, "table.docx", BOUNDS)
    assert "# Inventory" in docx.text and "| crate | zephyrcobalt |" in docx.text
    html = extract((FORMATS / "page.html").read_bytes(), "text/html", "page.html", BOUNDS)
    assert "## Trees" in html.text and "- obsidianwillow" in html.text
    assert "hidden" not in html.text, "scripts are not text"
    assert html.text.startswith("# Field guide"), "no <head> metadata as a heading"
    rst = extract((FORMATS / "guide.rst").read_bytes(), None, "guide.rst", BOUNDS)
    assert rst.layout.format == "markdown" and "## Install" in rst.text
    code = extract((FORMATS / "tool.py").read_bytes(), None, "tool.py", BOUNDS)
    assert (code.layout.format, code.layout.language) == ("code", "Python")
    assert code.text == (FORMATS / "tool.py").read_text(), "code is stored as it is"


def test_pdf_pages_and_pptx_slides_are_numbered() -> None:
    pdf = extract((FORMATS / "report.pdf").read_bytes(), None, "report.pdf", BOUNDS)
    assert pdf.layout.unit == "page"
    at = pdf.text.index(FIXTURES["report.pdf"])
    assert pdf.layout.pages_of(at, at + 5) == [2]
    assert pdf.layout.pages_of(0, 5) == [1]
    deck = extract((FORMATS / "deck.pptx").read_bytes(), None, "deck.pptx", BOUNDS)
    assert deck.layout.unit == "slide"
    at = deck.text.index(FIXTURES["deck.pptx"])
    assert deck.layout.pages_of(at, at + 5) == [2]


def test_speaker_notes_are_read_with_their_slide() -> None:
    """A slide's speaker notes follow its text, on its slide; a slide without notes gets no
    notes section."""
    deck = extract((FORMATS / "deck.pptx").read_bytes(), None, "deck.pptx", BOUNDS)
    at = deck.text.index(SPEAKER_NOTE)
    assert deck.layout.pages_of(at, at + 5) == [2]
    first = deck.text.index("Speaker notes for the opening.")
    assert deck.layout.pages_of(first, first + 5) == [1]
    assert deck.text.count("Notes:") == 2


def test_types_are_sniffed_from_bytes_before_names_and_declared_types() -> None:
    """A PDF named .txt and declared text/plain is read as a PDF; an .rst declared with
    Python's guess (text/prs.fallenstein.rst) is read; markdown declared text/plain under a
    .md name is markdown."""
    pdf = (FORMATS / "report.pdf").read_bytes()
    assert extract(pdf, "text/plain", "report.txt", BOUNDS).mime_type == "application/pdf"
    rst = (FORMATS / "guide.rst").read_bytes()
    assert extract(rst, "text/prs.fallenstein.rst", "guide.rst", BOUNDS).mime_type == ("text/x-rst")
    md = (FORMATS / "notes.md").read_bytes()
    assert extract(md, "text/plain", "notes.md", BOUNDS).layout.format == "markdown"
    assert extract(b"#!/bin/sh\necho hi\n", None, "configure", BOUNDS).mime_type == "text/plain"
    # Text sent as text under a binary format's name is text.
    assert extract(b"just words", "text/plain", "scan.pdf", BOUNDS).text == "just words"


def test_unreadable_input_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidInput, match="audio/mpeg"):
        extract(b"x", "audio/mpeg", "a.mp3", BOUNDS)
    with pytest.raises(InvalidInput, match="binary content"):
        extract(bytes(range(256)), None, "blob.bin", BOUNDS)
    with pytest.raises(InvalidInput, match="not a readable DOCX"):
        extract(b"PK\x03\x04 broken", None, "broken.docx", BOUNDS)
    with pytest.raises(InvalidInput, match="UTF-8"):
        extract("café".encode("latin-1"), None, "notes.txt", BOUNDS)
    with pytest.raises(InvalidInput, match="no text"):
        extract(b"  \n ", None, "empty.md", BOUNDS)
    with pytest.raises(InvalidInput, match="gzip"):
        extract(b"\x1f\x8b\x08\x00broken", None, "a.md.gz", BOUNDS)


def test_images_and_pdfs_without_text_wait_for_ocr() -> None:
    from tests.support.domain import blank_pdf

    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
    with pytest.raises(NeedsOcr):
        extract(png, None, "scan.png", BOUNDS)
    with pytest.raises(NeedsOcr):
        extract(blank_pdf(), "application/pdf", "scan.pdf", BOUNDS)


def test_decompression_bombs_are_refused_by_ratio_and_by_size() -> None:
    """gzip is inflated in bounded steps: past the ratio or the absolute size it stops, so a
    bomb never expands in memory; an office file's zip is checked by its declared sizes."""
    bomb = gzip.compress(b"\x00" * (50 * 1024 * 1024))
    with pytest.raises(TooLarge, match="EXTRACT_EXPANSION_RATIO"):
        gunzip(bomb, BOUNDS)
    with pytest.raises(TooLarge, match="EXTRACT_EXPANDED_BYTES"):
        gunzip(bomb, Bounds(expanded_bytes=1024 * 1024, expansion_ratio=10**9))
    text = "word " * 2000
    assert gunzip(gzip.compress(text.encode()), BOUNDS).decode() == text
    # Two gzip members, as `cat a.gz b.gz` makes.
    assert gunzip(gzip.compress(b"a") + gzip.compress(b"b"), BOUNDS) == b"ab"

    docx = io.BytesIO()
    with zipfile.ZipFile(docx, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", "<w:p/>" * 2_000_000)
    with pytest.raises(TooLarge, match="decompression bomb"):
        extract(docx.getvalue(), None, "bomb.docx", Bounds(100 * 1024 * 1024, 200))


def test_a_zip_that_lies_about_its_sizes_is_refused_by_what_its_members_inflate_to() -> None:
    """Declared sizes can lie: a presentation whose slide declares 3 kB but inflates to 20 MB
    is refused by the bytes its members really inflate to, before the reader gets it (the
    members are inflated in bounded steps, counted, and dropped)."""
    from tests.support.archives import lying_deck

    bomb = lying_deck(20 * 1024 * 1024)
    with zipfile.ZipFile(io.BytesIO(bomb)) as z:
        assert sum(info.file_size for info in z.infolist()) < 200 * 1024, "it declares little"
    with pytest.raises(TooLarge, match="EXTRACT_EXPANDED_BYTES"):
        extract(bomb, None, "deck.pptx", BOUNDS)
    with pytest.raises(TooLarge, match="EXTRACT_EXPANSION_RATIO"):
        extract(bomb, None, "deck.pptx", Bounds(expanded_bytes=10**9, expansion_ratio=200))


def test_zip_members_in_another_compression_method_than_office_files_use_are_refused() -> None:
    """Office files, OpenDocument and EPUB store their members stored or deflated; a member
    in another method could not be counted before the reader inflates it, so it is refused."""
    deck = io.BytesIO()
    with (
        zipfile.ZipFile(FORMATS / "deck.pptx") as src,
        zipfile.ZipFile(deck, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            method = zipfile.ZIP_BZIP2 if info.filename.endswith("slide1.xml") else None
            dst.writestr(info.filename, src.read(info), compress_type=method)
    with pytest.raises(InvalidInput, match="stored or deflated"):
        extract(deck.getvalue(), None, "deck.pptx", BOUNDS)


def test_an_outlook_message_is_known_by_its_bytes() -> None:
    """A compound file whose directory names MAPI property streams is an Outlook message
    under any name; another compound file under a .msg name is refused, not guessed."""
    data = (FORMATS / "mail.msg").read_bytes()
    for name in ("upload.bin", "mail"):
        result = extract(data, None, name, BOUNDS)
        assert result.mime_type == "application/vnd.ms-outlook"
        assert FIXTURES["mail.msg"] in result.text
    other = data.replace("__substg1.0_".encode("utf-16-le"), "__payload1.0".encode("utf-16-le"))
    with pytest.raises(InvalidInput, match="Outlook message"):
        extract(other, None, "mail.msg", BOUNDS)


DOCS_PAGE = b"""<!DOCTYPE html><html><head><title>Tide pools - Earth Handbook</title></head>
<body><header><a href="/">Earth Handbook</a> | Search | Version 2.4</header>
<nav><h3>Table of contents</h3><ul><li><a href="a.html">Glaciers guide</a></li>
<li><a href="b.html">Volcanoes guide</a></li></ul></nav>
<div class="related" role="navigation"><a href="prev.html">Previous topic</a></div>
<div role="main"><h2>Where they form</h2><p>Tide pools hold anemones and crabs.</p>
<pre><code>tide --height 2.1</code></pre></div>
<footer>Copyright 2001-2024 the authors. Created using a static site generator.</footer>
</body></html>"""


def test_a_web_page_is_read_as_its_main_content_under_its_title() -> None:
    """A page that marks its main content (<main>, role="main", one <article>) is read as that
    content: the header, sidebar and footer every page repeats are left out, the code kept,
    and the page title opens the text as its top heading (the heading path of every chunk)."""
    text = extract(DOCS_PAGE, "text/html", "tides.html", BOUNDS).text
    assert text.startswith("# Tide pools - Earth Handbook\n"), text
    assert "## Where they form" in text and "anemones and crabs" in text
    assert "tide --height 2.1" in text
    for chrome in ("Table of contents", "Previous topic", "Copyright", "Version 2.4"):
        assert chrome not in text, text


def test_a_page_without_a_main_landmark_keeps_its_text_but_not_its_navigation() -> None:
    """Without a main landmark the whole body is read, less what it marks as navigation
    (<nav>, role="navigation") and its footer."""
    page = DOCS_PAGE.replace(b'<div role="main">', b"<div>")
    text = extract(page, "text/html", "tides.html", BOUNDS).text
    assert "anemones and crabs" in text and "tide --height 2.1" in text
    assert "Copyright" not in text, text
    assert "Glaciers guide" not in text and "Previous topic" not in text, text
