"""REST: the audit trail (writes, deletes, KB and key changes, with their writers)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from services.common.bus.audit import MAX_READ, AuditAction, AuditKind, AuditQuery
from services.gateway.api.deps import AuditTrail, Caller
from services.gateway.schemas import AuditList

router = APIRouter(prefix="/v1/audit", tags=["audit"])


@router.get("")
async def list_audit(
    audit: AuditTrail,
    caller: Caller,
    writer: Annotated[
        str | None,
        Query(
            max_length=200,
            description="an API key's id or name, a publisher's user, or local / bus / "
            "operator / key",
        ),
    ] = None,
    kind: Annotated[
        AuditKind | None, Query(description="document, kb, key, backup or source")
    ] = None,
    action: Annotated[
        AuditAction | None,
        Query(description="uploaded, changed, deleted, created, failed, restored or refused"),
    ] = None,
    document_id: Annotated[str | None, Query(max_length=64)] = None,
    kb_id: Annotated[str | None, Query(max_length=64)] = None,
    since: Annotated[datetime | None, Query(description="ISO 8601, inclusive")] = None,
    until: Annotated[datetime | None, Query(description="ISO 8601, inclusive")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_READ)] = 100,
) -> AuditList:
    """The org's audit entries, oldest first (org admins only: an unscoped, writable key)."""
    return await audit.read(
        caller,
        AuditQuery(
            writer=writer,
            kind=kind,
            action=action,
            document_id=document_id,
            kb_id=kb_id,
            since=since,
            until=until,
            limit=limit,
        ),
    )
