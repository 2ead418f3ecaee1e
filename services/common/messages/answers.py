"""Answers: the `search.ask` contract (a question, the KBs a model may search, an optional JSON
Schema for the answer) and the `search_knowledge_base` tool the model is given. Shared by the
gateway (REST, MCP, stored prompts) and the search service, which runs the loop."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from jsonschema import SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.domain.limits import PlainText
from services.common.domain.models import utcnow
from services.common.messages.queries import SearchFilters, SearchHit, Since, Until

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_ITERATIONS = 10
MAX_TOP_K = 20
# Schemas that name no draft are read as 2020-12, the draft OpenAI and the MCP spec use.
_DEFAULT_DRAFT = validator_for({"$schema": "https://json-schema.org/draft/2020-12/schema"})


def schema_validator(schema: dict[str, Any]) -> Validator:
    """A validator for answers, of the draft the schema names (2020-12 by default)."""
    validator: Validator = validator_for(schema, default=_DEFAULT_DRAFT)(schema)
    return validator


def check_response_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A response schema must itself be a valid JSON Schema, or no answer could ever be
    checked against it."""
    if schema is None:
        return None
    try:
        validator_for(schema, default=_DEFAULT_DRAFT).check_schema(schema)
    except SchemaError as err:
        where = "/".join(str(p) for p in err.path) or "(root)"
        raise ValueError(
            f"response_schema is not a valid JSON Schema at {where}: {err.message}"
        ) from err
    return schema


class AskOptions(BaseModel):
    """How an answer is produced: what a stored prompt keeps and a request may give."""

    model_config = ConfigDict(extra="forbid")

    kb_ids: list[str] | None = Field(
        None,
        max_length=20,
        description="KB ids or names the model may search; omitted: every KB the caller can access",
    )
    model: PlainText | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="LiteLLM chat model id, e.g. 'openai/gpt-4o-mini', "
        "'anthropic/claude-sonnet-4-5', 'ollama_chat/llama3.1'; omitted: the server's "
        "default (KBMESH_ASK__MODEL)",
    )
    api_base: str | None = Field(
        None,
        max_length=2000,
        description="base URL of the model's API, for self-hosted or OpenAI-compatible servers",
    )
    instructions: PlainText | None = Field(
        None,
        max_length=20_000,
        description="system instructions: the task, what to extract, tone, language",
    )
    response_schema: dict[str, Any] | None = Field(
        None,
        description="JSON Schema the answer must follow; the answer is then JSON (an object "
        "for an object schema). Include a field for chunk ids if you want citations.",
    )
    max_iterations: int = Field(
        5,
        ge=1,
        le=MAX_ITERATIONS,
        description="model calls that may search; then the model answers without searching",
    )

    @field_validator("response_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_response_schema(schema)


class AskTask(BaseModel):
    """What to work on: a question, a document, or both (a stored prompt's run)."""

    model_config = ConfigDict(extra="forbid")

    question: str | None = Field(
        None,
        min_length=1,
        max_length=8000,
        description="the question or task; may be omitted when document_id is given and "
        "the instructions say what to do with the document",
    )
    document_id: str | None = Field(
        None,
        pattern=ID_PATTERN,
        description="a document whose text is given to the model as the thing to work on "
        "(extract from it, classify it, check it), with the KBs as context",
    )
    top_k: int = Field(5, ge=1, le=MAX_TOP_K, description="chunks per search the model makes")
    filters: SearchFilters | None = Field(
        None, description="filters every search of the model is restricted to (as in search)"
    )

    @field_validator("question")
    @classmethod
    def _has_text(cls, question: str | None) -> str | None:
        if question is not None and not question.strip():
            raise ValueError("question must contain text, not only whitespace")
        return question

    @model_validator(mode="after")
    def _has_task(self) -> AskTask:
        if self.question is None and self.document_id is None:
            raise ValueError("give a question, a document_id, or both")
        return self


class AskQuery(AskTask, AskOptions):
    """What a client asks (`POST /v1/ask`, `kb_ask`)."""


class Prompt(AskOptions):
    """A stored prompt, run over and over (e.g. the same extraction over every new document).
    Kept in the `prompts` KV bucket under `<org>.<prompt_id>`."""

    # Tolerant reader: a record written by a newer version must still load.
    model_config = ConfigDict(extra="ignore")

    org_id: str
    prompt_id: str
    name: str
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)

    @property
    def key(self) -> str:
        return f"{self.org_id}.{self.prompt_id}"

    def options(self) -> dict[str, Any]:
        """The fields a run takes from the prompt."""
        return {name: getattr(self, name) for name in AskOptions.model_fields}


class AskRequest(AskQuery):
    """What the gateway sends on `search.ask`: the query plus the caller's org and scope."""

    org_id: str
    scope_kb_ids: list[str] | None = Field(None, description="the caller's KB scope, if any")


class Citation(BaseModel):
    chunk_id: str
    document_id: str
    document_name: str
    kb_id: str
    chunk_index: int
    heading_path: list[str] = Field(
        default_factory=list, description="the headings above the cited chunk, outermost first"
    )
    pages: list[int] = Field(default_factory=list, description="the PDF pages it lies on")
    slides: list[int] = Field(default_factory=list, description="the slides it lies on")


class SearchMade(BaseModel):
    query: str
    hit_count: int = Field(description="chunks returned, neighbours included")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class AskResponse(BaseModel):
    answer: Any = Field(
        description="the model's answer: JSON following response_schema when one was given, "
        "else text"
    )
    citations: list[Citation] = Field(
        description="retrieved chunks whose id appears in the answer, in order of retrieval"
    )
    retrieved: list[SearchHit] = Field(description="every chunk the model's searches returned")
    iterations: int = Field(description="model calls made (repair and final calls included)")
    searches: list[SearchMade] = Field(description="the searches the model made, in order")
    stopped: Literal["answered", "iteration_limit"] = Field(
        description="'answered': the model answered on its own; 'iteration_limit': it was "
        "still searching at max_iterations and was asked for a final answer"
    )
    model: str = Field(description="the chat model that answered")
    usage: Usage


# ---- the tool the model calls ---------------------------------------------------------------

TOOL_NAME = "search_knowledge_base"
TOOL_DESCRIPTION = (
    "Search the knowledge bases for passages relevant to a query. Returns the best-matching "
    "chunks, each with an `id` (cite it in your answer when you use the passage), the "
    "document's name as `source`, and its text. Search again with other words when the "
    "results do not answer the question."
)


class ToolMetadataFilter(BaseModel):
    """Document name, tags and custom metadata keys (equality, or any of a list)."""

    model_config = ConfigDict(extra="allow")

    document_name: str | None = Field(
        None, description="only documents whose name contains this (case ignored)"
    )
    tag_ids: list[str] | None = Field(None, description="only documents with any of these tags")

    @property
    def custom(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ToolSearchArgs(BaseModel):
    """The arguments of `search_knowledge_base`, as the model sends them."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4000, description="what to look for")
    top_k: int | None = Field(
        None, ge=1, le=MAX_TOP_K, description="how many matching chunks to return"
    )
    coalesce_neighbors: int | None = Field(
        None, ge=0, le=5, description="also return this many chunks around each match"
    )
    metadata_filter: ToolMetadataFilter | None = Field(
        None,
        description="restrict by document name, tags (tag_ids) or custom metadata keys "
        "(key: value, or key: [values])",
    )
    upload_date_from: Since | None = Field(
        None, description="only documents uploaded at or after this (ISO 8601)"
    )
    upload_date_to: Until | None = Field(
        None, description="only documents uploaded at or before this (ISO 8601)"
    )

    @field_validator("query")
    @classmethod
    def _has_text(cls, query: str) -> str:
        if not query.strip():
            raise ValueError("query must contain text, not only whitespace")
        return query


class ToolResult(BaseModel):
    id: str = Field(description="the chunk's id: write it in your answer to cite this passage")
    content: str
    source: str = Field(description="the document's name")
    relevance: float | None = Field(description="similarity to the query; null for context")
    is_matched: bool = Field(description="false for neighbouring chunks added for context")
    chunk_index: int
    place: str | None = Field(
        None, description="where the passage lies in its document: section headings, page"
    )


class ToolSearchOutput(BaseModel):
    results: list[ToolResult]
    query: str
    sources_searched: int = Field(description="how many knowledge bases were searched")
    coalesced: int = Field(description="neighbour chunks added on each side of a match")


__all__ = [
    "TOOL_DESCRIPTION",
    "TOOL_NAME",
    "AskOptions",
    "AskQuery",
    "AskRequest",
    "AskResponse",
    "AskTask",
    "Citation",
    "Prompt",
    "SearchMade",
    "ToolMetadataFilter",
    "ToolResult",
    "ToolSearchArgs",
    "ToolSearchOutput",
    "Usage",
    "check_response_schema",
    "schema_validator",
]
