"""Typed search filters → engine filter tree. Caller keys only ever reach `metadata.*`."""

from __future__ import annotations

from services.common.queries import SearchFilters
from services.common.store import Condition, DateRange, Filter, Match, MatchAny, MatchText, Range


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
            must.append(MatchText("document_name", filters.document_name))
    for cond in filters.metadata:
        key = f"metadata.{cond.key}"
        if cond.eq is not None:
            value = cond.eq
            if isinstance(value, float) and not value.is_integer():
                must.append(Range(key, gte=value, lte=value))
            else:
                must.append(Match(key, int(value) if isinstance(value, float) else value))
        elif cond.any_of is not None:
            must.append(MatchAny(key, tuple(cond.any_of)))
        elif cond.date_from is not None or cond.date_to is not None:
            must.append(DateRange(key, gte=cond.date_from, lte=cond.date_to))
        else:
            must.append(Range(key, gte=cond.gte, gt=cond.gt, lte=cond.lte, lt=cond.lt))
    if filters.upload_date_from or filters.upload_date_to:
        must.append(
            DateRange("uploaded_at", gte=filters.upload_date_from, lte=filters.upload_date_to)
        )
    return Filter(must=tuple(must))
