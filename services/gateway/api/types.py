"""REST: the document formats this server reads, so that clients upload what it can read."""

from __future__ import annotations

from fastapi import APIRouter

from services.gateway.api.deps import Caller
from services.gateway.schemas import TypesView, types_view

router = APIRouter(prefix="/v1/types", tags=["documents"])


@router.get("")
async def list_types(caller: Caller) -> TypesView:
    """Every format uploads may hold: media types and file extensions. Any of them may be
    gzip-compressed; the format is also sniffed from the content."""
    return types_view()
