"""Search and chunk requests and responses: the `search.query` / `search.chunk` contracts,
shared by the gateway (REST, MCP) and the search service."""

from __future__ import annotations

import re
from datetime import UTC, datetime, time
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

# Metadata keys are plain names: no dots, so a caller can never address another payload path.
# The most hits one search returns.
TOP_K_MAX = 50
METADATA_KEY = r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$"
_METADATA_KEY_RE = re.compile(METADATA_KEY)
_DATE_ONLY_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
Scalar = str | int | float | bool
MatchType = Literal["semantic", "keyword", "hybrid"]


def _utc(value: datetime) -> datetime:
    # Naive times are UTC (as stored upload times are); mixing naive and aware times would
    # otherwise make range checks fail with a TypeError instead of a clear answer.
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _end_of_day(value: Any) -> Any:
    """An inclusive upper bound given as a bare date means the whole of that day."""
    if isinstance(value, str) and _DATE_ONLY_RE.match(value.strip()):
        return datetime.combine(datetime.fromisoformat(value.strip()).date(), time.max, UTC)
    return value


Since = Annotated[datetime, AfterValidator(_utc)]
Until = Annotated[datetime, BeforeValidator(_end_of_day), AfterValidator(_utc)]


# How a search ranks: dense vectors, BM25 keywords, or both fused.
class Mode(StrEnum):
    hybrid = "hybrid"
    dense = "dense"
    keyword = "keyword"


class MetadataCondition(BaseModel):
    """One condition on a custom metadata key: exactly one of eq, any_of, a numeric range,
    or a date range."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(
        description="metadata key: 1-64 letters, digits, '_' or '-' (no dots: only "
        "top-level metadata keys can be filtered)",
        json_schema_extra={"pattern": METADATA_KEY},
    )
    eq: Scalar | None = Field(None, description="equal to this value (numbers: 3 equals 3.0)")
    any_of: list[StrictStr | StrictInt] | None = Field(
        None, min_length=1, description="equal to any of these strings or integers"
    )
    gte: float | None = Field(None, description="numeric value >= this")
    gt: float | None = Field(None, description="numeric value > this")
    lte: float | None = Field(None, description="numeric value <= this")
    lt: float | None = Field(None, description="numeric value < this")
    date_from: Since | None = Field(
        None, description="ISO 8601 date-time value at or after this (naive means UTC)"
    )
    date_to: Until | None = Field(
        None,
        description="ISO 8601 date-time value at or before this; a bare date means "
        "the end of that day",
    )

    @field_validator("key")
    @classmethod
    def _plain_key(cls, key: str) -> str:
        if not _METADATA_KEY_RE.match(key):
            raise ValueError(
                f"metadata key {key!r} is not allowed: use 1-64 letters, digits, '_' or '-' "
                "(no dots or other path characters)"
            )
        return key

    @model_validator(mode="after")
    def _one_kind(self) -> MetadataCondition:
        numeric = any(v is not None for v in (self.gte, self.gt, self.lte, self.lt))
        dates = self.date_from is not None or self.date_to is not None
        kinds = [self.eq is not None, self.any_of is not None, numeric, dates]
        if sum(kinds) != 1:
            raise ValueError(
                f"metadata condition on {self.key!r} needs exactly one of eq, any_of, "
                "a numeric range (gte/gt/lte/lt) or a date range (date_from/date_to)"
            )
        if self.gte is not None and self.gt is not None:
            raise ValueError(f"metadata range on {self.key!r}: give gte or gt, not both")
        if self.lte is not None and self.lt is not None:
            raise ValueError(f"metadata range on {self.key!r}: give lte or lt, not both")
        low = self.gte if self.gte is not None else self.gt
        high = self.lte if self.lte is not None else self.lt
        if low is not None and high is not None and low > high:
            raise ValueError(f"metadata range on {self.key!r} is inverted ({low} > {high})")
        if self.date_from and self.date_to and self.date_from > self.date_to:
            raise ValueError(
                f"metadata date range on {self.key!r} is inverted: date_from "
                f"{self.date_from.isoformat()} is after date_to {self.date_to.isoformat()}"
            )
        if self.any_of is not None and len({type(v) for v in self.any_of}) > 1:
            raise ValueError(f"any_of on {self.key!r} mixes strings and integers; use one type")
        return self


class SearchFilters(BaseModel):
    """Typed filters; all given filters must hold (AND). Lists match any of their values."""

    model_config = ConfigDict(extra="forbid")

    document_ids: list[str] | None = Field(
        None, min_length=1, description="only these documents (ids)"
    )
    source_ids: list[str] | None = Field(
        None, min_length=1, description="only documents of these sources (any of)"
    )
    tags: list[str] | None = Field(None, min_length=1, description="documents with any of these")
    collection: str | None = Field(None, description="only documents in this collection")
    document_name: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="document name to match, see document_name_match",
    )
    document_name_match: Literal["exact", "substring"] = Field(
        "substring",
        description="'substring': the name contains document_name, ignoring case; "
        "'exact': the name equals it, case included",
    )
    metadata: list[MetadataCondition] = Field(
        default_factory=list, max_length=20, description="conditions on custom metadata keys"
    )
    upload_date_from: Since | None = Field(
        None, description="uploaded at or after this ISO 8601 time (naive means UTC)"
    )
    upload_date_to: Until | None = Field(
        None,
        description="uploaded at or before this ISO 8601 time; a bare date means the "
        "end of that day",
    )

    @model_validator(mode="after")
    def _dates_ordered(self) -> SearchFilters:
        start, end = self.upload_date_from, self.upload_date_to
        if start is not None and end is not None and start > end:
            raise ValueError(
                f"upload date range is inverted: upload_date_from {start.isoformat()} is "
                f"after upload_date_to {end.isoformat()}"
            )
        return self


class SearchQuery(BaseModel):
    """What a client asks for."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4000)
    kb_ids: list[str] | None = Field(
        None, description="KB ids or names; omitted: every KB of the org"
    )
    top_k: int = Field(5, ge=1, le=TOP_K_MAX)
    mode: Mode = Mode.hybrid
    filters: SearchFilters | None = None
    min_score: float | None = Field(
        None,
        ge=0,
        le=1,
        description="drop matched chunks whose `score` is below this. `score` is the ranking "
        "score, 0-1, on the scale the response's `score_kind` names: 'fused' (1.0 = ranked "
        "first by every signal of the mode) or 'rerank' (the reranking model's relevance). "
        "Scores order the hits of one response; for a floor on meaning use min_similarity",
    )
    min_similarity: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="drop matched chunks whose `similarity` (cosine of chunk and query, "
        "typically 0.2-0.7 for relevant text with the default model) is below this; "
        "hybrid and dense mode only",
    )
    rerank: bool | None = Field(
        None,
        description="rerank the best candidates with the knowledge base's rerank_model "
        "(true), or not (false); omitted: as the knowledge base is set",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=200_000,
        description="pack the best hits, with their neighbour chunks, into this many tokens, "
        "in rank order and never cutting a chunk; `budget` in the response says what was "
        "left out",
    )
    coalesce_neighbors: int | None = Field(
        None, ge=0, le=5, description="chunks added on each side of a match; KB default if unset"
    )

    @field_validator("query")
    @classmethod
    def _has_text(cls, query: str) -> str:
        if not query.strip():
            raise ValueError("query must contain text, not only whitespace")
        return query

    @model_validator(mode="after")
    def _similarity_needs_vectors(self) -> SearchQuery:
        if self.min_similarity is not None and self.mode == Mode.keyword:
            raise ValueError(
                "min_similarity needs dense similarity: use mode 'hybrid' or 'dense', "
                "or min_score in keyword mode"
            )
        return self


class SearchRequest(SearchQuery):
    """What the gateway sends on `search.query`: the query plus the caller's org and scope."""

    org_id: str
    scope_kb_ids: list[str] | None = Field(None, description="the caller's KB scope, if any")


class SearchHit(BaseModel):
    chunk_id: str
    kb_id: str
    document_id: str
    document_name: str
    source_id: str | None = None
    uri: str | None = None
    chunk_index: int
    total_chunks: int
    content: str
    score: float | None = Field(
        None,
        description="the ranking score, 0-1, decreasing with rank (see SearchResponse."
        "score_kind); None for neighbour chunks",
    )
    similarity: float | None = Field(
        None,
        description="cosine similarity of the chunk and the query (-1..1) in hybrid and "
        "dense mode; None in keyword mode and for neighbour chunks",
    )
    rank: int | None = Field(None, description="1-based rank of a matched chunk")
    match_type: MatchType | None = Field(
        None,
        description="how the chunk matched: 'keyword' (keyword mode), 'semantic' (by meaning "
        "only: dense mode, or hybrid with none of the query's terms in the chunk), 'hybrid' "
        "(hybrid mode, by meaning and by the query's terms); None for neighbour chunks",
    )
    tags: list[str] = Field(default_factory=list)
    collection: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    is_matched: bool = True
    heading_path: list[str] = Field(
        default_factory=list,
        description="the headings above the chunk in its document, outermost first "
        "(empty for text without headings)",
    )
    pages: list[int] = Field(
        default_factory=list, description="the pages of a PDF the chunk lies on (1-based)"
    )
    slides: list[int] = Field(
        default_factory=list, description="the slides of a presentation the chunk lies on"
    )

    def place(self) -> str:
        """Where the chunk lies, for people and models: "Setup › Cooling · page 2"."""
        return place_text(self.heading_path, self.pages, self.slides)


def place_text(heading_path: list[str], pages: list[int], slides: list[int]) -> str:
    parts = [" › ".join(heading_path)] if heading_path else []
    for unit, numbers in (("page", pages), ("slide", slides)):
        if numbers:
            shown = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"
            parts.append(f"{unit}{'s' if len(numbers) > 1 else ''} {shown}")
    return " · ".join(parts)


class SearchResponse(BaseModel):
    query: str
    mode: Mode
    score_kind: Literal["fused", "rerank"] = Field(
        description="what `score` and `min_score` mean: 'fused' (reciprocal rank fusion of "
        "the mode's signals across every KB searched, 0-1, 1.0 = first in every one) or "
        "'rerank' (the rerank model's relevance score)"
    )
    kb_ids: list[str]
    coalesced: int = Field(
        0, description="neighbour chunks added on each side of matches (the widest window used)"
    )
    hits: list[SearchHit] = Field(
        description="matched chunks in rank order; with neighbours (coalesced > 0) grouped by "
        "document, documents in the order of their best match, chunks in document order"
    )
    budget: Budget | None = Field(None, description="with max_tokens: what was packed")
    warnings: list[str] = Field(
        default_factory=list,
        description="what did not go as asked, e.g. a reranker that failed (the hits are "
        "then in fused order)",
    )
    failed_kbs: list[KbFailure] = Field(
        default_factory=list,
        description="KBs that could not be searched (their embedding model unreachable or "
        "misconfigured...): the hits come from the other KBs only",
    )
    truncated: bool = Field(
        False,
        description="true when the reply was shortened to fit the message size limit: "
        "contents cut (ending in ' …') or the lowest-ranked hits left out",
    )


class KbFailure(BaseModel):
    """A KB left out of a multi-KB search, and why."""

    kb_id: str
    name: str
    error_type: str
    message: str


class OmittedHit(BaseModel):
    chunk_id: str
    document_name: str
    rank: int
    tokens: int = Field(description="tokens of the hit with its neighbours")


class Budget(BaseModel):
    max_tokens: int
    used_tokens: int
    omitted: list[OmittedHit] = Field(
        default_factory=list, description="matched hits left out because they did not fit"
    )
    omitted_neighbors: int = Field(
        0, description="neighbour chunks dropped so that their matched chunk fits"
    )


class ChunkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    org_id: str
    chunk_id: str
    kb_id: str | None = None
    neighbors: int = Field(0, ge=0, le=5)
    scope_kb_ids: list[str] | None = None


class ChunkResponse(BaseModel):
    chunk: SearchHit
    neighbors: list[SearchHit] = Field(default_factory=list)


class RemoteError(BaseModel):
    """How a request/reply service reports an error to its caller."""

    error_type: str
    message: str
    field: str | None = None
