"""Which knowledge bases a document is in, and telling embed so: `kb.index` for each KB a
document is in, `kb.remove` for each it left. A document belongs to a KB when its tags match
the KB's (`KnowledgeBase.matches`); a document written and a KB changed at the same time
are reconciled from both sides (`Membership.apply` and `Membership.kb_changed`)."""

from __future__ import annotations

import functools
import logging

from services.common.bus.registry import Registries
from services.common.domain.errors import Transient
from services.common.domain.models import DocStatus, DocumentRecord, utcnow
from services.common.messages.events import KbChanged, KbIndex, KbRemove, Publish
from services.common.messages.names import Subject
from services.ingest.records import CAS_ATTEMPTS, Records

log = logging.getLogger("kbmesh.ingest")


class Membership:
    def __init__(self, registries: Registries, records: Records, publish: Publish) -> None:
        self.reg = registries
        self.records = records
        self.publish = publish

    async def apply(self, record: DocumentRecord, last: int | None) -> DocumentRecord:
        """Write `record` with its KB membership (compare-and-set on `last`) and announce it.

        The KB list is read before the write; a KB changed after that read is handled by
        ingest's `kb.changed` consumer only if it sees this write. When it may have read the
        record before it, the KB list read again after the write shows the change, and the
        membership is corrected here."""
        kbs = await self.reg.kbs.list(f"{record.org_id}.")
        members = sorted(kb.kb_id for kb in kbs if kb.matches(record.tags))
        lost = sorted(set(record.kb_ids) - set(members))
        record.kb_ids = members
        record.kb_errors = {}  # a new revision is a new attempt everywhere
        record.updated_at = utcnow()
        last = await self.records.save(record, last)
        await self.announce(record, members, lost)
        log.info(
            "document org_id=%s document_id=%s revision=%d kbs=%s removed=%s",
            record.org_id,
            record.document_id,
            record.revision,
            members,
            lost,
        )
        # Until the KB list read after our last write agrees with it: each correction is a
        # write, after which a KB may have changed again.
        for _ in range(CAS_ATTEMPTS):
            kbs = await self.reg.kbs.list(f"{record.org_id}.")
            now = sorted(kb.kb_id for kb in kbs if kb.matches(record.tags))
            if now == record.kb_ids:
                return record
            corrected = await self.records.cas(functools.partial(self._set_members, record, now))
            if corrected is None:
                return record  # deleted or changed again: that change announces itself
            record, was = corrected
            gained = sorted(set(now) - set(was))
            lost = sorted(set(was) - set(now))
            log.info(
                "membership corrected org_id=%s document_id=%s kbs=%s removed=%s",
                record.org_id,
                record.document_id,
                gained,
                lost,
            )
            for kb_id in gained:
                await self._index(record, kb_id, dedupe=False)
            for kb_id in lost:
                await self._remove(record, kb_id, dedupe=False)
        raise Transient(f"knowledge bases of {record.org_id} keep changing; retrying later")

    async def _set_members(
        self, record: DocumentRecord, members: list[str]
    ) -> tuple[DocumentRecord, list[str]] | None:
        """Write `members` as the KBs of `record`'s revision as stored; that record and the
        KBs it had (a `kb.changed` may have moved it meanwhile), or None when it was deleted
        or changed again."""
        current, last = await self.records.get(record.key)
        if current is None or current.revision != record.revision:
            return None
        was = current.kb_ids
        current.kb_ids = members
        await self.records.save(current, last)
        return current, was

    async def announce(self, record: DocumentRecord, members: list[str], lost: list[str]) -> None:
        for kb_id in members:
            await self._index(record, kb_id)
        for kb_id in lost:
            await self._remove(record, kb_id)

    async def _index(self, record: DocumentRecord, kb_id: str, *, dedupe: bool = True) -> None:
        await self._send(Subject.KB_INDEX, KbIndex, "i", record, kb_id, dedupe)

    async def _remove(self, record: DocumentRecord, kb_id: str, *, dedupe: bool = True) -> None:
        await self._send(Subject.KB_REMOVE, KbRemove, "r", record, kb_id, dedupe)

    async def _send(
        self,
        subject: Subject,
        kind: type[KbIndex] | type[KbRemove],
        prefix: str,
        record: DocumentRecord,
        kb_id: str,
        dedupe: bool,
    ) -> None:
        event = kind(
            org_id=record.org_id,
            kb_id=kb_id,
            document_id=record.document_id,
            revision=record.revision,
        )
        if dedupe:
            # Deterministic: a redelivered upload republishes the same ids, and JetStream
            # drops them. The change's own event id is part of it because a revision alone
            # is not unique over time: a document deleted and uploaded again starts over at
            # revision 1.
            event.event_id = (
                f"{prefix}-{kb_id}-{record.document_id}-{record.revision}-{record.last_event_id}"
            )
        await self.publish(subject, event)

    async def kb_changed(self, ev: KbChanged) -> None:
        """Backfill or remove documents when a KB is created, retagged, reconfigured."""
        kb = await self.reg.kbs.get(f"{ev.org_id}.{ev.kb_id}")
        if ev.change == "deleted":
            kb = None
        rebuild = ev.change in ("settings", "reindex", "retry_failed")

        def member(record: DocumentRecord) -> bool:
            return kb is not None and kb.matches(record.tags)

        async def move(key: str) -> None:
            # Read again: it may have changed since the listing.
            record, last = await self.records.get(key)
            if record is None or record.status != DocStatus.ready:
                return
            now, was = member(record), ev.kb_id in record.kb_ids
            retried = rebuild and ev.kb_id in record.kb_errors
            if now != was or retried:
                record.kb_ids = sorted(
                    {*record.kb_ids, ev.kb_id} if now else set(record.kb_ids) - {ev.kb_id}
                )
                record.kb_errors.pop(ev.kb_id, None)
                await self.records.save(record, last)
            # Fresh event ids: a KB change moves documents without bumping their revision, so
            # a document can leave, rejoin and leave a KB at one revision; ids derived from
            # the revision would make JetStream drop the second removal as a duplicate.
            if now and (rebuild or not was):
                await self._index(record, ev.kb_id, dedupe=False)
            elif was and not now:
                await self._remove(record, ev.kb_id, dedupe=False)

        for listed in await self.reg.documents.list(f"{ev.org_id}."):
            # A document written after the listing checks the KBs again itself (see
            # `Membership.apply`), so deciding from the listing here loses nothing.
            if listed.status != DocStatus.ready:
                continue
            if not rebuild and member(listed) == (ev.kb_id in listed.kb_ids):
                continue
            await self.records.cas(functools.partial(move, listed.key))
