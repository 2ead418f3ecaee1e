"""The formats kbmesh reads: one table of media types and file extensions, shared by the
gateway (what an upload may declare, `GET /v1/types`), ingest (how a document is read) and the
ingest CLI (which files to upload).

Every format has a `kind` that says how its text is read:

- `text`: plain text, stored as it is;
- `markdown`: already markdown (headings, lists and tables are read from it as it is);
- `code`: source code, stored as it is and chunked at its top-level definitions;
- `document`: a format the extraction library converts to markdown (PDF, office, e-mail...);
- `image`: no text layer: the document waits for `ocr.done`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["text", "markdown", "code", "document", "image"]

GZIP_TYPE = "application/gzip"
GZIP_EXTENSIONS = (".gz",)


@dataclass(frozen=True)
class Format:
    name: str
    kind: Kind
    mime_types: tuple[str, ...]  # the first is the one documents are recorded with
    extensions: tuple[str, ...] = ()
    binary: bool = False  # bytes, not text: never sent as text content

    @property
    def mime_type(self) -> str:
        return self.mime_types[0]


def _code(name: str, mime: str, *extensions: str) -> Format:
    return Format(name, "code", (mime, f"text/x-{name.lower()}"), extensions)


FORMATS: tuple[Format, ...] = (
    Format("Plain text", "text", ("text/plain",), (".txt", ".text", ".log")),
    Format(
        "Markdown",
        "markdown",
        ("text/markdown", "text/x-markdown"),
        (".md", ".markdown", ".mdown", ".mkd"),
    ),
    Format(
        "reStructuredText",
        "document",
        ("text/x-rst", "text/prs.fallenstein.rst"),
        (".rst", ".rest"),
    ),
    # kreuzberg reads AsciiDoc only through a tree-sitter grammar it downloads; its markup is
    # readable as it is, so it is indexed as text.
    Format("AsciiDoc", "text", ("text/asciidoc", "text/x-asciidoc"), (".adoc", ".asciidoc")),
    Format("Org", "document", ("text/x-org", "text/org"), (".org",)),
    Format("HTML", "document", ("text/html", "application/xhtml+xml"), (".html", ".htm", ".xhtml")),
    Format("XML", "document", ("application/xml", "text/xml"), (".xml",)),
    # Data formats are indexed as they are: their keys and values read well as they stand.
    Format("JSON", "text", ("application/json",), (".json", ".jsonl", ".ndjson")),
    Format(
        "YAML",
        "text",
        ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"),
        (".yaml", ".yml"),
    ),
    Format("TOML", "text", ("application/toml",), (".toml",)),
    Format("CSV", "document", ("text/csv",), (".csv",)),
    Format("TSV", "document", ("text/tab-separated-values",), (".tsv",)),
    Format("PDF", "document", ("application/pdf",), (".pdf",), binary=True),
    Format(
        "DOCX",
        "document",
        ("application/vnd.openxmlformats-officedocument.wordprocessingml.document",),
        (".docx",),
        binary=True,
    ),
    Format(
        "PPTX",
        "document",
        ("application/vnd.openxmlformats-officedocument.presentationml.presentation",),
        (".pptx",),
        binary=True,
    ),
    Format(
        "XLSX",
        "document",
        ("application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",),
        (".xlsx",),
        binary=True,
    ),
    Format("ODT", "document", ("application/vnd.oasis.opendocument.text",), (".odt",), True),
    Format("ODS", "document", ("application/vnd.oasis.opendocument.spreadsheet",), (".ods",), True),
    Format("RTF", "document", ("application/rtf", "text/rtf"), (".rtf",)),
    Format("EPUB", "document", ("application/epub+zip",), (".epub",), True),
    Format("E-mail", "document", ("message/rfc822",), (".eml",)),
    Format("Outlook message", "document", ("application/vnd.ms-outlook",), (".msg",), True),
    _code("Python", "text/x-python", ".py", ".pyi"),
    _code("JavaScript", "text/javascript", ".js", ".mjs", ".cjs", ".jsx"),
    _code("TypeScript", "text/x-typescript", ".ts", ".tsx", ".mts"),
    _code("Go", "text/x-go", ".go"),
    _code("Rust", "text/x-rust", ".rs"),
    _code("Java", "text/x-java", ".java"),
    _code("Kotlin", "text/x-kotlin", ".kt", ".kts"),
    _code("C", "text/x-c", ".c", ".h"),
    _code("C++", "text/x-c++", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".hxx"),
    _code("C#", "text/x-csharp", ".cs"),
    _code("Ruby", "text/x-ruby", ".rb"),
    _code("PHP", "text/x-php", ".php"),
    _code("Swift", "text/x-swift", ".swift"),
    _code("Scala", "text/x-scala", ".scala"),
    _code("Shell", "text/x-shellscript", ".sh", ".bash", ".zsh"),
    _code("SQL", "text/x-sql", ".sql"),
    _code("Lua", "text/x-lua", ".lua"),
    _code("R", "text/x-r", ".r"),
    Format(
        "Image",
        "image",
        ("image/png", "image/jpeg", "image/tiff", "image/gif", "image/webp", "image/bmp"),
        (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".gif", ".webp", ".bmp"),
        binary=True,
    ),
)

_BY_MIME = {mime: f for f in FORMATS for mime in f.mime_types}
_BY_EXTENSION = {ext: f for f in FORMATS for ext in f.extensions}
# Declared types that say nothing about the content: the name and the bytes decide.
GENERIC_TYPES = {"", "application/octet-stream", "binary/octet-stream", "application/unknown"}


def by_mime(mime: str) -> Format | None:
    mime = clean_mime(mime)
    if mime.startswith("image/"):
        return _BY_MIME.get(mime) or FORMATS[-1]
    return _BY_MIME.get(mime)


def by_name(name: str) -> Format | None:
    """The format a file name says, ignoring a trailing `.gz` (read after decompression)."""
    lower = name.lower()
    for ext in GZIP_EXTENSIONS:
        if lower.endswith(ext):
            lower = lower[: -len(ext)]
    dot = lower.rfind(".")
    return _BY_EXTENSION.get(lower[dot:]) if dot > 0 or (dot == 0 and len(lower) > 1) else None


def is_gzip_name(name: str) -> bool:
    return name.lower().endswith(GZIP_EXTENSIONS)


def clean_mime(mime: str | None) -> str:
    return (mime or "").split(";")[0].strip().lower()


def readable_types() -> dict[str, list[str]]:
    """Every media type and file extension an upload may carry (`GET /v1/types`)."""
    mimes = sorted({m for f in FORMATS for m in f.mime_types} | {GZIP_TYPE})
    extensions = sorted({e for f in FORMATS for e in f.extensions} | set(GZIP_EXTENSIONS))
    return {"mime_types": mimes, "extensions": extensions}
