"""Limits on what a document may carry besides its content: checked by the gateway before
anything is stored (413/422), and by ingest for events that upstream systems publish
(dead letter). One function, so both edges enforce the same rules.

Sizes over a limit are `TooLarge` (413); malformed values (NUL bytes, lone surrogates,
nesting too deep, too many or too long labels) are `InvalidInput` (422). The limits an
operator sizes (bytes, time, memory) are settings; the shape of a document's labels is fixed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from services.common.domain.errors import InvalidInput, TooLarge

SETTING = "KBMESH_LIMITS__"
# The shape of a document's labels, the same for every deployment: a KB's `tag_ids` take as
# many tags, each as long, as a document may carry, so any document's tags can be a KB's.
TAGS_PER_DOCUMENT = 100
TAG_LENGTH = 200  # characters per tag or collection
METADATA_DEPTH = 8  # nesting of objects and lists in metadata: records, not documents
URI_LENGTH = 2048  # characters of a document's uri: what browsers and proxies carry


class LimitSettings(BaseModel):
    metadata_bytes: int = Field(64 * 1024, ge=2, description="a document's metadata as JSON")
    fetch_total_seconds: float = Field(
        60.0,
        gt=0,
        description="an upload by URL: the whole fetch (every redirect, headers and body), "
        "however steadily the server drips bytes",
    )
    extract_memory_mb: int = Field(
        1024, ge=128, description="address space of the process that reads one document"
    )
    extract_seconds: float = Field(
        60.0, gt=0, description="CPU time to read one document (10x that of wall time at most)"
    )
    extract_workers: int = Field(
        2, ge=1, le=64, description="documents read at once (one child process each)"
    )
    extract_expanded_bytes: int = Field(
        100 * 1024 * 1024,
        ge=1024,
        description="what compressed content (gzip, the zip of an office file) may expand to",
    )
    extract_expansion_ratio: int = Field(
        200, ge=2, description="how many times its size compressed content may expand"
    )


def check_labels(tags: Iterable[str], collection: str | None) -> None:
    tags = list(tags)
    if len(tags) > TAGS_PER_DOCUMENT:
        raise InvalidInput(
            f"a document may have at most {TAGS_PER_DOCUMENT} tags, got {len(tags)}",
            field="tags",
        )
    for tag in tags:
        if not tag.strip() or len(tag) > TAG_LENGTH:
            raise InvalidInput(
                f"invalid tag {tag[:40]!r}: 1-{TAG_LENGTH} characters, not only whitespace",
                field="tags",
            )
        check_text(tag, "tags")
    if collection is not None:
        if not collection.strip() or len(collection) > TAG_LENGTH:
            raise InvalidInput(f"collection must be 1-{TAG_LENGTH} characters", field="collection")
        check_text(collection, "collection")


def check_document_fields(
    *,
    name: str,
    source_id: str,
    uri: str | None,
    tags: Iterable[str],
    collection: str | None,
    metadata: dict[str, Any] | None,
    limits: LimitSettings,
) -> None:
    """Every field of an upload or a change besides its content."""
    check_text(name, "name")
    check_text(source_id, "source_id")
    if uri is not None:
        if len(uri) > URI_LENGTH:
            raise InvalidInput(
                f"uri has {len(uri)} characters, over the limit of {URI_LENGTH}", field="uri"
            )
        check_text(uri, "uri")
    check_labels(tags, collection)
    if metadata is not None:
        check_metadata(metadata, limits)


def check_metadata(metadata: dict[str, Any], limits: LimitSettings) -> None:
    # Depth first, without recursion: the size check below serialises, and serialising a
    # structure thousands of levels deep is what must not happen.
    stack: list[tuple[Any, int]] = [(metadata, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > METADATA_DEPTH:
                raise InvalidInput(
                    f"metadata is nested more than {METADATA_DEPTH} levels deep", field="metadata"
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    check_text(key, "metadata")
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            check_text(value, "metadata")
    size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8"))
    if size > limits.metadata_bytes:
        raise TooLarge(
            f"metadata has {size} bytes as JSON, over the limit of {limits.metadata_bytes} "
            f"({SETTING}METADATA_BYTES)",
            field="metadata",
        )


def check_text(value: str, field: str) -> None:
    """Text that every store and every JSON encoder can keep: no NUL characters, and valid
    Unicode (a lone surrogate such as "\\ud800" cannot be encoded as UTF-8)."""
    if "\x00" in value:
        raise InvalidInput(f"{field} contains a NUL character", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInput(
            f"{field} is not valid Unicode: a lone surrogate at position {err.start}",
            field=field,
        ) from err


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    return value


# A name, label or instruction in a request model: NUL is refused where the model is
# validated, so REST, the tools and MCP refuse it alike.
PlainText = Annotated[str, AfterValidator(_no_nul)]
# A KB's tag_ids: as many as a document may carry tags, each as long as a tag may be.
KbTag = Annotated[PlainText, Field(min_length=1, max_length=TAG_LENGTH)]


def check_extracted_text(text: str, max_bytes: int) -> None:
    """The text a document yields: not empty, and within the size a document's content may
    have (`KBMESH_MAX_CONTENT_BYTES`: a DOCX or a PDF can hold more text than its size)."""
    if not text.strip():
        raise InvalidInput("the document has no text (empty or whitespace only)", field="content")
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise TooLarge(
            f"the document's text has {size} bytes after extraction, over the limit of "
            f"{max_bytes} (KBMESH_MAX_CONTENT_BYTES)",
            field="content",
        )
