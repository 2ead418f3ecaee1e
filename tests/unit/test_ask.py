"""The answer loop's pure parts: the tool's parameters as providers read them, filters the
model can only narrow, answers parsed and checked against a schema, request validation."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from services.common.messages.answers import AskQuery, ToolSearchArgs, schema_validator
from services.common.messages.queries import SearchFilters
from services.search.ask import _TOOL, _filters, _parse

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_tool_parameters_are_plain_json_schema():
    """No $ref, no anyOf-with-null, no titles: what every provider's tool format accepts."""
    params = _TOOL["function"]["parameters"]
    text = str(params)
    assert "$ref" not in text and "anyOf" not in text and "'title'" not in text
    assert params["required"] == ["query"]
    assert params["properties"]["top_k"]["type"] == "integer"
    mf = params["properties"]["metadata_filter"]
    assert mf["type"] == "object" and mf["additionalProperties"] is True
    assert mf["properties"]["tag_ids"]["items"] == {"type": "string"}


def args(**kw) -> ToolSearchArgs:
    return ToolSearchArgs.model_validate({"query": "q", **kw})


def test_model_filters_narrow_the_request_filters_never_widen_them():
    base = SearchFilters(
        tags=["hr", "policy"],
        document_name="handbook",
        upload_date_from=datetime(2024, 1, 1, tzinfo=UTC),
    )
    merged = _filters(
        base,
        args(
            metadata_filter={"tag_ids": ["policy", "finance"], "document_name": "x", "team": "a"},
            upload_date_from="2023-01-01T00:00:00Z",
            upload_date_to="2024-06-30",
        ),
    )
    assert merged is not None
    assert merged.tags == ["policy"]
    assert merged.document_name == "handbook"
    assert merged.upload_date_from == datetime(2024, 1, 1, tzinfo=UTC)
    assert merged.upload_date_to is not None and merged.upload_date_to.date().isoformat() == (
        "2024-06-30"
    )
    assert [(c.key, c.eq) for c in merged.metadata] == [("team", "a")]
    with pytest.raises(ValueError, match="tag_ids must be among"):
        _filters(base, args(metadata_filter={"tag_ids": ["finance"]}))
    assert _filters(None, args()) is None
    listed = _filters(None, args(metadata_filter={"year": [2023, 2024]}))
    assert listed is not None and listed.metadata[0].any_of == [2023, 2024]


def test_answers_are_parsed_leniently_and_checked_strictly():
    validator = schema_validator(SCHEMA)
    assert _parse('{"n": 3}', validator) == ({"n": 3}, None)
    assert _parse('```json\n{"n": 3}\n```', validator) == ({"n": 3}, None)
    assert "not JSON" in str(_parse("three", validator)[1])
    assert "'n' is a required property" in str(_parse("{}", validator)[1])
    assert "at n: 'x' is not of type 'integer'" in str(_parse('{"n": "x"}', validator)[1])
    assert _parse("", validator)[1] == "the answer is empty"


def test_ask_requests_are_validated():
    with pytest.raises(ValidationError, match="give a question, a document_id, or both"):
        AskQuery()
    with pytest.raises(ValidationError, match="not a valid JSON Schema"):
        AskQuery(question="q", response_schema={"type": "nonsense"})
    with pytest.raises(ValidationError):
        AskQuery(question="q", max_iterations=11)
    with pytest.raises(ValidationError):
        AskQuery(question="   ")
    assert AskQuery(document_id="doc-1").question is None


async def test_a_private_api_base_is_refused_before_any_call():
    """The chat model vets a client-chosen api_base with the egress policy: loopback is
    refused unless the operator allows it."""
    from services.common.domain.errors import Forbidden
    from services.common.outbound.egress import EgressPolicy
    from services.search.llm import LiteLLMChat

    def chat(policy: EgressPolicy) -> LiteLLMChat:
        return LiteLLMChat(
            "hosted_vllm/scripted",
            "http://127.0.0.1:9/v1",
            egress=lambda: policy,
        )

    with pytest.raises(Forbidden, match="non-public address"):
        await chat(EgressPolicy()).check()
    await chat(EgressPolicy(allow_private=True)).check()


def test_citations_name_the_section_and_page_of_what_they_cite():
    """A cited chunk's heading path and pages travel into the citation and its text."""
    from services.common.messages.answers import AskResponse, Usage
    from services.common.messages.queries import SearchHit
    from services.gateway.tools.rendering import render_answer
    from services.search.ask import _citations

    hit = SearchHit(
        chunk_id="c-1",
        kb_id="kb",
        document_id="d",
        document_name="report.pdf",
        chunk_index=3,
        total_chunks=9,
        content="The survey found quasarfjord.",
        heading_path=["Findings"],
        pages=[2],
    )
    [citation] = _citations("As c-1 says, yes.", [hit])
    assert (citation.heading_path, citation.pages, citation.slides) == (["Findings"], [2], [])
    response = AskResponse(
        answer="yes",
        citations=[citation],
        retrieved=[hit],
        iterations=1,
        searches=[],
        stopped="answered",
        model="m",
        usage=Usage(),
    )
    assert "- report.pdf, Findings · page 2, chunk 4 " in render_answer(response)
