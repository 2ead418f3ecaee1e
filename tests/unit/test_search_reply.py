"""A search reply on the bus: serialised once, fitted to the message limit, and its result's
JSON taken out as the responder wrote it."""

from __future__ import annotations

import json

from services.common.bus.replies import envelope, result_json
from services.common.messages.queries import SearchHit, SearchResponse
from services.search.reply import MARGIN_BYTES, fitted_json


def response(hits: int, content: str) -> SearchResponse:
    return SearchResponse(
        query="q",
        mode="hybrid",
        score_kind="fused",
        kb_ids=["kb_1"],
        hits=[
            SearchHit(
                chunk_id=f"c{i}",
                document_id="d",
                document_name="doc",
                kb_id="kb_1",
                chunk_index=i,
                total_chunks=hits,
                content=content,
                score=1.0 / (i + 1),
                rank=i + 1,
            )
            for i in range(hits)
        ],
    )


def test_the_result_json_is_the_one_the_responder_wrote():
    body = response(3, "über 1 €").model_dump_json().encode()
    assert result_json(envelope("result", body)) == body
    assert json.loads(envelope("result", body))["result"]["hits"][0]["content"] == "über 1 €"
    error = envelope("error", b'{"error_type": "NotFound", "message": "no"}')
    assert result_json(error) is None
    assert result_json(b"not a reply") is None


def test_a_reply_that_fits_is_serialised_as_is_and_one_too_large_is_fitted():
    small = response(3, "short")
    assert fitted_json(small, 1024 * 1024) == small.model_dump_json().encode()
    # Multi-byte characters: the limit is in bytes, not characters.
    large = response(10, "€" * 4000)
    limit = 64 * 1024
    assert (
        len(large.model_dump_json()) < limit - MARGIN_BYTES < len(large.model_dump_json().encode())
    )
    fitted = fitted_json(large, limit)
    assert len(fitted) <= limit - MARGIN_BYTES
    assert json.loads(fitted)["truncated"] is True
