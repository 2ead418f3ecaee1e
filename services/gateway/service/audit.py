"""The audit trail for org admins: who wrote, deleted or changed what in their org."""

from __future__ import annotations

from services.common.bus.audit import AuditQuery, read_audit
from services.common.bus.client import Bus
from services.gateway.auth import Principal
from services.gateway.schemas import AuditList


class AuditLog:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def read(self, p: Principal, query: AuditQuery) -> AuditList:
        """The caller's org's entries, oldest first; only an org admin may read them (a
        scoped key would learn of KBs and documents outside its scope)."""
        p.check_admin()
        read = await read_audit(self.bus.js, p.org_id, query)
        return AuditList(items=read.entries, total=len(read.entries), skipped=read.skipped)
