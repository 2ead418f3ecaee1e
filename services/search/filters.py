"""Typed search filters → the store's filter tree. Caller keys only ever reach `metadata.*`,
and the org condition is always there."""

from __future__ import annotations

from services.common.messages.queries import MetadataCondition, SearchFilters
from services.common.store import (
    Condition,
    DateRange,
    Filter,
    Match,
    MatchAny,
    MatchSubstring,
    Range,
)


def build_filter(org_id: str, filters: SearchFilters | None) -> Filter:
    """The org condition is always first; nothing a caller sends can remove it."""
    must: list[Condition] = [Match("org_id", org_id)]
    if filters is None:
        return Filter(must=tuple(must))
    if filters.document_ids:
        must.append(MatchAny("document_id", tuple(filters.document_ids)))
    if filters.source_ids:
        must.append(MatchAny("source_id", tuple(filters.source_ids)))
    if filters.tags:
        must.append(MatchAny("tags", tuple(filters.tags)))
    if filters.collection:
        must.append(Match("collection", filters.collection))
    if filters.document_name:
        if filters.document_name_match == "exact":
            must.append(Match("document_name_exact", filters.document_name))
        else:
            # The engine's substring match is case-sensitive; the payload keeps a casefolded
            # copy of the name so that "handbook" finds "Employee Handbook.pdf".
            must.append(MatchSubstring("document_name_folded", filters.document_name.casefold()))
    must.extend(metadata_condition(cond) for cond in filters.metadata)
    if filters.upload_date_from or filters.upload_date_to:
        must.append(
            DateRange("uploaded_at", gte=filters.upload_date_from, lte=filters.upload_date_to)
        )
    return Filter(must=tuple(must))


def metadata_condition(cond: MetadataCondition) -> Condition:
    # The key was checked against a plain-name pattern (no dots), so it names one top-level
    # metadata field and nothing else.
    key = f"metadata.{cond.key}"
    if cond.eq is not None:
        value = cond.eq
        if isinstance(value, int | float) and not isinstance(value, bool):
            # A one-point range: 3 matches a stored 3 or 3.0 alike (an exact match would
            # compare integers only).
            return Range(key, gte=float(value), lte=float(value))
        return Match(key, value)
    if cond.any_of is not None:
        return MatchAny(key, tuple(cond.any_of))
    if cond.date_from is not None or cond.date_to is not None:
        return DateRange(key, gte=cond.date_from, lte=cond.date_to)
    return Range(key, gte=cond.gte, gt=cond.gt, lte=cond.lte, lt=cond.lt)
