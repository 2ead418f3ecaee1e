"""Search filters: validation of what callers send (services/common/messages/queries.py) and its
translation into the store's filter tree (services/search/filters.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from services.common.messages.queries import MetadataCondition, SearchFilters, SearchQuery
from services.common.store import DateRange, Filter, Match, MatchAny, MatchSubstring, Range
from services.search.filters import build_filter


def flt(**filters: object) -> Filter:
    return build_filter("org-1", SearchFilters.model_validate(filters))


def test_org_condition_is_always_first_and_alone_without_filters() -> None:
    assert build_filter("org-1", None) == Filter(must=(Match("org_id", "org-1"),))
    assert build_filter("org-1", SearchFilters()).must == (Match("org_id", "org-1"),)
    assert flt(tags=["x"]).must[0] == Match("org_id", "org-1")


def test_each_filter_translates_to_its_engine_condition() -> None:
    """Lists become any-of conditions on fixed payload fields; nothing else is named."""
    result = flt(
        document_ids=["d1", "d2"],
        source_ids=["s"],
        tags=["a", "b"],
        collection="c",
        upload_date_from="2024-01-01T00:00:00Z",
        upload_date_to="2024-02-01T00:00:00+01:00",
    )
    assert result.must[1:] == (
        MatchAny("document_id", ("d1", "d2")),
        MatchAny("source_id", ("s",)),
        MatchAny("tags", ("a", "b")),
        Match("collection", "c"),
        DateRange(
            "uploaded_at",
            gte=datetime(2024, 1, 1, tzinfo=UTC),
            lte=datetime.fromisoformat("2024-02-01T00:00:00+01:00"),
        ),
    )


def test_document_name_exact_and_casefolded_substring() -> None:
    """Exact compares the name as is; substring compares casefolded values."""
    assert flt(document_name="Hand Book.md", document_name_match="exact").must[1] == Match(
        "document_name_exact", "Hand Book.md"
    )
    assert flt(document_name="HandBOOK").must[1] == MatchSubstring(
        "document_name_folded", "handbook"
    )


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ({"key": "team", "eq": "core"}, Match("metadata.team", "core")),
        ({"key": "public", "eq": True}, Match("metadata.public", True)),
        # Numbers compare by value: 3 finds a stored 3 or 3.0.
        ({"key": "year", "eq": 2024}, Range("metadata.year", gte=2024.0, lte=2024.0)),
        ({"key": "score", "eq": 2.5}, Range("metadata.score", gte=2.5, lte=2.5)),
        ({"key": "team", "any_of": ["a", "b"]}, MatchAny("metadata.team", ("a", "b"))),
        ({"key": "year", "any_of": [2021, 2023]}, MatchAny("metadata.year", (2021, 2023))),
        ({"key": "n", "gt": 1, "lte": 5}, Range("metadata.n", gt=1.0, lte=5.0)),
        (
            {"key": "d", "date_from": "2024-01-01T00:00:00", "date_to": "2024-01-31"},
            DateRange(
                "metadata.d",
                gte=datetime(2024, 1, 1, tzinfo=UTC),
                # A bare date as the upper bound covers that whole day.
                lte=datetime(2024, 1, 31, 23, 59, 59, 999999, tzinfo=UTC),
            ),
        ),
    ],
)
def test_metadata_conditions(condition: dict[str, object], expected: object) -> None:
    assert flt(metadata=[condition]).must[1] == expected


def test_metadata_keys_only_reach_metadata() -> None:
    """Every caller key is prefixed with `metadata.`; the key pattern admits no path syntax."""
    result = flt(metadata=[{"key": "org_id", "eq": "other"}, {"key": "tags", "any_of": ["x"]}])
    assert result.must == (
        Match("org_id", "org-1"),
        Match("metadata.org_id", "other"),
        MatchAny("metadata.tags", ("x",)),
    )


def problem(exc: pytest.ExceptionInfo[ValidationError]) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.value.errors()
    )


@pytest.mark.parametrize(
    ("filters", "names"),
    [
        # unknown operator on a metadata condition
        ({"metadata": [{"key": "year", "contains": 3}]}, ["metadata.0.contains", "Extra"]),
        # unknown filter field
        ({"author": "me"}, ["author", "Extra"]),
        # wrong types
        ({"tags": "finance"}, ["tags", "list"]),
        ({"document_ids": [1, 2]}, ["document_ids.0", "string"]),
        ({"upload_date_from": "last tuesday"}, ["upload_date_from", "datetime"]),
        ({"metadata": [{"key": "year", "gte": "a lot"}]}, ["metadata.0.gte", "number"]),
        ({"metadata": [{"key": "year", "eq": {"$gt": 1}}]}, ["metadata.0.eq"]),
        ({"metadata": [{"key": "year", "any_of": [True]}]}, ["metadata.0.any_of.0"]),
        ({"metadata": [{"key": "t", "any_of": ["a", 1]}]}, ["mixes strings and integers"]),
        ({"metadata": [{"key": "t", "any_of": []}]}, ["metadata.0.any_of", "at least 1"]),
        ({"document_name_match": "regex", "document_name": "x"}, ["document_name_match"]),
        # inverted ranges
        (
            {"upload_date_from": "2024-02-01", "upload_date_to": "2024-01-01"},
            ["upload date range is inverted", "upload_date_from"],
        ),
        (
            {"metadata": [{"key": "d", "date_from": "2024-02-01", "date_to": "2024-01-01"}]},
            ["'d'", "inverted"],
        ),
        ({"metadata": [{"key": "n", "gte": 5, "lt": 1}]}, ["'n'", "inverted"]),
        # one kind per condition
        ({"metadata": [{"key": "n", "eq": 1, "gte": 0}]}, ["exactly one of"]),
        ({"metadata": [{"key": "n"}]}, ["exactly one of"]),
        ({"metadata": [{"key": "n", "gte": 1, "gt": 0}]}, ["gte or gt"]),
        # keys that would address other payload paths
        ({"metadata": [{"key": "a.b", "eq": 1}]}, ["metadata.0.key", "'a.b'", "no dots"]),
        ({"metadata": [{"key": "../org_id", "eq": 1}]}, ["metadata.0.key", "not allowed"]),
        ({"metadata": [{"key": "", "eq": 1}]}, ["metadata.0.key"]),
        ({"metadata": [{"key": "tags[0]", "eq": 1}]}, ["metadata.0.key"]),
    ],
)
def test_malformed_filters_are_rejected_naming_the_problem(
    filters: dict[str, object], names: list[str]
) -> None:
    with pytest.raises(ValidationError) as exc:
        SearchFilters.model_validate(filters)
    message = problem(exc)
    for name in names:
        assert name in message, message


def test_naive_and_aware_bounds_compare_as_utc() -> None:
    """A naive and an aware time in one range are compared (naive = UTC), not a crash."""
    f = SearchFilters.model_validate(
        {"upload_date_from": "2024-01-01T10:00:00", "upload_date_to": "2024-01-01T12:00:00+01:00"}
    )
    assert f.upload_date_from == datetime(2024, 1, 1, 10, tzinfo=UTC)
    with pytest.raises(ValidationError, match="inverted"):
        SearchFilters.model_validate(
            {
                "upload_date_from": "2024-01-01T12:00:00",
                "upload_date_to": "2024-01-01T12:00:00+01:00",
            }
        )
    cond = MetadataCondition.model_validate({"key": "d", "date_from": "2024-01-01T00:00:00"})
    assert cond.date_from is not None and cond.date_from.tzinfo is not None


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"query": "x", "top_k": 0}, "top_k"),
        ({"query": "x", "top_k": 51}, "top_k"),
        ({"query": "x", "coalesce_neighbors": 6}, "coalesce_neighbors"),
        ({"query": "x", "mode": "fuzzy"}, "mode"),
        ({"query": "   "}, "query"),
        ({"query": ""}, "query"),
        ({"query": "x", "min_score": "high"}, "min_score"),
    ],
)
def test_query_bounds(body: dict[str, object], name: str) -> None:
    with pytest.raises(ValidationError) as exc:
        SearchQuery.model_validate(body)
    assert name in problem(exc)


def test_top_k_bounds_are_inclusive() -> None:
    assert SearchQuery(query="x").top_k == 5
    assert SearchQuery.model_validate({"query": "x", "top_k": 1}).top_k == 1
    assert SearchQuery.model_validate({"query": "x", "top_k": 50}).top_k == 50
