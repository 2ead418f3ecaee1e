"""Search and chunk requests and responses: the `search.query` / `search.chunk` contracts,
shared by the gateway (REST, MCP) and the search service."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.store.base import Mode

# Metadata keys are plain names: no dots, so a caller can never address another payload path.
METADATA_KEY = r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$"
Scalar = str | int | float | bool


class MetadataCondition(BaseModel):
    """One condition on a custom metadata key: exactly one of eq, any_of, a numeric range,
    or a date range."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(pattern=METADATA_KEY, description="metadata key (no dots)")
    eq: Scalar | None = Field(None, description="equal to this value")
    any_of: list[str | int] | None = Field(None, min_length=1, description="equal to any")
    gte: float | None = None
    gt: float | None = None
    lte: float | None = None
    lt: float | None = None
    date_from: datetime | None = Field(None, description="ISO 8601, inclusive")
    date_to: datetime | None = Field(None, description="ISO 8601, inclusive")

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
        low = self.gte if self.gte is not None else self.gt
        high = self.lte if self.lte is not None else self.lt
        if low is not None and high is not None and low > high:
            raise ValueError(f"metadata range on {self.key!r} is inverted ({low} > {high})")
        if self.date_from and self.date_to and self.date_from > self.date_to:
            raise ValueError(f"metadata date range on {self.key!r} is inverted")
        return self


class SearchFilters(BaseModel):
    """Typed filters; all given filters must hold (AND). Lists match any of their values."""

    model_config = ConfigDict(extra="forbid")

    document_ids: list[str] | None = Field(None, min_length=1)
    source_ids: list[str] | None = Field(None, min_length=1)
    tags: list[str] | None = Field(None, min_length=1, description="documents with any of these")
    collection: str | None = None
    document_name: str | None = Field(None, min_length=1)
    document_name_match: Literal["exact", "substring"] = "substring"
    metadata: list[MetadataCondition] = Field(default_factory=list)
    upload_date_from: datetime | None = Field(None, description="ISO 8601, inclusive")
    upload_date_to: datetime | None = Field(None, description="ISO 8601, inclusive")

    @model_validator(mode="after")
    def _dates_ordered(self) -> SearchFilters:
        if self.upload_date_from and self.upload_date_to:
            if self.upload_date_from > self.upload_date_to:
                raise ValueError("upload_date_from is after upload_date_to")
        return self


class SearchQuery(BaseModel):
    """What a client asks for."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4000)
    kb_ids: list[str] | None = Field(
        None, description="KB ids or names; omitted: every KB of the org"
    )
    top_k: int = Field(5, ge=1, le=50)
    mode: Mode = Mode.hybrid
    filters: SearchFilters | None = None
    min_score: float | None = Field(
        None,
        description="drop hits whose `score` is below this (see SearchResponse.score_kind)",
    )
    coalesce_neighbors: int | None = Field(
        None, ge=0, le=5, description="chunks added on each side of a match; KB default if unset"
    )


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
    score: float | None = Field(None, description="None for neighbour chunks")
    rank: int | None = Field(None, description="1-based rank of a matched chunk")
    match_type: Literal["semantic", "keyword", "hybrid"] | None = None
    tags: list[str] = Field(default_factory=list)
    collection: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    is_matched: bool = True


class SearchResponse(BaseModel):
    query: str
    mode: Mode
    score_kind: str = Field(
        description="what `score` and `min_score` mean: 'cosine' (similarity of the chunk to "
        "the query, hybrid and dense) or 'bm25_relative' (BM25 relative to the best hit)"
    )
    kb_ids: list[str]
    coalesced: int = 0
    hits: list[SearchHit]


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
