"""Text extraction per media type. Scanned input (no text layer, images) needs OCR."""

from __future__ import annotations

import io

from services.common.content import (
    DOCX_TYPE,
    HTML_TYPES,
    IMAGE_PREFIX,
    PDF_TYPE,
    SUPPORTED,
    TEXT_TYPES,
)
from services.common.errors import InvalidInput


class NeedsOcr(Exception):
    """The content has no text layer; it waits for `ocr.done`."""


def extract_text(data: bytes, mime: str) -> str:
    """Return the document's text, or raise NeedsOcr / InvalidInput."""
    if mime in TEXT_TYPES:
        text = _decode(data)
        if "\x00" in text:
            raise InvalidInput(
                f"{mime} content contains NUL characters: not a text file", field="content"
            )
        return text
    # NULs that a parser passes through from a binary format carry nothing.
    return _extract_formatted(data, mime).replace("\x00", "")


def _extract_formatted(data: bytes, mime: str) -> str:
    if mime in HTML_TYPES:
        from bs4 import BeautifulSoup

        soup = BeautifulSoup(_decode(data), "html.parser")
        for tag in soup(["script", "style", "noscript"]):
            tag.decompose()
        return soup.get_text("\n", strip=True)
    if mime == PDF_TYPE:
        return _pdf_text(data)
    if mime == DOCX_TYPE:
        import docx

        try:
            document = docx.Document(io.BytesIO(data))
        except Exception as err:
            raise InvalidInput(f"not a readable DOCX file: {err}", field="content") from err
        return "\n".join(p.text for p in document.paragraphs if p.text.strip())
    if mime.startswith(IMAGE_PREFIX):
        raise NeedsOcr(mime)
    raise InvalidInput(
        f"unsupported mime_type {mime!r}; supported: {', '.join(SUPPORTED)}", field="mime_type"
    )


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidInput("text content is not valid UTF-8", field="content") from err


def _pdf_text(data: bytes) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PdfReadError, ValueError, KeyError) as err:
        raise InvalidInput(f"not a readable PDF: {err}", field="content") from err
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text.strip():
        raise NeedsOcr(PDF_TYPE)
    return text
